"""Gateway overhead: the same short requests sent directly to a zero-compute simulated worker and through
the gateway, at a fixed concurrency.

    .venv/bin/python bench/gateway_overhead.py [--concurrency 32] [--seconds 5] [--rounds 2]

Processes: one simulated worker (`mosaic worker --time-scale 1e9`: the engine model takes no wall time, so
what is measured is HTTP, JSON and proxying), one gateway (`mosaic serve` with a static pool pointing at
that worker), and this load generator. The load generator is a minimal keep-alive HTTP/1.1 client on
asyncio streams, so that its own cost is small and equal on both paths.

Workloads: `/v1/completions`, 8-token prompt, `max_tokens: 16`, `ignore_eos` — non-streaming, and
streaming (16 token chunks + `[DONE]`). Phases alternate direct / gateway for `--rounds` rounds; each
phase runs `--seconds` after a short warm-up. Reported per workload: requests/s direct and through the
gateway, their ratio (the bar: ≥ 0.80), and p50/p99 end-to-end latency of each path and the difference.

Results: `bench/results/gateway_overhead.json`, and one line appended to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "gateway_overhead.json"
BENCHMARKS = ROOT / "BENCHMARKS.md"
BENCH_HEADER = "| date | bench | command | key ratio/result |\n|---|---|---|---|\n"
MOSAIC = (
    [str(ROOT / ".venv" / "bin" / "mosaic")] if (ROOT / ".venv" / "bin" / "mosaic").exists() else ["mosaic"]
)
URL_RE = re.compile(r"http://127\.0\.0\.1:(\d+)")


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


def request_bytes(port: int, stream: bool) -> bytes:
    body = json.dumps(
        {
            "model": "llama-3-8b",
            "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class Phase:
    path: str
    workload: str
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # process → CPU seconds over the whole phase
    requests_total: int = 0  # including warm-up, for CPU per request
    error_samples: list[str] = field(default_factory=list)  # first few failures: status and body tail

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds


async def run_phase(
    port: int, stream: bool, concurrency: int, seconds: float, warmup: float, phase: Phase
) -> None:
    raw = request_bytes(port, stream)
    conns = [await Conn.open(port) for _ in range(concurrency)]
    start = time.perf_counter()
    t_measure, t_end = start + warmup, start + warmup + seconds

    async def loop(conn: Conn) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            status, body = await conn.post(raw)
            t1 = time.perf_counter()
            phase.requests_total += 1
            ok = status == 200 and (not stream or body.count(b"data: ") == 17)  # 16 chunks + [DONE]
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


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="print only; do not write results/BENCHMARKS.md")
    ap.add_argument(
        "--python",
        help="run worker and gateway with this interpreter (e.g. a venv that adds uvloop/httptools)",
    )
    args = ap.parse_args()
    mosaic = [args.python, "-c", "from server.cli import main; main()"] if args.python else MOSAIC

    worker, wport = start(
        [*mosaic, "worker", "--gpu", "H100", "--model", "llama-3-8b", "--port", "0", "--time-scale", "1e9"]
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(
            "pools:\n  - {name: sim, model: llama-3-8b, gpu: H100, role: mixed, "
            f"endpoints: {{static: [http://127.0.0.1:{wport}]}}}}\n"
            "limits: {queue_size: 4096}\n"
        )
        cfg_path = f.name
    gateway, gport = start([*mosaic, "serve", "--config", cfg_path, "--port", "0"])
    phases: list[Phase] = []
    try:
        asyncio.run(wait_ready(gport))
        for _ in range(args.rounds):
            for workload, stream in (("non-stream", False), ("stream-16", True)):
                for path, port in (("direct", wport), ("gateway", gport)):
                    ph = Phase(path, workload, args.seconds)
                    before = {"worker": cpu_seconds(worker.pid), "gateway": cpu_seconds(gateway.pid)}
                    asyncio.run(run_phase(port, stream, args.concurrency, args.seconds, args.warmup, ph))
                    ph.cpu_s = {
                        k: cpu_seconds(p.pid) - before[k]
                        for k, p in (("worker", worker), ("gateway", gateway))
                    }
                    phases.append(ph)
                    per = {k: v / max(1, ph.requests_total) * 1e3 for k, v in ph.cpu_s.items()}
                    print(
                        f"{workload:10s} {path:8s} {ph.rps:8.1f} req/s  p50 {pct(ph.latencies, 0.5) * 1e3:6.2f} ms"
                        f"  p99 {pct(ph.latencies, 0.99) * 1e3:6.2f} ms  errors {ph.errors}  CPU/request: worker "
                        f"{per['worker']:.2f} ms, gateway {per['gateway']:.2f} ms",
                        flush=True,
                    )
                    for sample in ph.error_samples:
                        print(f"    error: {sample}", flush=True)
    finally:
        stop(gateway)
        stop(worker)
        os.unlink(cfg_path)

    summary: dict[str, dict[str, float]] = {}
    for workload in ("non-stream", "stream-16"):
        d = [p for p in phases if p.workload == workload and p.path == "direct"]
        g = [p for p in phases if p.workload == workload and p.path == "gateway"]
        lat_d = [x for p in d for x in p.latencies]
        lat_g = [x for p in g for x in p.latencies]
        rps_d = sum(p.rps for p in d) / len(d)
        rps_g = sum(p.rps for p in g) / len(g)
        cpu_w = sum(p.cpu_s["worker"] for p in d) / max(1, sum(p.requests_total for p in d))
        cpu_g = sum(p.cpu_s["gateway"] for p in g) / max(1, sum(p.requests_total for p in g))
        summary[workload] = {
            "direct_rps": round(rps_d, 1),
            "gateway_rps": round(rps_g, 1),
            "ratio": round(rps_g / rps_d, 3),
            "direct_p50_ms": round(pct(lat_d, 0.5) * 1e3, 2),
            "gateway_p50_ms": round(pct(lat_g, 0.5) * 1e3, 2),
            "direct_p99_ms": round(pct(lat_d, 0.99) * 1e3, 2),
            "gateway_p99_ms": round(pct(lat_g, 0.99) * 1e3, 2),
            "added_p50_ms": round((pct(lat_g, 0.5) - pct(lat_d, 0.5)) * 1e3, 2),
            "added_p99_ms": round((pct(lat_g, 0.99) - pct(lat_d, 0.99)) * 1e3, 2),
            "errors": sum(p.errors for p in d + g),
            "worker_cpu_ms_per_request": round(cpu_w * 1e3, 3),
            "gateway_cpu_ms_per_request": round(cpu_g * 1e3, 3),
        }
    result = {
        "bench": "gateway_overhead",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/gateway_overhead.py " + " ".join(sys.argv[1:]),
        "concurrency": args.concurrency,
        "seconds_per_phase": args.seconds,
        "rounds": args.rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "server_stack": _server_stack(args.python),
        "bar": "gateway throughput ≥ 0.80 × direct",
        "results": summary,
        "phases": [
            {
                "path": p.path,
                "workload": p.workload,
                "rps": round(p.rps, 1),
                "n": len(p.latencies),
                "errors": p.errors,
                "error_samples": p.error_samples,
            }
            for p in phases
        ],
    }
    print(json.dumps(summary, indent=2))
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        line = (
            f"| {result['date'][:10]} | gateway_overhead | `{result['command']}` | c={args.concurrency}: "
            f"non-stream {summary['non-stream']['ratio']:.2f}× direct ({summary['non-stream']['gateway_rps']:.0f} vs "
            f"{summary['non-stream']['direct_rps']:.0f} req/s, +{summary['non-stream']['added_p50_ms']:.1f} ms p50), "
            f"stream-16 {summary['stream-16']['ratio']:.2f}× ({summary['stream-16']['gateway_rps']:.0f} vs "
            f"{summary['stream-16']['direct_rps']:.0f} req/s, +{summary['stream-16']['added_p50_ms']:.1f} ms p50); bar 0.80 |\n"
        )
        new = not BENCHMARKS.exists()
        with BENCHMARKS.open("a") as fh:
            if new:
                fh.write(BENCH_HEADER)
            fh.write(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
