"""Gateway overhead: the same short requests sent directly to a zero-compute simulated worker and through
the gateway, in one run, at a fixed concurrency.

    .venv/bin/python bench/gateway_overhead.py [--concurrency 32] [--seconds 4] [--rounds 3]

**Processes.** One simulated worker (`mosaic worker --time-scale 1e9`), one gateway (`mosaic serve` with a
static pool pointing at that worker), and this script as the load generator. At time scale 10⁹ the engine
model takes no wall time: a request costs the worker only its Python (HTTP server, JSON, one engine step
per token); a non-streaming request with 16 output tokens is answered in < 1 ms when alone (the
`c=1` phases check this: before TCP_NODELAY was set on accepted sockets every response waited ~40 ms for
a delayed ACK, which made the worker look paced). The load generator is a minimal keep-alive HTTP/1.1
client on asyncio streams, one connection per concurrent request, in this process; it does nothing else
while a phase runs, its CPU per request is measured (≈ 0.1 ms, the same on both paths) and reported.

**Workloads.** `/v1/completions`, 8-token prompt, `max_tokens: 16`, `ignore_eos` — non-streaming, and
streaming (16 token chunks + `[DONE]`). With `--runner pooling` the worker is an embedding server
(`mosaic worker --runner pooling`, the pool `runner: pooling`) and the workloads `/v1/embeddings` of 8 token
ids, `encoding_format: base64` (the `openai` SDK's default; 4,096 floats: ~22 KB an answer), and `/rerank` of
a query and four short documents; results go to `results/gateway_overhead_embeddings.json`.

**Phases.** Per round and workload: direct then gateway, each `--seconds` after a `--warmup`, at
`--concurrency`; rounds repeat that, so both paths see the same background load over time. After the
rounds, one short phase per workload and path at concurrency 1 gives the unloaded latency the hop adds.

**Reported** per workload: req/s of each path (mean over rounds), the throughput ratio per round and its
median/min/max, p50/p99 latency of each path (pooled over rounds) and the difference, and per process the
CPU seconds per request and the run-queue wait (seconds it was runnable but waiting for a CPU, from
/proc/<pid>/schedstat) per wall second. From the CPU per request it derives the throughput bound of each
path on this machine's cores: a single-threaded process serves at most 1/cpu_per_request, and all
processes of a path together at most cores/Σ cpu_per_request; `cpu_bound_ratio` is the gateway path's
bound over the direct path's. On 2 cores the direct path runs 2 processes and the gateway path 3, so the
bound is below 1 even for a free gateway; the measured ratio also depends on what else runs on the
machine (see `runq_wait_per_s`).

**Instructions** (`--instructions N`): instead of the phases above, the gateway runs under valgrind's
callgrind and its user-space instructions per request are counted over N requests per workload (after a
warm-up, at `--concurrency`). CPU seconds move with whatever else runs on a shared machine; instruction
counts repeat within ~1%, so code changes are compared with them (results/gateway_overhead_instructions.json).

**What limits it** (measured on this 2-core machine; docs/gateway.md has the tables). CPU, not latency:
the gateway adds ≈ 0.5 ms at concurrency 1 (≈ 1 ms streaming), but at concurrency 32 every process is
CPU-bound. The direct path is the worker on one core (≈ 0.16 ms per non-streaming request, 0.36 ms
streaming); the gateway path needs client + gateway + worker on the same 2 cores (gateway ≈ 0.15 ms,
0.26 ms streaming, as of 2026-12-03; the worker also costs more behind the gateway because it batches
fewer requests per engine step). On a quiet machine that gives 0.81–0.84× non-streaming and 0.83–0.92×
streaming (bar 0.80, a Rust router's figure), narrowly for non-streaming; other jobs on the cores take
it below the bar.

Results: `bench/results/gateway_overhead.json`, and one line appended to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gateway_overhead.json"
BENCHMARKS = ROOT / "BENCHMARKS.md"
BENCH_HEADER = "| date | bench | command | key ratio/result |\n|---|---|---|---|\n"
MOSAIC = (
    [str(ROOT / ".venv" / "bin" / "mosaic")] if (ROOT / ".venv" / "bin" / "mosaic").exists() else ["mosaic"]
)
URL_RE = re.compile(r"http://127\.0\.0\.1:(\d+)")


class Workload(NamedTuple):
    name: str
    endpoint: str
    body: dict[str, object]
    events: int  # SSE `data:` lines a good streamed answer has; 0: a whole answer
    marker: bytes  # what a good whole answer holds


_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
_COMPLETION = {"model": "llama-3-8b", "prompt": _PROMPT, "max_tokens": 16, "ignore_eos": True}
WORKLOADS = (
    Workload("non-stream", "/v1/completions", {**_COMPLETION, "stream": False}, 0, b'"usage"'),
    Workload("stream-16", "/v1/completions", {**_COMPLETION, "stream": True}, 17, b""),  # 16 chunks + [DONE]
)
# `--runner pooling`: the worker is an embedding server; the openai SDK's default encoding (base64)
EMBED_WORKLOADS = (
    Workload(
        "embed-8",
        "/v1/embeddings",
        {"model": "llama-3-8b", "input": _PROMPT, "encoding_format": "base64"},
        0,
        b'"embedding"',
    ),
    # vLLM's /rerank on the same server: a query and four documents, five prefill-only engine requests
    Workload(
        "rerank-4",
        "/rerank",
        {
            "model": "llama-3-8b",
            "query": "paged attention",
            "documents": ["kv", "block table", "cache", "page"],
        },
        0,
        b'"relevance_score"',
    ),
)


def answer_ok(w: Workload, status: int, body: bytes) -> bool:
    if status != 200:
        return False
    return body.count(b"data: ") == w.events if w.events else w.marker in body


# ------------------------------------------------------------------------------------ minimal client
class Conn:
    """One keep-alive HTTP/1.1 connection; `post` returns (status, body bytes) with chunked decoding."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, raw: bytes) -> tuple[int, bytes]:
        self.w.write(raw)
        head = await self.r.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
        if b"content-length" in headers:
            return status, await self.r.readexactly(int(headers[b"content-length"]))
        parts = []
        while True:  # chunked
            size = int((await self.r.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                await self.r.readuntil(b"\r\n")
                return status, b"".join(parts)
            parts.append(await self.r.readexactly(size + 2))

    def close(self) -> None:
        self.w.close()


def request_bytes(port: int, w: Workload) -> bytes:
    body = json.dumps(w.body).encode()
    return (
        f"POST {w.endpoint} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class Phase:
    path: str
    workload: str
    seconds: float
    concurrency: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    requests_total: int = 0  # including warm-up, for CPU per request
    cpu_s: dict[str, float] = field(default_factory=dict)  # process → CPU seconds over the whole phase
    runq_s: dict[str, float] = field(default_factory=dict)  # process → seconds runnable but not running
    wall_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)  # first few failures: status and body tail

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    def cpu_per_request_ms(self, proc: str) -> float:
        return self.cpu_s[proc] / max(1, self.requests_total) * 1e3


async def run_phase(port: int, w: Workload, warmup: float, phase: Phase) -> None:
    raw = request_bytes(port, w)
    conns = [await Conn.open(port) for _ in range(phase.concurrency)]
    start = time.perf_counter()
    t_measure, t_end = start + warmup, start + warmup + phase.seconds

    async def loop(conn: Conn) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            status, body = await conn.post(raw)
            t1 = time.perf_counter()
            phase.requests_total += 1
            ok = answer_ok(w, status, body)
            if t0 >= t_measure and t1 <= t_end:
                if ok:
                    phase.latencies.append(t1 - t0)
                else:
                    phase.errors += 1
                    if len(phase.error_samples) < 3:
                        phase.error_samples.append(f"{status}: {body[-300:]!r}")

    try:
        await asyncio.gather(*(loop(c) for c in conns))
    finally:
        for c in conns:
            c.close()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


# ------------------------------------------------------------------------------------ processes
def start(cmd: list[str]) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = URL_RE.search(line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not print its URL")


def sched(pid: int | None) -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a CPU) of a process so far: /proc/<pid>/schedstat
    for every thread of it (`None`: this process)."""
    pid = pid or os.getpid()
    cpu = wait = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
        cpu += int(run_ns) / 1e9
        wait += int(wait_ns) / 1e9
    return cpu, wait


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


async def wait_ready(port: int) -> None:
    for _ in range(200):
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
            line = await r.readline()
            w.close()
            if b" 200 " in line:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("gateway never became ready")


def _server_stack(python: str | None) -> str:
    probe = "import importlib.util as u; print(','.join(m for m in ('uvloop', 'httptools') if u.find_spec(m)) or 'asyncio+h11')"
    out = subprocess.run([python or sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def measure(
    procs: dict[str, int | None],
    port: int,
    w: Workload,
    path: str,
    concurrency: int,
    seconds: float,
    warmup: float,
) -> Phase:
    ph = Phase(path, w.name, seconds, concurrency)
    before = {k: sched(pid) for k, pid in procs.items()}
    t0 = time.perf_counter()
    asyncio.run(run_phase(port, w, warmup, ph))
    ph.wall_s = time.perf_counter() - t0
    after = {k: sched(pid) for k, pid in procs.items()}
    ph.cpu_s = {k: after[k][0] - before[k][0] for k in procs}
    ph.runq_s = {k: after[k][1] - before[k][1] for k in procs}
    return ph


def report_phase(ph: Phase, procs: tuple[str, ...]) -> None:
    cpu = ", ".join(f"{k} {ph.cpu_per_request_ms(k):.3f}" for k in procs)
    runq = ", ".join(f"{k} {ph.runq_s[k] / ph.wall_s:.2f}" for k in procs)
    print(
        f"{ph.workload:10s} {ph.path:8s} c={ph.concurrency:<3d} {ph.rps:8.1f} req/s  p50 "
        f"{pct(ph.latencies, 0.5) * 1e3:6.2f} ms  p99 {pct(ph.latencies, 0.99) * 1e3:6.2f} ms  errors {ph.errors}"
        f"  CPU ms/request: {cpu}  run-queue wait/s: {runq}",
        flush=True,
    )
    for sample in ph.error_samples:
        print(f"    error: {sample}", flush=True)


def cpu_bound_rps(cpu_ms: list[float], cores: int) -> float:
    """The most req/s processes with these CPU costs per request can serve: each single-threaded process
    at most 1/cpu, all together at most cores/Σcpu."""
    return min(min(1e3 / c for c in cpu_ms), cores * 1e3 / sum(cpu_ms))


def summarise(phases: list[Phase], workload: str, cores: int) -> dict[str, object]:
    loaded = [p for p in phases if p.workload == workload and p.concurrency > 1]
    d = [p for p in loaded if p.path == "direct"]
    g = [p for p in loaded if p.path == "gateway"]
    ratios = [gp.rps / dp.rps for dp, gp in zip(d, g, strict=True) if dp.rps > 0]
    lat_d = [x for p in d for x in p.latencies]
    lat_g = [x for p in g for x in p.latencies]

    def cpu(ps: list[Phase], proc: str) -> float:
        return sum(p.cpu_s[proc] for p in ps) / max(1, sum(p.requests_total for p in ps)) * 1e3

    def runq(ps: list[Phase], proc: str) -> float:
        return sum(p.runq_s[proc] for p in ps) / sum(p.wall_s for p in ps)

    cpu_direct = {k: cpu(d, k) for k in ("client", "worker")}
    cpu_gateway = {k: cpu(g, k) for k in ("client", "gateway", "worker")}
    bound_d = cpu_bound_rps(list(cpu_direct.values()), cores)
    bound_g = cpu_bound_rps(list(cpu_gateway.values()), cores)
    single = {p.path: p for p in phases if p.workload == workload and p.concurrency == 1}  # unloaded latency
    out: dict[str, object] = {
        "direct_rps": round(statistics.mean(p.rps for p in d), 1),
        "gateway_rps": round(statistics.mean(p.rps for p in g), 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "ratio_per_round": [round(r, 3) for r in ratios],
        "direct_p50_ms": round(pct(lat_d, 0.5) * 1e3, 2),
        "gateway_p50_ms": round(pct(lat_g, 0.5) * 1e3, 2),
        "direct_p99_ms": round(pct(lat_d, 0.99) * 1e3, 2),
        "gateway_p99_ms": round(pct(lat_g, 0.99) * 1e3, 2),
        "added_p50_ms": round((pct(lat_g, 0.5) - pct(lat_d, 0.5)) * 1e3, 2),
        "added_p99_ms": round((pct(lat_g, 0.99) - pct(lat_d, 0.99)) * 1e3, 2),
        "errors": sum(p.errors for p in d + g),
        "cpu_ms_per_request": {
            "direct": {k: round(v, 3) for k, v in cpu_direct.items()},
            "gateway": {k: round(v, 3) for k, v in cpu_gateway.items()},
        },
        "runq_wait_per_s": {
            "direct": {k: round(runq(d, k), 2) for k in ("client", "worker")},
            "gateway": {k: round(runq(g, k), 2) for k in ("client", "gateway", "worker")},
        },
        "cpu_bound_rps": {"direct": round(bound_d), "gateway": round(bound_g)},
        "cpu_bound_ratio": round(bound_g / bound_d, 3),
    }
    if "direct" in single and "gateway" in single:
        c1d, c1g = pct(single["direct"].latencies, 0.5), pct(single["gateway"].latencies, 0.5)
        out["c1_direct_p50_ms"] = round(c1d * 1e3, 3)
        out["c1_gateway_p50_ms"] = round(c1g * 1e3, 3)
        out["c1_added_p50_ms"] = round((c1g - c1d) * 1e3, 3)
    return out


async def fixed_requests(port: int, w: Workload, n: int, concurrency: int) -> None:
    """Exactly `n` requests at `concurrency` (every answer checked)."""
    raw = request_bytes(port, w)
    conns = [await Conn.open(port) for _ in range(concurrency)]
    left = [n]

    async def loop(conn: Conn) -> None:
        while left[0] > 0:
            left[0] -= 1
            status, body = await conn.post(raw)
            if not answer_ok(w, status, body):
                raise RuntimeError(f"bad answer {status}: {body[-200:]!r}")

    try:
        await asyncio.gather(*(loop(c) for c in conns))
    finally:
        for c in conns:
            c.close()


def instructions_per_request(
    mosaic: list[str], cfg_path: str, n: int, concurrency: int, workloads: tuple[Workload, ...]
) -> dict[str, float]:
    """The gateway's user-space instructions per request, per workload, counted by valgrind's callgrind
    (instrumentation switched on only around `n` requests after a warm-up). Deterministic to ~1% whatever
    else runs on the machine, unlike CPU time; it does not count the kernel's share (system calls)."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        gateway, gport = start(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={tmp}/cg.out",
                *mosaic,
                "serve",
                "--config",
                cfg_path,
                "--port",
                "0",
            ]
        )
        try:
            asyncio.run(wait_ready(gport))
            for w in workloads:
                workload = w.name
                asyncio.run(fixed_requests(gport, w, max(100, n // 5), concurrency))  # warm-up
                ctl = ["callgrind_control"]
                before = set(Path(tmp).glob("cg.out*"))
                subprocess.run([*ctl, "--zero", str(gateway.pid)], check=True, capture_output=True)
                subprocess.run([*ctl, "-i", "on", str(gateway.pid)], check=True, capture_output=True)
                asyncio.run(fixed_requests(gport, w, n, concurrency))
                subprocess.run([*ctl, "-i", "off", str(gateway.pid)], check=True, capture_output=True)
                subprocess.run(
                    [*ctl, f"--dump={workload}", str(gateway.pid)], check=True, capture_output=True
                )
                for _ in range(100):  # the dump is written by the profiled process: wait for its file
                    if set(Path(tmp).glob("cg.out*")) - before:
                        break
                    time.sleep(0.1)
                time.sleep(0.2)
                total = 0
                for path in set(Path(tmp).glob("cg.out*")) - before:  # this workload's dump
                    counts = re.findall(r"^(?:summary|totals): (\d+)", path.read_text(errors="replace"), re.M)
                    total += max((int(c) for c in counts), default=0)  # "summary: 0" may precede "totals:"
                out[workload] = round(total / n)
                print(f"{workload:10s} gateway instructions per request: {out[workload]:,}", flush=True)
        finally:
            stop(gateway)
    return out


def record_instructions(args: argparse.Namespace, counts: dict[str, float]) -> int:
    result = {
        "bench": "gateway_overhead_instructions",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/gateway_overhead.py " + " ".join(sys.argv[1:]),
        "concurrency": args.concurrency,
        "requests_per_workload": args.instructions,
        "server_stack": _server_stack(args.python),
        "gateway_instructions_per_request": counts,
    }
    print(json.dumps(result, indent=2))
    if not args.no_record:
        suffix = "_embeddings" if args.runner == "pooling" else ""
        (RESULTS.parent / f"gateway_overhead{suffix}_instructions.json").write_text(
            json.dumps(result, indent=2) + "\n"
        )
        each = ", ".join(f"{name} {n:,.0f}" for name, n in counts.items())
        line = (
            f"| {result['date'][:10]} | gateway_overhead | `{result['command']}` | gateway user-space instructions "
            f"per request (callgrind, c={args.concurrency}): {each} |\n"
        )
        with BENCHMARKS.open("a") as fh:
            fh.write(line)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--single-seconds", type=float, default=1.5, help="length of the concurrency-1 phases")
    ap.add_argument("--no-record", action="store_true", help="print only; do not write results/BENCHMARKS.md")
    ap.add_argument(
        "--instructions",
        type=int,
        metavar="N",
        help="instead: the gateway's instructions per request over N requests per workload, under valgrind "
        "(robust on a shared machine; results/gateway_overhead_instructions.json)",
    )
    ap.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default="generate",
        help="pooling: the worker is an embedding server and the workloads /v1/embeddings (8 token ids, base64) "
        "and /rerank (a query, four documents)",
    )
    ap.add_argument(
        "--python",
        help="run worker and gateway with this interpreter (e.g. a venv that adds uvloop/httptools)",
    )
    args = ap.parse_args()
    mosaic = [args.python, "-c", "from server.cli import main; main()"] if args.python else MOSAIC
    cores = os.cpu_count() or 1
    load_start = os.getloadavg()[0]

    workloads = EMBED_WORKLOADS if args.runner == "pooling" else WORKLOADS
    worker, wport = start(
        [
            *mosaic,
            "worker",
            "--gpu",
            "H100",
            "--model",
            "llama-3-8b",
            "--port",
            "0",
            "--time-scale",
            "1e9",
            "--runner",
            args.runner,
        ]
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(
            f"pools:\n  - {{name: sim, model: llama-3-8b, gpu: H100, role: mixed, runner: {args.runner}, "
            f"endpoints: {{static: [http://127.0.0.1:{wport}]}}}}\n"
            "limits: {queue_size: 4096}\n"
        )
        cfg_path = f.name
    if args.instructions:
        try:
            counts = instructions_per_request(
                mosaic, cfg_path, args.instructions, args.concurrency, workloads
            )
        finally:
            stop(worker)
            os.unlink(cfg_path)
        return record_instructions(args, counts)
    gateway, gport = start([*mosaic, "serve", "--config", cfg_path, "--port", "0"])
    procs: dict[str, int | None] = {"client": None, "worker": worker.pid, "gateway": gateway.pid}
    shown = {"direct": ("client", "worker"), "gateway": ("client", "gateway", "worker")}
    phases: list[Phase] = []
    try:
        asyncio.run(wait_ready(gport))
        for _ in range(args.rounds):
            for w in workloads:
                for path, port in (("direct", wport), ("gateway", gport)):
                    ph = measure(procs, port, w, path, args.concurrency, args.seconds, args.warmup)
                    phases.append(ph)
                    report_phase(ph, shown[path])
        for w in workloads:
            for path, port in (("direct", wport), ("gateway", gport)):
                ph = measure(procs, port, w, path, 1, args.single_seconds, 0.3)
                phases.append(ph)
                report_phase(ph, shown[path])
    finally:
        stop(gateway)
        stop(worker)
        os.unlink(cfg_path)

    summary = {w.name: summarise(phases, w.name, cores) for w in workloads}
    result = {
        "bench": "gateway_overhead",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/gateway_overhead.py " + " ".join(sys.argv[1:]),
        "concurrency": args.concurrency,
        "seconds_per_phase": args.seconds,
        "rounds": args.rounds,
        "machine": {
            "cpus": cores,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1m_at_start": round(load_start, 2),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "server_stack": _server_stack(args.python),
        "bar": "gateway throughput ≥ 0.80 × direct",
        "results": summary,
        "phases": [
            {
                "path": p.path,
                "workload": p.workload,
                "concurrency": p.concurrency,
                "rps": round(p.rps, 1),
                "n": len(p.latencies),
                "p50_ms": round(pct(p.latencies, 0.5) * 1e3, 3),
                "errors": p.errors,
                "cpu_ms_per_request": {k: round(p.cpu_per_request_ms(k), 3) for k in shown[p.path]},
                "runq_wait_per_s": {k: round(p.runq_s[k] / p.wall_s, 2) for k in shown[p.path]},
                "error_samples": p.error_samples,
            }
            for p in phases
        ],
    }
    print(json.dumps(summary, indent=2))
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        suffix = "_embeddings" if args.runner == "pooling" else ""
        RESULTS.with_name(f"gateway_overhead{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
        each = "; ".join(_summary_text(name, summary[name]) for name in summary)
        line = (
            f"| {result['date'][:10]} | gateway_overhead | `{result['command']}` | c={args.concurrency}, "
            f"{result['server_stack']}, load {load_start:.1f}: {each}; bar 0.80 |\n"
        )
        new = not BENCHMARKS.exists()
        with BENCHMARKS.open("a") as fh:
            if new:
                fh.write(BENCH_HEADER)
            fh.write(line)
    return 0


def _summary_text(name: str, s: dict[str, Any]) -> str:
    """One workload's part of the BENCHMARKS.md line."""
    cpu = s["cpu_ms_per_request"]
    return (
        f"{name} {s['ratio']:.2f}× direct (rounds {s['ratio_min']:.2f}–{s['ratio_max']:.2f}; "
        f"{s['gateway_rps']:.0f} vs {s['direct_rps']:.0f} req/s, +{s['added_p50_ms']:.1f} ms p50; gateway CPU "
        f"{cpu['gateway']['gateway']:.2f} ms per request vs worker {cpu['direct']['worker']:.2f})"
    )


if __name__ == "__main__":
    sys.exit(main())
