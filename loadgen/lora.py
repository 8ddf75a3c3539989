"""Which model each request names: the base model, or one of `--lora-modules` (vLLM's `bench serve` rule).

vLLM's `vllm bench serve --lora-modules A B ...` (vllm/benchmarks/serve.py, 0.32) sends each request with
`model` = one of those adapter names instead of `--model`: chosen with `random.choice` per request by
default, or cycled in order with `--lora-assignment round-robin`. The same here, with one difference that
matters for comparing runs: vLLM draws from the process-wide `random` (seeded by its `--seed`, but shared
with everything else that draws from it), while here request `i`'s adapter is drawn from an RNG seeded by
(`--seed`, i) alone — the same request names the same adapter in every run with that seed, whatever the
trace's lengths, the window or the concurrency. A name given twice is drawn twice as often (as vLLM's
`random.choice` over the list).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

LORA_ASSIGNMENTS = ("random", "round-robin")  # vLLM's --lora-assignment choices


class LoraError(ValueError):
    """`--lora-modules` / `--lora-assignment` values no request could carry."""


def check_lora_modules(names: Sequence[str], assignment: str = "random") -> tuple[str, ...]:
    """The adapter names as given, or LoraError with one line. A name is sent as the request's `model`:
    an empty one or one with whitespace or control characters names no adapter a server could have been
    started with (vLLM's `--lora-modules name=path` splits on spaces), so it is a typo, refused before
    anything is sent rather than as a 404 on every request."""
    if assignment not in LORA_ASSIGNMENTS:
        raise LoraError(f"--lora-assignment must be one of {', '.join(LORA_ASSIGNMENTS)}, got {assignment!r}")
    if not names:
        raise LoraError("--lora-modules needs at least one adapter name")
    for name in names:
        if not name:
            raise LoraError("--lora-modules: an adapter name is empty")
        if any(c.isspace() or not c.isprintable() for c in name):
            raise LoraError(f"--lora-modules: adapter name {name!r} has whitespace or control characters")
    return tuple(names)


class ModelChooser:
    """`model_for(i)`: the `model` of request `i` (0-based position in the replay)."""

    __slots__ = ("_assignment", "_base", "_names", "_seed")

    def __init__(
        self, base: str, lora_modules: Sequence[str] = (), assignment: str = "random", seed: int = 0
    ) -> None:
        self._base = base
        self._names = tuple(lora_modules)
        self._assignment = assignment
        self._seed = seed

    def model_for(self, index: int) -> str:
        if not self._names:
            return self._base
        if self._assignment == "round-robin":
            return self._names[index % len(self._names)]
        # A string seed goes through SHA-512 (random.seed, version 2): the same stream on every platform and
        # Python run (no hash randomisation), independent for each (seed, index). ~3 µs a request.
        return random.Random(f"mosaic-lora-{self._seed}-{index}").choice(self._names)
