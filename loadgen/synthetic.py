"""Synthetic traces from a one-line spec: Poisson or gamma arrivals, fixed or distributed lengths.

    synthetic:rate=20,n=1000,arrival=gamma,burstiness=0.5,input=uniform:128:2048,output=256,seed=7

| key | meaning | default |
|---|---|---|
| `rate` | mean arrival rate, requests/s (> 0) | required |
| `n` | number of requests | — |
| `duration` | seconds of arrivals (stop at the first arrival ≥ duration) | — (one of `n`/`duration` required; both: whichever ends first; at most `MAX_REQUESTS` requests either way) |
| `arrival` | `poisson` (exponential gaps), `gamma` (gaps ~ Gamma(k, 1/(rate·k)), k = `burstiness`), `constant` (gaps 1/rate) | `poisson` |
| `burstiness` | gamma shape k: 1 = Poisson, < 1 burstier, > 1 smoother (vLLM's `--burstiness`) | 1 |
| `input`, `output` | a length distribution (tokens, below) | `input=512`, `output=128` |
| `seed` | RNG seed (the CLI's `--seed` when absent) | 0 |

Length distributions, each sample rounded and clipped to ≥ 1: `N` (fixed), `uniform:LO:HI` (integers,
inclusive), `normal:MEAN:STD`, `lognormal:MEDIAN:SIGMA` (σ of ln length), `exp:MEAN`.

Arrivals are spaced as vLLM's benchmark spaces them at a fixed rate: the first request comes after one gap,
and with `n` the gaps are rescaled so that the n-th arrives at exactly n / rate (`fixed_rate_arrivals`). The
lengths are generated lazily from `random.Random(seed)`: the same spec and seed give the same trace (not
bit-identical to vLLM's numpy draws, the same distributions).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from loadgen.trace import MAX_TOKENS, TraceRequest

PREFIX = "synthetic:"
# the most requests a spec may ask for (its n, or rate × duration): 100 million is days of load at the rates
# one load generator sustains; more is a typo that would never end (and `plan`/`simulate` hold the trace)
MAX_REQUESTS = 100_000_000
Sampler = Callable[[random.Random], int]


class SpecError(ValueError):
    """A synthetic spec that does not parse; the message names the key."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str  # fixed | uniform | normal | lognormal | exp
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        elif self.kind == "lognormal":
            g = rng.gauss(0.0, self.b)  # a wide sigma would overflow exp(): past the cap, the cap
            x = MAX_TOKENS if g > math.log(MAX_TOKENS / self.a) else self.a * math.exp(g)
        else:  # exp
            x = rng.expovariate(1.0 / self.a)
        return min(MAX_TOKENS, max(1, round(x)))  # a tail sample past the longest context is capped

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "exp":
            return f"exp:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def parse_length(key: str, text: str) -> LengthDist:
    parts = text.split(":")
    try:
        nums = [float(p) for p in parts[1:]] if len(parts) > 1 else [float(parts[0])]
    except ValueError:
        raise SpecError(
            f"{key}={text!r}: numbers expected (e.g. 512, uniform:128:2048, lognormal:300:0.8)"
        ) from None
    kind = parts[0] if len(parts) > 1 else "fixed"
    arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}
    if kind not in arity:
        raise SpecError(f"{key}: unknown distribution {kind!r} (fixed N, uniform, normal, lognormal, exp)")
    if len(nums) != arity[kind]:
        raise SpecError(f"{key}: {kind} takes {arity[kind]} number(s), got {len(nums)}")
    if any(not math.isfinite(x) for x in nums) or nums[0] <= 0 or (kind != "normal" and min(nums) < 0):
        raise SpecError(f"{key}={text!r}: parameters must be finite and positive")
    if nums[0] > MAX_TOKENS or (kind == "uniform" and nums[1] > MAX_TOKENS):
        raise SpecError(f"{key}={text!r}: lengths are at most {MAX_TOKENS:,} tokens")
    if kind == "fixed" and not nums[0].is_integer():
        raise SpecError(f"{key}={text!r}: a fixed length is a whole number of tokens")
    if kind == "uniform" and (not nums[0].is_integer() or not nums[1].is_integer() or nums[1] < nums[0]):
        raise SpecError(f"{key}={text!r}: uniform:LO:HI needs integers with LO ≤ HI")
    return LengthDist(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    rate: float
    n: int | None = None
    duration_s: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    input: LengthDist = LengthDist("fixed", 512)
    output: LengthDist = LengthDist("fixed", 128)
    seed: int | None = None

    def describe(self) -> str:
        parts = [f"rate={self.rate:g}"]
        if self.n is not None:
            parts.append(f"n={self.n}")
        if self.duration_s is not None:
            parts.append(f"duration={self.duration_s:g}")
        parts += [f"arrival={self.arrival}", f"burstiness={self.burstiness:g}"]
        parts += [f"input={self.input.describe()}", f"output={self.output.describe()}"]
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        return PREFIX + ",".join(parts)


def parse_spec(text: str) -> SyntheticSpec:
    """Parse `synthetic:key=value,...`; raises SpecError naming the offending key."""
    if not text.startswith(PREFIX):
        raise SpecError(f"a synthetic trace starts with {PREFIX!r}")
    fields: dict[str, str] = {}
    for item in filter(None, text[len(PREFIX) :].split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise SpecError(f"{item!r}: expected key=value")
        fields[key.strip()] = value.strip()
    known = {"rate", "n", "duration", "arrival", "burstiness", "input", "output", "seed"}
    if unknown := sorted(set(fields) - known):
        raise SpecError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if "rate" not in fields:
        raise SpecError("rate=R (requests/s) is required")
    rate = _positive("rate", fields["rate"])
    n = _count("n", fields["n"]) if "n" in fields else None
    duration = _positive("duration", fields["duration"]) if "duration" in fields else None
    if n is None and duration is None:
        raise SpecError("give n=COUNT or duration=SECONDS")
    expected = min(math.inf if n is None else n, math.inf if duration is None else rate * duration)
    if expected > MAX_REQUESTS:
        asked = f"n={n}" if n is not None and n <= rate * (duration or math.inf) else "rate × duration"
        raise SpecError(f"{asked} is {expected:.3g} requests; a synthetic trace has at most {MAX_REQUESTS:,}")
    arrival = fields.get("arrival", "poisson")
    if arrival not in ("poisson", "gamma", "constant"):
        raise SpecError(f"arrival={arrival!r}: poisson, gamma or constant")
    burstiness = _positive("burstiness", fields.get("burstiness", "1"))
    if arrival == "poisson" and burstiness != 1.0:
        arrival = "gamma"  # a burstiness factor only means something for gamma gaps
    return SyntheticSpec(
        rate=rate,
        n=n,
        duration_s=duration,
        arrival=arrival,
        burstiness=burstiness,
        input=parse_length("input", fields.get("input", "512")),
        output=parse_length("output", fields.get("output", "128")),
        seed=_count("seed", fields["seed"]) if "seed" in fields else None,
    )


def _positive(key: str, value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise SpecError(f"{key}={value!r} is not a number") from None
    if not math.isfinite(x) or x <= 0:
        raise SpecError(f"{key}={value!r} must be > 0")
    return x


def _count(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise SpecError(f"{key}={value!r} is not an integer") from None
    if n < 0 or (key == "n" and n == 0):
        raise SpecError(f"{key}={value!r} must be {'> 0' if key == 'n' else '≥ 0'}")
    return n


def interarrival_sampler(rate: float, arrival: str, burstiness: float) -> Callable[[random.Random], float]:
    """Gap between arrivals: exponential (Poisson), Gamma(k, 1/(rate·k)) (mean 1/rate), or constant."""
    if arrival == "constant":
        return lambda rng: 1.0 / rate
    if arrival == "gamma" and burstiness != 1.0:
        return lambda rng: rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return lambda rng: rng.expovariate(rate)


def fixed_rate_arrivals(
    n: int, rate: float, arrival: str, burstiness: float, rng: random.Random
) -> list[float]:
    """`n` arrival times at `rate` as vLLM's benchmark spaces them (`get_request` without a ramp-up): `n`
    gaps, the first one before the first request, their running sum rescaled so that the last arrival is at
    exactly n / rate. Unscaled, the span of n random gaps strays from n / rate by a few percent from one
    seed to the next, and every throughput measured over it with it (vLLM's reason)."""
    gap = interarrival_sampler(rate, arrival, burstiness)
    times = list(itertools.accumulate(gap(rng) for _ in range(n)))
    if times and times[-1] > 0:
        scale = (n / rate) / times[-1]
        times = [t * scale for t in times]
    return times


def generate(spec: SyntheticSpec, seed: int = 0) -> Iterator[TraceRequest]:
    """The spec's requests, lazily; `spec.seed` wins over `seed`. Lengths and gaps use separate streams,
    so changing the arrival process keeps each request's lengths."""
    base = spec.seed if spec.seed is not None else seed
    gaps = random.Random(f"mosaic-synthetic-arrivals-{base}")
    lengths = random.Random(f"mosaic-synthetic-lengths-{base}")
    if spec.n is not None:
        times: Iterable[float] = fixed_rate_arrivals(spec.n, spec.rate, spec.arrival, spec.burstiness, gaps)
    else:  # a duration alone: as many arrivals as fall in it, the first after one gap too
        gap = interarrival_sampler(spec.rate, spec.arrival, spec.burstiness)
        times = itertools.accumulate(gap(gaps) for _ in itertools.count())
    for i, t in enumerate(times):
        if spec.duration_s is not None and t >= spec.duration_s:
            return
        yield TraceRequest(t, spec.input.sample(lengths), spec.output.sample(lengths), (), i + 1)
