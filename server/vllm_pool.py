"""`launch: vllm` pools: Mosaic starts real `vllm serve` processes on this machine's GPUs and scales them.

One process per replica, with the pool's `dp` engines (`--data-parallel-size`) of `tp` GPUs each; it gets
tp × dp GPUs from a `GpuAllocator` shared by every launched pool, so no two processes ever see the same GPU
(`CUDA_VISIBLE_DEVICES`), taken only from the pool's own `gpu_ids` when it lists them. Among the free GPUs
a replica may use, those the fewest other pools could use come first (a pool without `gpu_ids` could use
every GPU), so that pools with overlapping `gpu_ids` (A: 0,1 and B: 0) leave each other the GPUs only they
can take; ties go by the configured order, which keeps a TP group on adjacent GPUs (usually the same
NVLink/PCIe switch): vLLM gives engine r the visible devices r·tp .. r·tp + tp − 1. Ports: a free port per replica and, for P/D roles, a block of
tp × dp free ports for the NIXL side channel (`VllmPoolLauncher.start_replica` says why that many). A port
probed free is not held by anything until vLLM binds it 30-120 s later, so every port handed out is
recorded in a process-wide reservation (`reserve_port`) until its replica has exited: two replicas starting
at once never get the same one.

`VllmPoolLauncher` is non-blocking so the gateway's event loop and the embedded autoscaler can call it: a
replica starts as a process (health is the registry's job, `check_ready` or `wait_ready`); a stop sends
SIGTERM and the process is reaped on later calls (`reap`), SIGKILLed with its process group if still alive
after `stop_grace_s`. Scale-in is soft when the gateway watches the pool (`idle` set, as the embedded
autoscaler sets it): `scale_to` moves the newest replicas to *draining* (listed as terminating, so the
router stops choosing them, and not counted as replicas), `finish_drains` sends SIGTERM to each once
nothing routed to it is unfinished (`idle(replica_id)`) or after `drain_timeout_s`, and a scale-out takes
draining replicas back (warm) before starting new ones. vLLM itself is started with `--shutdown-timeout`
(`stop_grace_s` − 5 s) so a SIGTERM still lets it finish what is running (its default, 0, aborts it). Failures (a start that raises, a replica that exits by itself, one not ready within
`start_timeout_s`) feed one `Backoff` per pool: the next start waits `restart_backoff_s`, doubling per
consecutive failure up to `restart_backoff_max_s`; a replica that has answered /health for
`restart_backoff_reset_s` (10 minutes, as the kubelet resets CrashLoopBackOff) ends the streak, so one that
comes up and then keeps crashing still backs off. Starts are
done on the calling thread, which must outlive the replica (see `server.vllm_launcher`: parent-death signal).
`VllmActuator` adapts pools to the autoscaler's `Actuator` protocol (`scale(pool, replicas, now)`,
`replicas(pool)`).

Config: a pool's `endpoints: {launch: ...}` is a `LaunchVllmConfig` (the gateway builds a
`server.vllm_source.LaunchedPoolSource` from it):

```yaml
pools:
  - name: decode-h100
    model: llama-3-8b              # served name; models[].max_model_len → --max-model-len
    gpu: H100
    role: decode                   # → --kv-transfer-config with kv_role kv_consumer
    tp: 2                          # → --tensor-parallel-size 2, two GPUs per engine
    dp: 2                          # → --data-parallel-size 2: two engines per replica, tp × dp = 4 GPUs
    gpu_memory_utilization: 0.9    # → --gpu-memory-utilization
    max_num_seqs: 256              # → --max-num-seqs   (the gateway sizes capacity from these two)
    block_size: 16                 # → --block-size
    min_replicas: 1
    max_replicas: 3
    endpoints:
      launch:                      # or just `launch: vllm` for all defaults
        model: meta-llama/Meta-Llama-3-8B-Instruct   # weights (default: the model name)
        replicas: 2                # started with the gateway
        gpu_ids: ["0", "1", "2", "3", "4", "5", "6", "7"]   # default: CUDA_VISIBLE_DEVICES, else nvidia-smi
        extra_args: [--enable-prefix-caching]
```
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from placement.textfiles import parse_yaml, read_text
from scheduler.actuators.base import ScaleAction
from scheduler.config_numbers import NoBoolNumbers
from server.vllm_launcher import (
    NEVER_INHERITED_ENV,
    LaunchError,
    VllmLaunchSpec,
    VllmProcess,
    connect_host,
    free_port,
    health_ok,
)

log = logging.getLogger("mosaic.vllm")


class LaunchVllmConfig(NoBoolNumbers):
    """A pool's `endpoints.launch`: `launch: vllm` (all defaults) or a mapping with these keys."""

    # allow_inf_nan=False: a grace, backoff or timeout of .inf would never end (and NaN compares false)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    engine: Literal["vllm"] = "vllm"
    # weights to serve: a path or HF name; None → the pool's model name
    model: str | None = Field(default=None, min_length=1)
    replicas: int = Field(default=1, ge=0)  # started with the gateway; the autoscaler moves it in min..max
    # GPUs this pool's replicas may use (from the one allocator of all launched pools); None → every GPU of
    # the machine (CUDA_VISIBLE_DEVICES, else nvidia-smi)
    gpu_ids: list[str] | None = None
    use_gpus: bool = True  # false: no GPU assignment (vLLM's CPU build)
    vllm_command: str = "vllm serve"  # split like a shell would
    # appended to every replica's command line; not the parallel sizes (`_extra_args`)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)  # set in every replica's environment
    # variables inherited from the gateway's environment beyond the allowlist (server.vllm_launcher)
    pass_env: list[str] = Field(default_factory=list)
    host: str = Field(default="127.0.0.1", min_length=1)  # vLLM's --host (IPv6 without brackets)
    # host NIXL peers reach this machine's replicas at (P/D roles); None → the bind host, or for a wildcard
    # bind (0.0.0.0, ::) this machine's primary IPv4 address (127.0.0.1 when it has no route)
    advertise_host: str | None = Field(default=None, min_length=1)
    # per-replica logs; None → $XDG_CACHE_HOME/mosaic/vllm-logs/<pool> (~/.cache/...), where the logs of
    # replicas that stopped cleanly are removed and those of failed ones kept
    log_dir: str | None = Field(default=None, min_length=1)
    stop_grace_s: float = Field(default=30.0, ge=0)
    restart_backoff_s: float = Field(default=10.0, ge=0)  # first wait after a failure; doubles per failure
    restart_backoff_max_s: float = Field(default=300.0, ge=0)  # ... up to this
    # a replica serving this long since its first /health ends a failure streak (the kubelet's 10 minutes);
    # a replica that answers /health and then crashes again sooner keeps doubling the wait
    restart_backoff_reset_s: float = Field(default=600.0, ge=0)
    # a replica not answering /health this long after its start is stopped and replaced: covers a model
    # download and load (minutes for a large model); a hung start would otherwise hold its GPUs forever
    start_timeout_s: float = Field(default=900.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: object) -> object:
        return {"engine": data} if isinstance(data, str) else data

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids(cls, ids: list[str] | None) -> list[str] | None:
        if ids is None:
            return None
        if not ids:
            raise ValueError("must list at least one GPU (or set use_gpus: false)")
        for gpu in ids:
            if not gpu or gpu != gpu.strip() or "," in gpu:
                raise ValueError(f'{gpu!r} is not a GPU id (one id per item, e.g. "0")')
        repeated = sorted({g for g in ids if ids.count(g) > 1})
        if repeated:
            raise ValueError(f"GPU {', '.join(repeated)} is listed twice")
        return ids

    @field_validator("vllm_command")
    @classmethod
    def _command(cls, command: str) -> str:
        try:
            argv = shlex.split(command)
        except ValueError as exc:  # e.g. "No closing quotation"
            raise ValueError(f"{command!r}: {exc}") from None
        if not argv:
            raise ValueError('must not be empty (e.g. "vllm serve")')
        return command

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, args: list[str]) -> list[str]:
        # The pool's tp and dp decide how many GPUs (and side-channel ports) a replica gets and what capacity
        # the gateway books on it; vLLM takes the last of two values, so a size here would run the replica
        # on GPUs it was not given, or with engines the gateway does not know of. Pipeline and prefill context
        # parallelism are not modelled at all. (A `--config FILE` among them is read where the replicas run:
        # `config_file_settings`.)
        for arg in args:
            field = parallel_size_flag(arg)
            if field is not None:
                raise ValueError(parallel_size_refusal(arg, field))
        return args

    @field_validator("host", "advertise_host")
    @classmethod
    def _host(cls, host: str | None) -> str | None:
        if host is not None and (host.startswith("[") or any(c.isspace() or c == "/" for c in host)):
            raise ValueError(f"{host!r} is not an address (IPv6 without brackets, e.g. ::1)")
        return host

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        if NEVER_INHERITED_ENV & set(env):
            raise ValueError(
                "VLLM_API_KEY: set the pool's api_key_env instead (the gateway must send the same key)"
            )
        return env

    @field_validator("pass_env")
    @classmethod
    def _pass_env(cls, names: list[str]) -> list[str]:
        if NEVER_INHERITED_ENV & set(names):
            raise ValueError("VLLM_API_KEY is never passed on: set the pool's api_key_env instead")
        return names

    @model_validator(mode="after")
    def _backoff_bounds(self) -> LaunchVllmConfig:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_max_s {self.restart_backoff_max_s:g} < restart_backoff_s {self.restart_backoff_s:g}"
            )
        return self

    @property
    def argv(self) -> tuple[str, ...]:
        return tuple(shlex.split(self.vllm_command))


PARALLEL_FLAGS: Mapping[str, str] = {
    "tp": "--tensor-parallel-size",
    "dp": "--data-parallel-size",
    "pp": "--pipeline-parallel-size",
    "pcp": "--prefill-context-parallel-size",
}

# The sizes Mosaic does not model, each multiplying a vLLM engine's GPUs (vLLM 0.32's ParallelConfig:
# world_size = pp × tp × pcp). The decode context parallel size (`-dcp`) is not among them: it shards the KV
# cache over the tp × pcp ranks there are and adds none, so it is passed on.
UNMODELLED: Mapping[str, str] = {"pp": "pipeline parallelism", "pcp": "prefill context parallelism"}

# The shortest abbreviation vLLM 0.32's parser takes for each long flag (argparse takes a unique prefix):
# `--t…` and `--p…` are shared with other options, `--prefill…` also with `--prefill-schedule-interval`, and
# each abbreviation of `--data-parallel-size` is also one of `--data-parallel-size-local`'s.
_SHORTEST = {"tp": "te", "pp": "pi", "pcp": "prefill-c", "dp": "data-parallel-size"}


def parallel_size_flag(arg: str) -> str | None:
    """The parallel size (`tp`, `dp`, `pp`, `pcp`) whose vLLM flag `arg` sets, as vLLM 0.32's parser reads it
    (the rule the chart's `mosaic.pool.checkParallelArgs` applies; both are held to vLLM's own parser,
    spelling by spelling, in tests/real_vllm/test_chart_vllm_args.py), else None:

    - the long flag (`PARALLEL_FLAGS`) and each abbreviation from its shortest unique one (`--te`, `--pi`,
      `--prefill-c`; `--data-parallel-size` only whole), with `_` for `-` (vLLM turns a long flag's
      underscores into dashes), with or without `=value`;
    - `-tp`, `-dp`, `-pp`, `-pcp`, with or without `=value`, and a bare `-t` or `-pc` (argparse reads `-t 3`
      as `-tp 3`, `-pc 3` as `-pcp 3`; `-t=3`, `-pc=3` it does not know); not `-p`, which vLLM refuses as
      ambiguous (`-pp` or `-pcp`)."""
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        flag = name[2:].replace("_", "-")
        for field, shortest in _SHORTEST.items():
            if flag.startswith(shortest) and PARALLEL_FLAGS[field][2:].startswith(flag):
                return field
        return None
    if arg == "-t":
        return "tp"
    if arg == "-pc":
        return "pcp"
    return {"-tp": "tp", "-dp": "dp", "-pp": "pp", "-pcp": "pcp"}.get(name)


def parallel_size_refusal(what: str, field: str) -> str:
    """Why a launched pool may not set `field` (`parallel_size_flag`) in `what` (an argument, a config key)."""
    if field in UNMODELLED:
        return (
            f"{what}: vLLM's {PARALLEL_FLAGS[field]} is not supported: Mosaic does not model {UNMODELLED[field]}, "
            f"so the replica would need tp × {field} × dp GPUs while the gateway gives it tp × dp and books its "
            "capacity from them; use the pool's tp instead"
        )
    return (
        f"{what}: set the pool's {field} instead (the gateway gives each replica tp × dp GPUs and books its "
        "capacity from them)"
    )


def config_file_settings(args: Sequence[str]) -> list[tuple[str, str]]:
    """(`--config FILE sets KEY`, size) for each key of a vLLM config file named in `args` that sets a
    parallel size (`parallel_size_flag`), reading the files now; ValueError with one line when `--config`
    has no file or a file cannot be read, is not YAML, not a mapping, or not `.yaml`/`.yml` (vLLM's rule).

    vLLM 0.32 (`FlexibleArgumentParser.load_config_file`) turns each top-level key into `--KEY` before
    parsing, so a key sets a size in every spelling its flag does (`tensor_parallel_size`,
    `tensor-parallel`, …). The command line wins over the file: a tp there loses to the
    `--tensor-parallel-size` Mosaic writes (refused all the same: it would be ignored without a word), a dp
    there sets a pool of dp 1 (no `--data-parallel-size` written), a pp or pcp always. vLLM reads the file
    only for an argument exactly `--config` followed by the path (relative to the working directory, which
    launched replicas share with the gateway); `--config=FILE` it accepts and ignores, and is read here all
    the same, so that no later release reading it lets a size through."""
    files: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--config":
            if i + 1 == len(args):
                raise ValueError("--config: no file follows it (vLLM reads `--config FILE`)")
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    found: list[tuple[str, str]] = []
    for file in files:
        if file.rsplit(".", 1)[-1] not in ("yaml", "yml"):
            raise ValueError(f"--config {file}: vLLM reads only .yaml or .yml config files")
        text = read_text(Path(file), ValueError, f"--config {file}: cannot read vLLM's config file: ")
        data = parse_yaml(text, ValueError, f"--config {file}: not valid YAML")
        if not isinstance(data, dict):
            raise ValueError(f"--config {file}: must be a mapping of vLLM options (`key: value` lines)")
        for key in data:
            field = parallel_size_flag(f"--{key}")
            if field is not None:
                found.append((f"--config {file} sets {key}", field))
    return found


def check_config_files(args: Sequence[str]) -> None:
    """ValueError with one line when a `--config FILE` among a launched pool's `extra_args` cannot be read or
    sets a parallel size (`config_file_settings`): the gateway checks when it is built (`mosaic serve` exits
    2), and each replica's start again, as vLLM reads the file again."""
    settings = config_file_settings(args)
    if settings:
        raise ValueError(parallel_size_refusal(*settings[0]))


class GpuAllocator:
    """Local GPU ids handed out without overlap, each to one owner (a replica id).

    `pools`: each launched pool's allowed GPUs (its `gpu_ids`, None for all of them), so that `allocate`
    can prefer the GPUs the fewest pools compete for; `register` adds or replaces one."""

    def __init__(
        self, gpu_ids: Sequence[str], pools: Mapping[str, Sequence[str] | None] | None = None
    ) -> None:
        if len(set(gpu_ids)) != len(gpu_ids):
            raise ValueError(f"gpu ids {','.join(gpu_ids)}: a GPU is listed twice")
        self._order = tuple(gpu_ids)
        self._owner: dict[str, str] = {}
        self._pools: dict[str, frozenset[str] | None] = {}
        for pool, allowed in (pools or {}).items():
            self.register(pool, allowed)

    def register(self, pool: str, gpu_ids: Sequence[str] | None) -> None:
        """`pool` may draw from `gpu_ids` (None: from every GPU of the allocator)."""
        self._pools[pool] = None if gpu_ids is None else frozenset(gpu_ids)

    def contenders(self, gpu: str) -> int:
        """How many registered pools could use `gpu` (a pool without `gpu_ids` can use every one)."""
        return sum(1 for allowed in self._pools.values() if allowed is None or gpu in allowed)

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return self._order

    @property
    def free(self) -> tuple[str, ...]:
        return tuple(g for g in self._order if g not in self._owner)

    def owned_by(self, owner: str) -> tuple[str, ...]:
        return tuple(g for g in self._order if self._owner.get(g) == owner)

    def allocate(self, owner: str, count: int, among: Sequence[str] | None = None) -> tuple[str, ...]:
        """`count` free GPUs for `owner`, only from `among` when given (a pool's own `gpu_ids`); LaunchError
        naming the shortfall when too few. The least contended GPUs (`contenders`), ties in configured order;
        among choices as little contended in all, a run adjacent in the configured order (a TP group's GPUs
        side by side: on PCIe machines neighbours share a switch), the first such run. Fit comes first: a
        more contended adjacent run is not taken over scattered GPUs. Taking the lowest ids instead, pool A (`gpu_ids` 0,1) would take GPU 0 and leave
        pool B (`gpu_ids` 0) nothing, where A on 1 and B on 0 both fit. The requesting pool counts towards
        every GPU in `among` alike, and so does a pool without `gpu_ids`, so neither changes the order.
        Greedy per request: it does not guarantee a fit where one exists for every sequence of starts."""
        if self.owned_by(owner):
            raise LaunchError(f"{owner} needs GPUs but already holds {','.join(self.owned_by(owner))}")
        wanted = None if among is None else set(among)
        allowed = self._order if wanted is None else tuple(g for g in self._order if g in wanted)
        free = tuple(g for g in allowed if g not in self._owner)
        if count > len(free):
            in_use = ", ".join(f"{g}→{o}" for g, o in sorted(self._owner.items()) if g in allowed)
            raise LaunchError(
                f"{owner} needs {count} GPU(s), {len(free)} free of {len(allowed)}"
                f"{'' if among is None else ' (' + ','.join(allowed) + ')'}"
                f" (in use: {in_use or 'none'})"
            )
        # sorted() is stable: equal contention keeps the configured order
        least = sorted(free, key=self.contenders)[:count]
        picked = self._adjacent_run(free, count, sum(map(self.contenders, least))) or set(least)
        # handed out (CUDA_VISIBLE_DEVICES, engine r's devices) in configured order, whatever the preference
        chosen = tuple(g for g in free if g in picked)
        for gpu in chosen:
            self._owner[gpu] = owner
        return chosen

    def _adjacent_run(self, free: Sequence[str], count: int, contention: int) -> set[str] | None:
        """The first run of `count` free GPUs adjacent in the configured order with at most `contention`
        contenders in all, or None."""
        usable = set(free)
        for start in range(len(self._order) - count + 1):
            run = self._order[start : start + count]
            if all(g in usable for g in run) and sum(map(self.contenders, run)) <= contention:
                return set(run)
        return None

    def release(self, owner: str) -> tuple[str, ...]:
        released = self.owned_by(owner)
        for gpu in released:
            del self._owner[gpu]
        return released


# Ports handed out to replicas of any pool of this process, held until the replica has exited. A probed port
# is free only at the instant of the probe: vLLM binds it 30-120 s later, and in between another replica's
# probe could return it again (the OS hands out ephemeral ports round-robin, not never-twice).
_reserved_ports: set[int] = set()
_ports_lock = threading.Lock()


def reserved_ports() -> frozenset[int]:
    with _ports_lock:
        return frozenset(_reserved_ports)


def release_ports(ports: Iterable[int]) -> None:
    with _ports_lock:
        _reserved_ports.difference_update(ports)


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def reserve_port(
    host: str = "127.0.0.1", attempts: int = 200, probe: Callable[[str], int] | None = None
) -> int:
    """A free port no other replica of this process holds, now reserved (`release_ports` gives it back)."""
    return reserve_port_block(1, host, attempts, probe)


def reserve_port_block(
    count: int, host: str = "127.0.0.1", attempts: int = 200, probe: Callable[[str], int] | None = None
) -> int:
    """A base port such that base .. base+count-1 are all free now and unreserved, now reserved. `probe`
    (default `free_port`) names a port the OS reports free."""
    for _ in range(attempts):
        try:
            base = (probe or free_port)(host)
        except OSError as exc:  # e.g. an IPv6 host on a machine without IPv6
            raise LaunchError(f"cannot probe a free port on {host}: {exc.strerror or exc}") from exc
        block = set(range(base, base + count))
        if base + count - 1 > 65535:
            continue
        with _ports_lock:
            if block & _reserved_ports:
                continue
            if not all(_bindable(host, p) for p in range(base + 1, base + count)):
                continue
            _reserved_ports.update(block)
            return base
    raise LaunchError(f"no block of {count} free port(s) found on {host}")


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A base port such that base .. base+count-1 are all free now (not reserved: see reserve_port_block)."""
    base = reserve_port_block(count, host, attempts)
    release_ports(range(base, base + count))
    return base


class BackingOff(LaunchError):
    """No replica is started before the backoff after a failed start runs out (`Backoff`)."""


class Backoff:
    """Exponential backoff of starts after failures: `initial_s`, doubling per consecutive failure, capped.
    The streak ends when a replica has been up `reset_after_s` (`VllmPoolLauncher` calls `succeed`)."""

    def __init__(self, initial_s: float, max_s: float, reset_after_s: float = 600.0) -> None:
        self.initial_s = initial_s
        self.max_s = max(max_s, initial_s)
        self.reset_after_s = reset_after_s
        self.failures = 0  # consecutive failures (0: not backing off)
        self.retry_at = float("-inf")

    def fail(self, now: float) -> float:
        """Record a failure at `now`; returns the wait before the next start."""
        self.failures += 1
        delay = min(self.initial_s * 2 ** min(self.failures - 1, 62), self.max_s)
        self.retry_at = now + delay
        return delay

    def succeed(self) -> None:
        self.failures = 0
        self.retry_at = float("-inf")

    def ready(self, now: float) -> bool:
        return now >= self.retry_at


def default_log_dir(pool: str, env: Mapping[str, str] | None = None) -> Path:
    """Where a pool's replica logs go without `launch.log_dir`: a stable folder under the user's cache (a
    temporary one vanished with the gateway, taking the log named in a failure's warning with it)."""
    env = os.environ if env is None else env
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "mosaic" / "vllm-logs" / pool


@dataclass(slots=True)
class LaunchedReplica:
    id: str
    pool: str
    url: str
    gpu_ids: tuple[str, ...]
    process: VllmProcess
    ports: tuple[int, ...] = ()  # reserved for it (server port, NIXL side channel) until it has exited
    started_at: float = 0.0  # launcher clock
    ready_at: float | None = None  # first /health 200 seen by check_ready
    failed: bool = False  # exited by itself, or not ready in time: its log is kept
    stopping_since: float | None = None  # launcher clock time SIGTERM was sent
    draining_since: float | None = None  # launcher clock time it was taken out of service (soft scale-in)


Starter = Callable[[VllmLaunchSpec, Path], VllmProcess]


def _default_starter(spec: VllmLaunchSpec, log_path: Path) -> VllmProcess:
    return VllmProcess.start(spec, log_path=log_path)


def _health_ok(url: str) -> bool:
    return health_ok(url, timeout_s=1.0)


class VllmPoolLauncher:
    """The replicas of one launched pool. `template` carries every flag but port, GPUs and side-channel port."""

    def __init__(
        self,
        pool: str,
        template: VllmLaunchSpec,
        allocator: GpuAllocator,
        log_dir: Path,
        *,
        stop_grace_s: float = 30.0,
        drain_timeout_s: float = 600.0,
        use_gpus: bool = True,
        gpu_ids: Sequence[str] | None = None,
        start_timeout_s: float = 900.0,
        backoff: Backoff | None = None,
        keep_clean_logs: bool = True,
        starter: Starter = _default_starter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.template = template
        self.allocator = allocator
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.use_gpus = use_gpus  # False: CPU build (no GPU assignment), e.g. the CPU test environment
        self.gpu_ids = tuple(gpu_ids) if gpu_ids is not None else None  # None: any GPU of the allocator
        self.start_timeout_s = start_timeout_s
        self.backoff = backoff if backoff is not None else Backoff(10.0, 300.0)
        self.keep_clean_logs = keep_clean_logs  # False: remove the log of a replica that stopped cleanly
        self._starter = starter
        self.clock = clock
        self._serial = 0
        self.desired = 0  # the count last asked for by scale_to (replicas that die are replaced up to it)
        self._live: list[LaunchedReplica] = []
        self._draining: list[LaunchedReplica] = []  # out of service, still running what it was sent
        self._stopping: list[LaunchedReplica] = []
        # Soft scale-in (module docstring): replica id → nothing routed to it is unfinished. None (nobody
        # watching the requests, e.g. a standalone launcher): a scale-in stops replicas at once.
        self.idle: Callable[[str], bool] | None = None
        self.drain_timeout_s = drain_timeout_s

    @property
    def replicas(self) -> tuple[LaunchedReplica, ...]:
        """Replicas started and not being stopped, oldest first."""
        return tuple(self._live)

    @property
    def draining(self) -> tuple[LaunchedReplica, ...]:
        """Replicas taken out of service by a soft scale-in, still finishing their requests."""
        return tuple(self._draining)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(r.url for r in self._live)

    def start_replica(self) -> LaunchedReplica:
        """Allocate GPUs and ports and spawn the process (does not wait for /health)."""
        self._serial += 1
        replica_id = f"{self.pool}-{self._serial}"
        try:
            check_config_files(
                self.template.extra_args
            )  # the file may have changed since the gateway started
        except ValueError as exc:
            raise LaunchError(f"{replica_id}: extra_args: {exc}") from None
        gpus = self.template.gpu_count  # tp × dp: every engine's TP group
        gpu_ids = self.allocator.allocate(replica_id, gpus, self.gpu_ids) if self.use_gpus else ()
        probe = connect_host(self.template.host)  # a wildcard bind: probe its loopback
        ports: list[int] = []
        try:
            port = reserve_port(probe)
            ports.append(port)
            side = None
            if self.template.role != "mixed":
                # vLLM 0.32 runs one NIXL handshake listener per engine (it serves all of the engine's TP
                # ranks) on base + the engine's data-parallel index: dp ports. The block is tp × dp, room for
                # one port per rank of every engine, which releases giving each TP rank its own listener
                # needed; without data parallelism that is the tp-port block replicas always got.
                count = self.template.gpu_count
                side = reserve_port_block(count, probe)
                ports.extend(range(side, side + count))
            spec = dataclasses.replace(self.template, port=port, gpu_ids=gpu_ids, nixl_side_channel_port=side)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            log_path = self.log_dir / f"{replica_id}-{stamp}-{os.getpid()}.log"
            process = self._starter(spec, log_path)
        except Exception:
            self.allocator.release(replica_id)
            release_ports(ports)
            raise
        replica = LaunchedReplica(
            replica_id, self.pool, spec.url, gpu_ids, process, tuple(ports), started_at=self.clock()
        )
        self._live.append(replica)
        # Every start is logged, the first ones and the replacements alike: a crash loop shows as launches.
        log.info(
            "launched vLLM %s at %s %s (pid %s, log %s)",
            replica.id,
            replica.url,
            f"on GPUs {','.join(gpu_ids)}" if gpu_ids else "without GPUs",
            process.pid,
            process.log_path,
        )
        return replica

    def wait_ready(self, replica: LaunchedReplica, timeout_s: float = 900.0) -> float:
        waited = replica.process.wait_healthy(timeout_s)
        replica.ready_at = self.clock()
        self._end_streak_if_stable()
        return waited

    def check_ready(self, probe: Callable[[str], bool] = _health_ok) -> list[LaunchedReplica]:
        """Probe /health of replicas not yet seen ready (blocking: run it off the event loop); those that
        answer are marked ready. Returns them."""
        became: list[LaunchedReplica] = []
        for replica in list(self._live):
            if replica.ready_at is None and replica.process.poll() is None and probe(replica.url):
                replica.ready_at = self.clock()
                became.append(replica)
        self._end_streak_if_stable()
        return became

    def _end_streak_if_stable(self) -> None:
        """A failure streak ends once a live replica has served `backoff.reset_after_s` since its first
        /health: ending it at the first /health restarted a replica that loads and then crashes (a bad
        request path, OOM under load) every `restart_backoff_s`, forever."""
        now = self.clock()
        reset = self.backoff.reset_after_s
        if any(r.ready_at is not None and now - r.ready_at >= reset for r in self._live):
            self.backoff.succeed()

    def overdue(self) -> list[LaunchedReplica]:
        """Live replicas not ready `start_timeout_s` after their start (hung: loading forever, or 503)."""
        now = self.clock()
        return [r for r in self._live if r.ready_at is None and now - r.started_at > self.start_timeout_s]

    def stop_replica(self, replica_id: str, *, failed: bool = False) -> None:
        """SIGTERM now; the process is reaped by `reap()` (GPUs and ports are released once it has exited).
        `failed`: it is being replaced (a hung start), so its log is kept."""
        replica = next((r for r in (*self._live, *self._draining) if r.id == replica_id), None)
        if replica is None:
            raise KeyError(replica_id)
        (self._live if replica in self._live else self._draining).remove(replica)
        replica.failed = replica.failed or failed
        replica.stopping_since = self.clock()
        replica.process.terminate()
        self._stopping.append(replica)

    def _finish(self, replica: LaunchedReplica, timeout_s: float) -> None:
        replica.process.stop(timeout_s=timeout_s)
        self.allocator.release(replica.id)
        release_ports(replica.ports)
        if not replica.failed and not self.keep_clean_logs and replica.process.log_path is not None:
            replica.process.log_path.unlink(missing_ok=True)

    def reap(self) -> int:
        """Finish stops: exited processes release their GPUs and ports; those past the grace period are
        killed. Returns how many are still stopping."""
        now = self.clock()
        for replica in list(self._stopping):
            overdue = now - (replica.stopping_since or now) > self.stop_grace_s
            if replica.process.poll() is not None or overdue:
                self._finish(replica, 0.0 if overdue else 5.0)
                self._stopping.remove(replica)
        return len(self._stopping)

    def prune_dead(self) -> list[LaunchedReplica]:
        """Live replicas whose process exited on its own: removed, GPUs and ports released, counted as a
        failure (backoff). Returns them."""
        self._end_streak_if_stable()  # one that served long enough before dying starts a new streak
        dead = [r for r in self._live if r.process.poll() is not None]
        for replica in dead:
            self._live.remove(replica)
            replica.failed = True
            self._finish(replica, 0.0)
        if dead:
            self.backoff.fail(self.clock())
        return dead

    def scale_to(self, replicas: int) -> tuple[list[LaunchedReplica], list[str]]:
        """Start or stop (newest first) until `replicas` are live. Returns (started, stopped ids). Starts
        wait out the backoff after failures (LaunchError saying until when); a failed start is one."""
        self.desired = replicas
        self.reap()
        started: list[LaunchedReplica] = []
        stopped: list[str] = []
        while len(self._live) > replicas:
            victim = self._live.pop()
            stopped.append(victim.id)
            if self.idle is None:
                self._live.append(victim)
                self.stop_replica(victim.id)
            else:
                victim.draining_since = self.clock()
                self._draining.append(victim)
                log.info("vLLM %s draining (scale-in): no new requests; stopped once idle", victim.id)
        while len(self._live) < replicas and self._draining:  # warm and loaded: cheaper than a start
            back = self._draining.pop()
            back.draining_since = None
            self._live.append(back)
            self._live.sort(key=lambda r: r.started_at)
            log.info("vLLM %s back in service (scale-out while it drained)", back.id)
        if len(self._live) < replicas:
            now = self.clock()
            if not self.backoff.ready(now):
                raise BackingOff(
                    f"{self.pool}: not starting replicas for {self.backoff.retry_at - now:.0f} s more "
                    f"(backing off after {self.backoff.failures} failure(s))"
                )
            while len(self._live) < replicas:
                try:
                    started.append(self.start_replica())
                except LaunchError:
                    self.backoff.fail(self.clock())
                    raise
        return started, stopped

    def finish_drains(self) -> list[tuple[LaunchedReplica, bool]]:
        """SIGTERM each draining replica that is idle, has exited, or has drained `drain_timeout_s`
        (forced). Returns (replica, forced) for each one stopped."""
        now = self.clock()
        done: list[tuple[LaunchedReplica, bool]] = []
        for replica in list(self._draining):
            forced = now - (replica.draining_since or now) > self.drain_timeout_s
            exited = replica.process.poll() is not None
            if forced or exited or self.idle is None or self.idle(replica.id):
                self.stop_replica(replica.id)
                done.append((replica, forced and not exited))
        return done

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Blocking: stop every replica (shutdown path)."""
        for replica in [*self._live, *self._draining]:
            self.stop_replica(replica.id)
        deadline = time.monotonic() + timeout_s
        while self.reap() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.stop_grace_s = 0.0
        self.reap()


class VllmActuator:
    """The autoscaler's `Actuator` for launched pools: `scale` starts/stops processes without blocking."""

    def __init__(self, pools: dict[str, VllmPoolLauncher]) -> None:
        self._pools = pools

    def replicas(self, pool: str) -> int:
        launcher = self._pools.get(pool)
        return 0 if launcher is None else len(launcher.replicas)

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        launcher = self._pools.get(pool)
        if launcher is None:
            return ScaleAction(
                now, pool, 0, replicas, applied=False, error=f"pool {pool!r} is not launched here"
            )
        before = len(launcher.replicas)
        try:
            launcher.scale_to(replicas)
        except BackingOff:  # the failure that started the backoff was reported (and logged) once
            return ScaleAction(now, pool, before, len(launcher.replicas), applied=False)
        except LaunchError as exc:  # e.g. not enough free GPUs: keep what started, report the rest
            return ScaleAction(now, pool, before, len(launcher.replicas), applied=False, error=str(exc))
        return ScaleAction(now, pool, before, replicas, applied=True)


def pool_template(
    *,
    model: str,
    served_model_name: str,
    role: str,
    tp: int,
    max_model_len: int | None,
    gpu_memory_utilization: float | None,
    runner: str = "generate",
    max_num_seqs: int | None = None,
    block_size: int | None = None,
    dp: int = 1,
    extra_args: Sequence[str] = (),
    vllm_command: Sequence[str] = ("vllm", "serve"),
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
    env: Mapping[str, str] | None = None,
    pass_env: Sequence[str] = (),
    drop_env: Iterable[str] = (),
    api_key: str | None = None,
    shutdown_timeout_s: int | None = None,
) -> VllmLaunchSpec:
    """The per-pool template a `launch: vllm` pool's replicas are made from (port filled in per replica)."""
    return VllmLaunchSpec(
        model=model,
        port=8000,
        host=host,
        served_model_name=served_model_name,
        role=role,
        runner=runner,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        nixl_side_channel_host=advertise_host,
        extra_args=tuple(extra_args),
        vllm_command=tuple(vllm_command),
        env=dict(env or {}),
        pass_env=tuple(pass_env),
        drop_env=frozenset(drop_env),
        api_key=api_key,
        shutdown_timeout_s=shutdown_timeout_s,
    )
