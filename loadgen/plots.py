"""PNG plots of a replay (`--plot DIR`), drawn with matplotlib's Agg canvas (no display, no global backend).

- `latency_cdf.png`: empirical CDFs of TTFT, TPOT, ITL and E2EL (ms, log x) of successful requests;
- `timeline.png`: per 1-second bin, completed requests/s and output tokens/s (each content chunk weighted
  by its request's tokens per chunk), and requests in flight (sent, not finished) sampled at bin edges,
  with the scheduled (offered) request rate for comparison.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from loadgen.client import RequestRecord


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def latency_cdf(records: list[RequestRecord], path: Path) -> Path:
    ok = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft_s for r in ok],
        "TPOT (excl. 1st token)": [r.tpot_s for r in ok if r.tpot_s is not None],
        "ITL (between chunks)": [x for r in ok for x in r.itls_s()],
        "E2EL": [r.e2el_s for r in ok],
    }
    fig = Figure(figsize=(10, 7))
    for i, (name, values) in enumerate(series.items()):
        ax = fig.add_subplot(2, 2, i + 1)
        v = np.sort(np.asarray([x for x in values if x is not None], dtype=float) * 1000.0)
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
            if v[0] > 0:
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(ScalarFormatter())  # 100, 1000 rather than 10², 10³
                ax.xaxis.set_minor_formatter(NullFormatter())
            for q in (50, 90, 99):
                ax.axvline(np.percentile(v, q), ls=":", lw=0.8, color="grey")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{name}  (n={v.size})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(True, alpha=0.3)
    return _save(fig, path)


def timeline_series(records: list[RequestRecord], bin_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per-bin series: t (bin start), offered (scheduled req/s), completed (req/s), tokens (tok/s), in_flight."""
    end = max((r.end_s for r in records), default=0.0)
    n_bins = max(1, int(np.ceil(end / bin_s)))
    edges = np.arange(n_bins + 1) * bin_s
    offered = np.histogram([r.scheduled_s for r in records], bins=edges)[0] / bin_s
    completed = np.histogram([r.end_s for r in records if r.success], bins=edges)[0] / bin_s
    chunk_t: list[float] = []
    chunk_w: list[float] = []
    for r in records:
        if r.success and r.chunk_s:
            chunk_t.extend(r.chunk_s)
            chunk_w.extend([r.output_tokens / len(r.chunk_s)] * len(r.chunk_s))
    tokens = np.histogram(chunk_t, bins=edges, weights=chunk_w)[0] / bin_s if chunk_t else np.zeros(n_bins)
    sent = np.sort([r.sent_s for r in records])
    ended = np.sort([r.end_s for r in records])
    in_flight = np.searchsorted(sent, edges[1:], side="right") - np.searchsorted(
        ended, edges[1:], side="right"
    )
    return {
        "t": edges[:-1],
        "offered": offered,
        "completed": completed,
        "tokens": tokens,
        "in_flight": in_flight,
    }


def timeline(records: list[RequestRecord], path: Path, bin_s: float = 1.0) -> Path:
    s = timeline_series(records, bin_s)
    fig = Figure(figsize=(10, 7))
    ax1 = fig.add_subplot(3, 1, 1)
    ax1.plot(s["t"], s["offered"], label="scheduled (offered)", lw=1, color="grey")
    ax1.plot(s["t"], s["completed"], label="completed", lw=1.2)
    ax1.set_ylabel("requests/s")
    ax1.legend(loc="upper right")
    ax2 = fig.add_subplot(3, 1, 2, sharex=ax1)
    ax2.plot(s["t"], s["tokens"], lw=1.2, color="tab:green")
    ax2.set_ylabel("output tokens/s")
    ax3 = fig.add_subplot(3, 1, 3, sharex=ax1)
    ax3.step(s["t"] + bin_s, s["in_flight"], where="post", lw=1.2, color="tab:red")
    ax3.set_ylabel("in flight")
    ax3.set_xlabel(f"seconds since start ({bin_s:g} s bins)")
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
    return _save(fig, path)


def write_plots(records: list[RequestRecord], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [
        latency_cdf(records, directory / "latency_cdf.png"),
        timeline(records, directory / "timeline.png"),
    ]
