"""Output-length predictor: a quantile of recently observed output lengths per (model, input bucket).

    predict(model, P, max_tokens) = min(max_tokens, Q_q(outputs seen for model in bucket(P)))

with Q_q the nearest-rank q-quantile (the ceil(q·n)-th smallest of the last `window` observations) and
bucket(P) the input-length bucket [edges[i], edges[i+1]). With fewer than `min_samples` observations it
falls back to `max_tokens` (the worst case), so a cold predictor never overbooks (the gateway's
`server.footprint.route_request` asks `predict` whether or not the bucket is warm).

As tokens stream, a request that reaches its reservation is *grown*:

    grow(model, P, generated, max_tokens) = min(max_tokens, max(generated + min_step, Q_q(outputs > generated)))

the same quantile conditioned on having already produced `generated` tokens (survival) when at least
max(1, min_samples // 4) observations are that long, else doubling: generated + max(generated, min_step). Pure and deterministic; the
gateway feeds `observe` at completion, the simulator the same. Growth follows streamed tokens: a
non-streaming request is never grown and holds its prediction to the end (docs/kv.md, output modes).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Sequence

DEFAULT_INPUT_EDGES: tuple[int, ...] = (0, 256, 1024, 4096, 16384, 65536)


class LengthPredictor:
    """Per (model, input bucket) ring buffers of observed output lengths and their quantiles."""

    def __init__(
        self,
        quantile: float = 0.9,
        window: int = 512,
        min_samples: int = 20,
        input_edges: Sequence[int] = DEFAULT_INPUT_EDGES,
        min_step: int = 16,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1 or min_samples < 1 or min_step < 1:
            raise ValueError("window, min_samples and min_step must be ≥ 1")
        edges = list(input_edges)
        if not edges or edges[0] != 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"input_edges must start at 0 and increase strictly, got {edges}")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.min_step = min_step
        self._edges = edges
        self._seen: dict[tuple[str, int], deque[int]] = {}
        # predict() runs once per request and observe() once per completion: keep each bucket's quantile
        # until its next observation instead of sorting the window on every request.
        self._quantiles: dict[tuple[str, int], int] = {}

    def bucket(self, prompt_tokens: int) -> int:
        """Index i with edges[i] ≤ P < edges[i+1]; the last bucket is open-ended."""
        return max(0, bisect.bisect_right(self._edges, max(0, prompt_tokens)) - 1)

    def observe(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        key = (model, self.bucket(prompt_tokens))
        buf = self._seen.get(key)
        if buf is None:
            buf = self._seen[key] = deque(maxlen=self.window)
        buf.append(max(0, int(output_tokens)))
        self._quantiles.pop(key, None)

    def count(self, model: str, prompt_tokens: int) -> int:
        """How many observations the bucket holds (without copying them, unlike `samples`)."""
        seen = self._seen.get((model, self.bucket(prompt_tokens)))
        return 0 if seen is None else len(seen)

    def samples(self, model: str, prompt_tokens: int) -> tuple[int, ...]:
        return tuple(self._seen.get((model, self.bucket(prompt_tokens)), ()))

    def predict(self, model: str, prompt_tokens: int, max_tokens: int) -> int:
        """The q-quantile output length for this model and input bucket, capped at max_tokens."""
        key = (model, self.bucket(prompt_tokens))
        q = self._quantiles.get(key)
        if q is None:
            seen = self._seen.get(key)
            if seen is None or len(seen) < self.min_samples:
                return max_tokens
            q = self._quantiles[key] = max(1, _quantile(sorted(seen), self.quantile))
        return min(max_tokens, q)

    def grow(self, model: str, prompt_tokens: int, generated: int, max_tokens: int) -> int:
        """A new output reservation for a request that has produced `generated` tokens (> generated if possible)."""
        seen = self._seen.get((model, self.bucket(prompt_tokens)), ())
        longer = sorted(x for x in seen if x > generated)
        step = max(generated, self.min_step)
        target = generated + step
        if len(longer) >= max(1, self.min_samples // 4):
            target = max(generated + self.min_step, _quantile(longer, self.quantile))
        return min(max_tokens, target)


def _quantile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank quantile: the ceil(q·n)-th smallest value (1-based)."""
    n = len(sorted_values)
    return int(sorted_values[max(0, min(n - 1, math.ceil(q * n) - 1))])
