"""PNG plots of a run: latency percentiles against load, the batch-size histogram, latency over time.

matplotlib is imported only when a plot is drawn, so a run starts without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coalesce.loadtests.results import RunResult, StepResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_ticks() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def _load(st: StepResult) -> float:
    return st.offered_rps if st.offered_rps is not None else st.achieved_rps


_PERCENTILES = (
    ("p50", "p50_ms", "-"),
    ("p95", "p95_ms", "--"),
    ("p99", "p99_ms", "-."),
    ("p99.9", "p999_ms", ":"),
)


def latency_vs_load(
    series: Sequence[tuple[str, Sequence[StepResult]]],
    path: Path,
    slo_ms: float | None = None,
    which: Sequence[str] = ("p50", "p95", "p99", "p99.9"),
) -> Path:
    """Latency percentiles against offered load (achieved load for closed-loop steps), one series each."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    percentiles = [p for p in _PERCENTILES if p[0] in which]
    for name, steps in series:
        pts = sorted((_load(s), s.latency) for s in steps if s.latency is not None)
        if not pts:
            continue
        xs = [x for x, _ in pts]
        for pname, attr, style in percentiles:
            label = f"{name} {pname}".strip()
            ax.plot(xs, [getattr(lat, attr) for _, lat in pts], style, marker="o", label=label)
    if slo_ms is not None:
        ax.axhline(slo_ms, color="black", lw=0.8, ls="--", label=f"p99 target {slo_ms:g} ms")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms, log)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_plain_ticks())
    ax.yaxis.set_minor_formatter(_plain_ticks())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Latency percentiles vs offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def batch_histogram(series: Sequence[tuple[str, StepResult]], path: Path) -> Path:
    """Batches per batch-size bucket, from the server's metrics, one group of bars per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    n = max(1, len(series))
    width = 0.8 / n
    labels: list[str] = []
    for k, (name, st) in enumerate(series):
        assert st.batch is not None
        buckets = st.batch.size_buckets
        labels = [str(int(b.hi)) if b.hi is not None else f">{int(b.lo)}" for b in buckets]
        ax.bar([i + k * width for i in range(len(buckets))], [b.count for b in buckets], width, label=name)
    ax.set_xticks([i + (n - 1) * width / 2 for i in range(len(labels))], labels)
    ax.set_xlabel("batch size (upper bucket bound)")
    ax.set_ylabel("batches")
    ax.set_title("Batch size distribution (server metrics)")
    if n > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def latency_over_time(steps: Sequence[StepResult], path: Path) -> Path:
    """p50/p99 per time bin (by scheduled send time) with the requests sent per bin, steps end to end."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax2 = ax.twinx()
    offset = 0.0
    for st in steps:
        tl = st.timeline
        if tl is None:
            continue
        xs = [offset + t for t in tl.start_s]
        ax.plot(xs, [v if v is not None else float("nan") for v in tl.p50_ms], color="tab:blue", lw=1)
        ax.plot(xs, [v if v is not None else float("nan") for v in tl.p99_ms], color="tab:red", lw=1)
        ax2.step(xs, [s / tl.bin_s for s in tl.sent], where="post", color="tab:gray", alpha=0.5, lw=1)
        offset += tl.bin_s * len(tl.start_s)
    ax.set_xlabel("time (s, by scheduled send)")
    ax.set_ylabel("latency (ms): p50 blue, p99 red")
    ax2.set_ylabel("offered requests/s (gray)")
    ax.grid(True, alpha=0.3)
    ax.set_title("Latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(result: RunResult, out: Path) -> list[Path]:
    """All plots that the run has data for, written into ``out``."""
    paths = [latency_vs_load([("", result.steps)], out / "latency_vs_load.png", result.slo_p99_ms)]
    with_batches = [s for s in result.steps if s.batch is not None and s.batch.batches > 0]
    if with_batches:
        top = max(with_batches, key=_load)
        paths.append(batch_histogram([(top.label, top)], out / "batch_sizes.png"))
    paths.append(latency_over_time(result.steps, out / "latency_over_time.png"))
    return paths


def write_compare_plots(results: Sequence[tuple[str, RunResult]], out: Path) -> list[Path]:
    """Plots that put several servers' runs of one scenario side by side."""
    series = [(name, r.steps) for name, r in results]
    paths = [latency_vs_load(series, out / "compare_latency_vs_load.png", which=("p50", "p99"))]
    tops = []
    for name, r in results:
        with_batches = [s for s in r.steps if s.batch is not None and s.batch.batches > 0]
        if with_batches:
            tops.append((name, max(with_batches, key=_load)))
    if tops:
        paths.append(batch_histogram(tops, out / "compare_batch_sizes.png"))
    return paths
