"""Mosaic's P/D-coordinated autoscaler (after HeteroScale, arXiv 2508.19559).

Per model, each cycle:

1. **Signal**: decode demand D = Σ decode tokens/s over the model's decode and mixed pools (never less
   than arrivals × mean output length, which a saturated pool cannot hide), plus the backlog that
   queueing hides: (gateway admission queue + Σ num_requests_waiting) · mean output tokens /
   `queue_drain_s`. Decode tokens/s is linear in load, unlike GPU utilisation (high even when light) or
   latency (flat, then a cliff).
2. **Latency safety net** (only adds): a TPOT p90 over the SLO multiplies decode demand by
   `moderate_boost` (1.1), over `severe_factor`·SLO by `severe_boost` (1.2); TTFT does the same for
   prefill. While a breach lasts no pool of that phase scales in.
3. **Buy decode capacity** D / utilisation_target across the decode pools, cheapest $/h per token/s
   first when adding and priciest first when removing (see `buying.rebalance`). Instances still starting
   count as arriving capacity; draining ones do not. An instance's capacity is the pool's, at its
   configured context per sequence; with `observed_context`, at the observed mean context (input +
   output/2 of the requests completed, smoothed like the rates; `PoolSpec.decode_tps_at`), so a shift to
   longer prompts buys decode before TPOT degrades. The observed context is a signal either way.
4. **Prefill follows** in the same decision: `pd_ratio` prefill instances per decode instance needed
   (unrounded; the profiled P/D ratio; while requests wait for prefill, at least their prompt-token demand), or, in
   `prompt_tokens` mode, prompt tokens/s demand (plus backlog) over prefill capacity.
5. **Smoothing and lookahead**: the token rates (not the backlog, not the latency net) are smoothed by
   an EWMA (`smoothing`, 0.3) before sizing, so one noisy interval does not buy an instance the
   scale-down window then holds; optionally (`lookahead_s`, e.g. the cold start) rising demand is
   projected along the level's smoothed trend. The projection only adds. An idle interval (no arrival,
   no token, nothing waiting or running in the model's pools) is zero demand, not the decayed level, so
   an idle pool with `min_replicas: 0` reaches zero once a scale-down window has passed without load.
6. **Damping**: no change while capacity covers the requirement with less than `tolerance` to spare; a
   shortfall scales up at once
   (bounded by `max_scale_up_step` / `max_scale_up_factor`); scale-down only to the highest target
   recommended over the last `scale_down_window_s` and by at most `max_scale_down_fraction` per cycle.
   The size a pool had when the policy took over counts as a recommendation, so nothing scales in on
   less than one window of evidence. No pool of a model scales in while any of its pools' signal is
   incomplete (`PoolObservation.signal_complete`: a ready instance's load unknown), as during a breach.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal

from scheduler.autoscaler.buying import CapacityOf, capacity, rebalance
from scheduler.autoscaler.signals import ModelObservation, Observation, PoolSpec, ScalingDecision


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    utilization_target: float = 0.8
    tolerance: float = 0.1
    scale_down_window_s: float = 300.0
    max_scale_up_step: int = 4  # at least this many may be added per cycle …
    max_scale_up_factor: float = 2.0  # … or up to this multiple of the current count
    max_scale_down_fraction: float = 0.25  # at most this share (and at least 1) removed per cycle
    prefill_mode: Literal["ratio", "prompt_tokens"] = "ratio"
    pd_ratio: float = 0.5  # prefill instances per decode instance (HeteroScale saw 1P:5D to 9P:1D)
    queue_drain_s: float = 30.0  # waiting requests are demand to be served within this horizon
    default_output_tokens: float = 256.0  # when the observation has no mean output length yet
    default_input_tokens: float = 1024.0
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    moderate_boost: float = 1.1
    severe_boost: float = 1.2
    severe_factor: float = 1.5
    lookahead_s: float = 0.0  # project rising demand this far ahead (set it to the cold start); 0 = off
    smoothing: float = 0.3  # EWMA weight of the newest demand sample (1 = raw, unsmoothed)
    trend_smoothing: float = 0.3  # EWMA weight of the newest slope sample of the smoothed level
    observed_context: bool = False  # decode capacity at the observed mean context, not the configured one
    # > 0: the backlog term sizes for the queue projected to when capacity bought now is ready (this lead:
    # the cold start), given ready capacity and starting instances' ready times; 0: for the queue now
    backlog_lead_s: float = 0.0
    # > 0: no scale-in of a pool for this long after its provisioned count last rose (Cluster Autoscaler's
    # scale-down-delay-after-add; set it to the cold start plus the service an added instance should give):
    # an instance bought for demand is not removed before it has served, however the recommendations moved
    # during its cold start. Counted from the add, so a pod that never becomes ready cannot hold it forever
    scale_down_delay_after_add_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):  # a knob of the wrong type (a YAML string, a bool) fails here, not every cycle
            value = getattr(self, f.name)
            if f.name in ("prefill_mode", "observed_context"):
                continue
            if f.name in ("ttft_slo_s", "tpot_slo_s") and value is None:
                continue
            integral = f.name == "max_scale_up_step"
            if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
                kind = "an integer" if integral else "a number"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
            if not math.isfinite(value):  # NaN passes every comparison below; inf is no setting either
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        if not isinstance(self.observed_context, bool):
            raise ValueError(f"observed_context must be true or false, got {self.observed_context!r}")
        if self.prefill_mode not in ("ratio", "prompt_tokens"):
            raise ValueError(f"prefill_mode must be ratio or prompt_tokens, got {self.prefill_mode!r}")
        if not 0 < self.utilization_target <= 1:
            raise ValueError("utilization_target must be in (0, 1]")
        if not (0 < self.smoothing <= 1 and 0 < self.trend_smoothing <= 1):
            raise ValueError("smoothing and trend_smoothing must be in (0, 1]")
        if not 0 < self.max_scale_down_fraction <= 1:
            raise ValueError("max_scale_down_fraction must be in (0, 1]")
        at_least = {
            "pd_ratio": 0.0,
            "tolerance": 0.0,
            "scale_down_window_s": 0.0,
            # 0 would cap a pool at zero at zero for ever (max(0 + 0, 0 · factor)); the HPA refuses a 0 policy too
            "max_scale_up_step": 1,
            "max_scale_up_factor": 1.0,  # below 1 a "scale-up" would shrink the pool
            "lookahead_s": 0.0,
            "backlog_lead_s": 0.0,
            "scale_down_delay_after_add_s": 0.0,
            "moderate_boost": 1.0,  # the latency net only adds
            "severe_boost": 1.0,
            "severe_factor": 1.0,
        }
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be ≥ {low:g}, got {getattr(self, name)}")
        for name in (
            "queue_drain_s",
            "default_output_tokens",
            "default_input_tokens",
            "ttft_slo_s",
            "tpot_slo_s",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:  # divisors, or latencies that every request would breach
                raise ValueError(f"{name} must be > 0, got {value}")

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, object]) -> AutoscalerConfig:
        """The config from user-given knobs (a config file's `autoscaler.knobs`, a fleet file's `autoscaler:`);
        ValueError naming the knob on an unknown name (with the valid ones) or a bad value."""
        valid = [f.name for f in fields(cls)]
        for key in knobs:
            if key not in valid:
                raise ValueError(f"unknown knob {key!r}; valid: {', '.join(valid)}")
        try:
            return cls(**knobs)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None


class MosaicAutoscaler:
    """Implements `ScalingPolicy`. Holds only its recommendation history (for the scale-down window)."""

    def __init__(self, pools: Sequence[PoolSpec], config: AutoscalerConfig = AutoscalerConfig()) -> None:
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError("pool names must be unique")
        self.pools = tuple(pools)
        self.config = config
        self._history: dict[str, deque[tuple[float, int]]] = {p.name: deque() for p in pools}
        self._trend: dict[str, tuple[float, float, float]] = {}  # key → (time, demand, smoothed slope)
        self._context: dict[str, float] = {}  # model → smoothed mean context per sequence (tokens)
        self._seeded: set[str] = set()
        self._added: dict[str, tuple[int, float]] = {}  # pool → (provisioned count last seen, when it rose)

    def decide(self, obs: Observation) -> ScalingDecision:
        targets: dict[str, int] = {}
        reasons: dict[str, str] = {}
        signal: dict[str, float] = {}
        added = self._recently_added(obs)
        for model in sorted({p.model for p in self.pools}):
            self._decide_model(model, obs, targets, reasons, signal, added)
        for name, target in targets.items():  # its own adds count from the decision, not the next look
            if name in obs.pools and target > obs.pools[name].provisioned:
                self._added[name] = (target, obs.now)
        return ScalingDecision(obs.now, targets, reasons, signal)

    def _recently_added(self, obs: Observation) -> frozenset[str]:
        """Pools under `scale_down_delay_after_add_s`: their provisioned count (ready + starting) rose less
        than the delay ago, as seen between two observations (a worker coming back from unhealthy moves
        it between ready and starting, not up)."""
        delay = self.config.scale_down_delay_after_add_s
        out = set()
        for name, po in obs.pools.items():
            seen = self._added.get(name)
            rose = seen[1] if seen is not None else -math.inf
            if seen is not None and po.provisioned > seen[0]:
                rose = obs.now
            self._added[name] = (po.provisioned, rose)
            if delay > 0 and obs.now - rose < delay:
                out.add(name)
        return frozenset(out)

    # -- one model -----------------------------------------------------------------------------------

    def _decide_model(
        self,
        model: str,
        obs: Observation,
        targets: dict[str, int],
        reasons: dict[str, str],
        signal: dict[str, float],
        added: frozenset[str] = frozenset(),
    ) -> None:
        cfg = self.config
        pools = [p for p in self.pools if p.model == model]
        decode_pools = [p for p in pools if p.role in ("decode", "mixed")]
        prefill_pools = [p for p in pools if p.role == "prefill"]
        current = {p.name: obs.pools[p.name].provisioned if p.name in obs.pools else 0 for p in pools}
        # a pool whose ready instances' load is partly unknown undercounts the model's demand: no scale-in
        unknown = [p.name for p in pools if p.name in obs.pools and not obs.pools[p.name].signal_complete]

        seen = obs.for_model(model)
        waiting = obs.admission_queue.get(model, 0) + sum(
            obs.pools[p.name].num_waiting for p in pools if p.name in obs.pools
        )
        out_tokens = seen.mean_output_tokens or cfg.default_output_tokens
        in_tokens = seen.mean_input_tokens or cfg.default_input_tokens
        decode_tps = sum(obs.pools[p.name].decode_tokens_per_s for p in decode_pools if p.name in obs.pools)
        decode_boost = self._boost(seen.tpot_p90_s, cfg.tpot_slo_s)
        observed = self._mean_context(model, seen)
        if observed is not None:
            signal[f"{model}/context_tokens"] = observed
        context = observed if cfg.observed_context else None

        def decode_cap(p: PoolSpec) -> float:
            return p.decode_tps_at(context)

        # Arrivals (seen by the gateway) bound demand from below: a saturated pool's token rate cannot rise
        # above its capacity, the arrival rate can. In steady state the two are equal (tokens are conserved).
        # The configured lengths stand in when no mean was observed: the gateway measures lengths on
        # completions, and a pool at zero (or saturated for a whole interval) completes nothing, so the
        # observed means are 0 exactly when arrivals alone can show demand; a pool scaled to zero would
        # otherwise never come back.
        arriving_decode = seen.request_rate * out_tokens
        decode_sample = max(decode_tps, arriving_decode)
        decode_level = self._forecast(f"{model}/decode", decode_sample, obs.now)
        # An idle interval recommends no capacity: nothing arrived, decoded, prefilled, waited or ran (a mixed
        # instance busy with one long prefill for the whole interval decodes nothing, but is not idle). The
        # smoothed level only decays towards 0, and its remainder, rounded up to one instance, kept a
        # `min_replicas: 0` pool up for ever; the scale-down window still holds what the load before needed.
        model_pools = [obs.pools[p.name] for p in pools if p.name in obs.pools]
        idle = (
            decode_sample == 0  # no arrival either: the sample is at least arrivals × mean output length
            and waiting == 0
            and all(po.prompt_tokens_per_s == 0 and po.gpu_utilization == 0 for po in model_pools)
        )
        if idle:
            decode_level = 0.0
        decode_backlog = self._backlog(waiting * out_tokens, decode_level, decode_pools, decode_cap, obs)
        decode_demand = (decode_level + decode_backlog / cfg.queue_drain_s) * decode_boost
        signal[f"{model}/decode_tps"] = decode_tps
        signal[f"{model}/waiting"] = float(waiting)
        signal[f"{model}/decode_demand_tps"] = decode_demand

        self._settle(
            decode_pools,
            current,
            decode_demand / cfg.utilization_target,
            decode_cap,
            decode_boost > 1,
            obs.now,
            targets,
            reasons,
            unknown,
            added,
        )

        if not prefill_pools:
            return
        prefill_boost = self._boost(seen.ttft_p90_s, cfg.ttft_slo_s)
        prompt_tps = sum(obs.pools[p.name].prompt_tokens_per_s for p in prefill_pools if p.name in obs.pools)
        prefill_waiting = obs.admission_queue.get(model, 0) + sum(
            obs.pools[p.name].num_waiting for p in prefill_pools if p.name in obs.pools
        )
        # prompt tokens/s demand, with the prefill backlog to be cleared within queue_drain_s
        arriving_prompt = seen.request_rate * in_tokens

        def prefill_cap(p: PoolSpec) -> float:
            return p.prefill_tps_capacity

        prompt_level = self._forecast(f"{model}/prefill", max(prompt_tps, arriving_prompt), obs.now)
        if idle:
            prompt_level = 0.0
        prompt_backlog = self._backlog(
            prefill_waiting * in_tokens, prompt_level, prefill_pools, prefill_cap, obs
        )
        demand = (prompt_level + prompt_backlog / cfg.queue_drain_s) * prefill_boost
        signal[f"{model}/prefill_demand_tps"] = demand
        by_demand = demand / cfg.utilization_target
        if cfg.prefill_mode == "ratio":
            decode_instances = self._decode_instance_equivalents(
                decode_pools, targets, decode_demand, context
            )
            mean_cap = sum(p.prefill_tps_capacity for p in prefill_pools) / len(prefill_pools)
            by_ratio = math.ceil(decode_instances * cfg.pd_ratio * prefill_boost - 1e-9) * mean_cap
            signal[f"{model}/prefill_instances_by_ratio"] = by_ratio / mean_cap
            # The profiled ratio leads; measured prompt-token demand (with any prefill backlog) is a floor,
            # so a ratio profiled on another mix of prompt lengths cannot starve prefill.
            required_capacity = max(by_ratio, by_demand)
        else:
            required_capacity = by_demand

        self._settle(
            prefill_pools,
            current,
            required_capacity,
            prefill_cap,
            prefill_boost > 1,
            obs.now,
            targets,
            reasons,
            unknown,
            added,
        )

    def _decode_instance_equivalents(
        self,
        decode_pools: Sequence[PoolSpec],
        targets: Mapping[str, int],
        decode_demand: float,
        context: float | None,
    ) -> float:
        """Decode instances the demand needs, unrounded: demand / (utilisation target · capacity of the
        decode instances being bought). The ratio applies to this, not to the rounded counts, so small
        fleets don't round twice (ceil(ceil(d) · r) over-provisions prefill)."""
        pools = [p for p in decode_pools if p.role == "decode"]
        if not pools:
            return 0.0
        count = sum(targets[p.name] for p in pools)
        if count:
            mean_cap = sum(targets[p.name] * p.decode_tps_at(context) for p in pools) / count
        else:
            mean_cap = sum(p.decode_tps_at(context) for p in pools) / len(pools)
        return decode_demand / (self.config.utilization_target * mean_cap)

    def _backlog(
        self, tokens: float, level: float, pools: Sequence[PoolSpec], cap_of: CapacityOf, obs: Observation
    ) -> float:
        """The queued work (tokens) the backlog term sizes for.

        `backlog_lead_s` = 0: the queue now. Otherwise the queue projected to when an instance bought now
        would be ready (`backlog_lead_s`, the cold start): it grows at `level` minus the ready capacity and
        shrinks as each starting instance comes up (at its `starting_ready_in_s`; one without an estimate
        counts at the lead). A queue that instances already starting will clear by then buys nothing more
        (before, every decision re-sized for the growing queue and bought instances that came up after it
        was gone); a queue that will still grow until then buys for what it will be.
        """
        lead = self.config.backlog_lead_s
        if lead <= 0:
            return tokens
        rate = 0.0
        arrivals: list[tuple[float, float]] = []
        for p in pools:
            po = obs.pools.get(p.name)
            if po is None:
                continue
            cap = cap_of(p)
            rate += po.ready * cap
            etas = sorted(min(max(0.0, e), lead) for e in po.starting_ready_in_s[: po.starting])
            arrivals += [(e, cap) for e in etas] + [(lead, cap)] * (po.starting - len(etas))
        queue, t = tokens, 0.0
        for eta, cap in sorted(arrivals):
            queue = max(0.0, queue + (level - rate) * (eta - t))
            rate, t = rate + cap, eta
        return max(0.0, queue + (level - rate) * (lead - t))

    def _mean_context(self, model: str, obs: ModelObservation) -> float | None:
        """Smoothed mean context per sequence, input + output/2 (a sequence decodes on average at half its
        output), from the lengths of the requests completed in the interval; None until one completed."""
        previous = self._context.get(model)
        if obs.mean_input_tokens > 0 and obs.mean_output_tokens > 0:
            sample = obs.mean_input_tokens + obs.mean_output_tokens / 2
            a = self.config.smoothing
            self._context[model] = sample if previous is None else a * sample + (1 - a) * previous
        return self._context.get(model)

    def _forecast(self, key: str, demand: float, now: float) -> float:
        """Smoothed demand, projected `lookahead_s` ahead along its smoothed rising trend.

        level ← α·demand + (1−α)·level (α = `smoothing`: one interval's rate is a noisy sample, and a
        single spike must not buy an instance that the scale-down window then holds for minutes);
        trend ← β·(Δlevel/Δt) + (1−β)·trend (β = `trend_smoothing`, per second). The result is
        level + max(0, trend)·lookahead_s: an instance bought now serves only after its cold start, so on
        a sustained ramp the policy buys for the demand it will see then; a falling trend is ignored
        (scale-in stays on the level and the stabilisation window). Backlog and the latency net are added
        by the caller unsmoothed, so real queueing still acts at once.
        """
        cfg = self.config
        previous = self._trend.get(key)
        if previous is None or now <= previous[0]:
            level, slope = demand, 0.0 if previous is None else previous[2]
        else:
            t0, level0, slope0 = previous
            level = cfg.smoothing * demand + (1 - cfg.smoothing) * level0
            slope = cfg.trend_smoothing * (level - level0) / (now - t0) + (1 - cfg.trend_smoothing) * slope0
        self._trend[key] = (now, level, slope)
        return level + max(0.0, slope) * cfg.lookahead_s

    def _boost(self, measured: float | None, slo: float | None) -> float:
        cfg = self.config
        if measured is None or slo is None or measured <= slo:
            return 1.0
        return cfg.severe_boost if measured > cfg.severe_factor * slo else cfg.moderate_boost

    def _settle(
        self,
        pools: Sequence[PoolSpec],
        current: Mapping[str, int],
        required: float,
        cap_of: CapacityOf,
        breached: bool,
        now: float,
        targets: dict[str, int],
        reasons: dict[str, str],
        unknown: Sequence[str] = (),
        added: frozenset[str] = frozenset(),
    ) -> None:
        """Turn a capacity requirement into damped, bounded per-pool targets; no scale-in while the latency
        SLO is `breached` or any of the model's pools has an incomplete signal (`unknown`)."""
        if not pools:
            return
        cfg = self.config
        have = capacity(pools, current, cap_of)
        # Asymmetric band: any shortfall buys capacity now (SLO first); a surplus is kept until it exceeds
        # `tolerance`, so a flat load never flaps and one added instance is not removed by jitter.
        within_band = have > 0 and (1 - cfg.tolerance) * have <= required <= have
        if within_band and not breached:
            raw = {p.name: min(max(current[p.name], p.min_replicas), p.max_replicas) for p in pools}
            why = f"{have:.0f} covers {required:.0f} within {cfg.tolerance:.0%}"
        else:
            raw = rebalance(pools, current, required, cap_of)
            why = f"need {required:.0f}, have {have:.0f}"
        hold = breached or bool(unknown)
        for pool in pools:
            n = current[pool.name]
            want = max(raw[pool.name], n) if hold else raw[pool.name]
            target = self._damp(pool, n, want, now)
            if pool.name in added:  # after the window's history took the recommendation: the delay and
                target = max(target, min(n, pool.max_replicas))  # the window run side by side, as in CA
            targets[pool.name] = target
            reasons[pool.name] = why + (" (latency SLO breached: no scale-in)" if breached else "")
            if pool.name in added and raw[pool.name] < n:
                reasons[pool.name] += " (instance added recently: no scale-in)"
            if unknown:
                reasons[pool.name] += (
                    f" (signal incomplete: stale worker metrics in {', '.join(unknown)}; no scale-in)"
                )

    def _damp(self, pool: PoolSpec, n: int, want: int, now: float) -> int:
        cfg = self.config
        history = self._history[pool.name]
        if pool.name not in self._seeded:
            # The size the pool had when the policy took over counts as a recommendation: no scale-in on
            # less than one window of evidence (one interval's rate at start-up is not a trend).
            self._seeded.add(pool.name)
            history.append((now, n))
        history.append((now, want))
        while history and history[0][0] < now - cfg.scale_down_window_s:
            history.popleft()
        if want > n:
            ceiling = max(n + cfg.max_scale_up_step, math.ceil(n * cfg.max_scale_up_factor))
            target = min(want, ceiling)
        elif want < n:
            stabilised = max(w for _, w in history)  # highest recommendation within the window
            floor = n - max(1, math.floor(n * cfg.max_scale_down_fraction))
            target = max(want, stabilised if stabilised < n else n, floor)
        else:
            target = n
        return min(max(target, pool.min_replicas), pool.max_replicas)
