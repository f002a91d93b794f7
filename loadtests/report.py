"""Human-readable results: the terminal summary, the markdown report and the comparison table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from coalesce.loadtests.results import BatchStats, RunResult, StepResult


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}×"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        )
    ]
    for row in rows:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(out)


STEP_HEADERS = (
    "step",
    "offered/s",
    "achieved/s",
    "inputs/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "p99.9 ms",
    "errors",
    "mean batch",
    "queue ms",
    "padding",
)


def _errors(step: StepResult) -> str:
    bad = {k: v for k, v in step.by_status.items() if k != "200"}
    if not bad:
        return "0"
    return f"{step.error_rate:.1%} (" + ", ".join(f"{k}×{v}" for k, v in bad.items()) + ")"


def step_row(step: StepResult) -> list[str]:
    lat, b = step.latency, step.batch
    queue = b.mean_queue_ms if b and b.mean_queue_ms is not None else step.header_queue_ms
    return [
        step.label,
        fmt(step.offered_rps) if step.offered_rps is not None else f"c={step.concurrency}",
        fmt(step.achieved_rps),
        fmt(step.achieved_inputs_per_s),
        fmt(lat.p50_ms if lat else None),
        fmt(lat.p95_ms if lat else None),
        fmt(lat.p99_ms if lat else None),
        fmt(lat.p999_ms if lat else None),
        _errors(step),
        fmt(b.mean_batch_size if b else None, 2),
        fmt(queue),
        fmt(b.mean_padding_ratio if b else None, 2),
    ]


def _cost_lines(result: RunResult) -> list[str]:
    lines = []
    for st in result.steps:
        if st.cost is not None:
            c = st.cost
            lines.append(
                f"{st.label}: ${fmt(c.per_1k_requests, 4)} per 1k requests, ${fmt(c.per_1m_embeddings, 4)} "
                f"per 1M embeddings at ${c.per_hour:g}/hour and the achieved rate"
            )
    return lines


def _slo_line(result: RunResult) -> str | None:
    if result.slo_p99_ms is None:
        return None
    if result.max_rps_within_slo is None:
        return f"No measured load held p99 <= {result.slo_p99_ms:g} ms."
    return f"Highest load that held p99 <= {result.slo_p99_ms:g} ms: {result.max_rps_within_slo:.1f} req/s."


def _generator(result: RunResult) -> str:
    g = result.generator
    if g.ceiling_closed_rps is None:
        return g.note + "; `coalesce loadtest selftest` measures its ceiling"
    held = f"{g.ceiling_open_rps:,.0f}" if g.ceiling_open_rps else "-"
    return (
        f"{g.note}; its ceiling on this machine, measured before the run against an instant stub: "
        f"{g.ceiling_closed_rps:,.0f} req/s closed loop, {held} req/s open loop"
    )


def terminal_summary(result: RunResult) -> str:
    sc = result.scenario
    lines = [
        f"coalesce loadtest: {result.mode} against {result.url} (model {result.model}, mix {sc.get('mix')})",
        "",
        text_table(STEP_HEADERS, [step_row(s) for s in result.steps]),
        "",
    ]
    if (slo := _slo_line(result)) is not None:
        lines.append(slo)
    lines += _cost_lines(result)
    if not any(s.batch for s in result.steps):
        lines.append("Server batch metrics: not available (no coalesce_* metrics at /metrics).")
    lines.append(f"Generator: {_generator(result)}.")
    return "\n".join(lines)


def _batch_section(step: StepResult, b: BatchStats) -> list[str]:
    rows = [
        [
            f"{int(bc.lo) + 1}–{int(bc.hi)}"
            if bc.hi is not None and bc.hi - bc.lo > 1
            else (str(int(bc.hi)) if bc.hi is not None else f">{int(bc.lo)}"),
            str(bc.count),
        ]
        for bc in b.size_buckets
        if bc.count
    ]
    out = [
        f"### Server batching: {step.label}",
        "",
        f"{b.batches} batches, {b.inputs} inputs, mean batch size {fmt(b.mean_batch_size, 2)}, "
        f"mean padding ratio {fmt(b.mean_padding_ratio, 2)}, queue wait mean {fmt(b.mean_queue_ms)} ms "
        f"(p50 ≈ {fmt(b.p50_queue_ms)}, p99 ≈ {fmt(b.p99_queue_ms)} ms from buckets), "
        f"forward mean {fmt(b.mean_forward_ms)} ms, "
        f"mean padded tokens per batch {fmt(b.mean_batch_tokens, 0)}.",
        "",
    ]
    if b.server_requests:
        seen = ", ".join(f"{k}×{v}" for k, v in b.server_requests.items())
        out += [f"Server-side responses by status: {seen}.", ""]
    if b.server_rejected:
        out += [
            "Server-side rejections by reason: "
            + ", ".join(f"{k}×{v}" for k, v in b.server_rejected.items())
            + ".",
            "",
        ]
    if rows:
        out += [markdown_table(["batch size", "batches"], rows), ""]
    return out


def markdown_report(result: RunResult, plots: Sequence[Path] = ()) -> str:
    """The run as a markdown document; ``plots`` are linked by file name (they sit beside it)."""
    sc = result.scenario
    lines = [
        f"# Load test: {result.mode} against {result.url}",
        "",
        f"- Date: {result.created}",
        f"- Model: `{result.model}`; mix `{sc.get('mix')}`, inputs per request "
        f"{sc.get('inputs_per_request') or 'mix default'}, encoding `{sc.get('encoding_format')}`",
        f"- Command: `{' '.join(result.command)}`",
        f"- Generator: {_generator(result)}.",
        "",
        "Latency is measured from each request's scheduled send time (open loop), so queueing is not "
        "hidden. Achieved throughput is good responses over the measured window, or over the time to the "
        "last response when a backlog made that longer.",
        "",
        markdown_table(STEP_HEADERS, [step_row(s) for s in result.steps]),
        "",
    ]
    if (slo := _slo_line(result)) is not None:
        lines += [slo, ""]
    if costs := _cost_lines(result):
        lines += [*(f"- {c}" for c in costs), ""]
    for st in result.steps:
        if st.batch is not None:
            lines += _batch_section(st, st.batch)
    if not any(s.batch for s in result.steps):
        lines += ["Server batch metrics: not available (the server exports no `coalesce_*` metrics).", ""]
    for p in plots:
        lines += [f"![{p.stem}]({p.name})", ""]
    return "\n".join(lines)


COMPARE_HEADERS = (
    "server",
    "step",
    "achieved/s",
    "× base",
    "p50 ms",
    "× base",
    "p99 ms",
    "× base",
    "errors",
    "mean batch",
)


def comparison_rows(results: Sequence[tuple[str, RunResult | None, str]]) -> list[list[str]]:
    """Rows for ``(name, result or None, note)``; ratios against the first result's matching step."""
    base = next((r for _, r, _ in results if r is not None), None)
    rows = []
    for name, res, note in results:
        if res is None:
            rows.append([name, note or "not run", *["-"] * (len(COMPARE_HEADERS) - 2)])
            continue
        for i, st in enumerate(res.steps):
            b = base.steps[i] if base is not None and i < len(base.steps) else None
            lat, blat = st.latency, (b.latency if b else None)
            rows.append(
                [
                    name,
                    st.label,
                    fmt(st.achieved_rps),
                    ratio(st.achieved_rps, b.achieved_rps if b else None),
                    fmt(lat.p50_ms if lat else None),
                    ratio(lat.p50_ms if lat else None, blat.p50_ms if blat else None),
                    fmt(lat.p99_ms if lat else None),
                    ratio(lat.p99_ms if lat else None, blat.p99_ms if blat else None),
                    _errors(st),
                    fmt(st.batch.mean_batch_size if st.batch else None, 2),
                ]
            )
    return rows
