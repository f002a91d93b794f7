"""The bench's ``overload`` section: a burst is absorbed, a sustained overload is shed at the door.

One run, side by side:

* **RAG ingestion burst** — ``coalesce.loadtests.burst`` (the official ``openai`` client, default
  retries, 1,000 one-chunk calls under ``asyncio.gather``) in a process of its own, against Coalesce
  and against Infinity, each freshly started: calls failed after the client's retries, wall time, and
  the 429s the server sent;
* **mixed burst at idle** — 120 concurrent one-text requests of 1 to 200 words, no retries: refusals;
* **open loop** at 0.5×, 1×, 2× and 4× Coalesce's measured capacity (closed loop, 64 clients), both
  driven by the lean ``rawclient`` (``--client raw``), the generator sharing the server's cores: the
  admitted requests' p99 from each request's scheduled send time, the refused share, goodput, and the
  CPU a refusal costs the event loop (the server's main thread, which reads, checks and answers every
  request: its CPU beyond what the admitted requests cost it at the busiest step below 2× that refused
  none, over the refusals; per admitted request the loop's work falls as batches grow, and taken from
  0.5×, whose batches are the smallest, the estimate came out negative with two forwards side by side).
  The process's CPU is not used for that: its forward threads spin while they wait for work, so at 0.5×
  they burn more per admitted request than under overload, and the difference came out negative;
* **a cold flood** — a fresh server flooded at 4× capacity from its first second by the raw client,
  whose connections are all new (a replica that comes up under load): goodput, the admitted p99, the
  slowest 1%'s time outside the server, and the handshakes the kernel dropped with its queue of
  connections waiting to be accepted full (``TcpExtListenOverflows``, machine-wide).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
from coalesce.loadtests import servers
from coalesce.loadtests.bench_sections import _model_dir, _run, _spec
from coalesce.loadtests.procs import main_thread_cpu_seconds
from coalesce.loadtests.promtext import parse
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.results import StepResult
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix, TextSource

CHUNKS = 1000
IDLE_BURST = 120
LOADS = (0.5, 1.0, 2.0, 4.0)
COLD_LOAD = 4.0  # the cold flood's multiple of capacity
COLD_S = 10.0  # its measured seconds, from its first
TARGET_MS = 500.0
WARMUP_S = 2.0  # before each open-loop step's measured window


def _burst(base_url: str, seed: int) -> dict[str, object]:
    """The ingestion burst, in its own process (its client's CPU is not ours)."""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.burst", base_url, "--chunks", str(CHUNKS), "--seed",
         str(seed)], capture_output=True, text=True, timeout=900, check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _too_many(base_url: str) -> int:
    """429s the server has answered on its embeddings routes (Coalesce's /metrics; 0 elsewhere)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0
    return int(sum(v for (name, labels), v in parse(text).items()
                   if name == "coalesce_requests_total" and dict(labels).get("status") == "429"))


async def _idle_burst(url: str) -> dict[str, int]:
    """120 concurrent one-text requests of mixed lengths, no retries: answers by status."""
    rng = random.Random(7)
    source = TextSource(rng)
    texts = [f"{source.text(rng.randint(1, 200))} #{i}" for i in range(IDLE_BURST)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(text: str) -> int:
            async with s.post(url, json={"model": "all-MiniLM-L6-v2", "input": text}) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(t) for t in texts))
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


def overload(args: argparse.Namespace) -> tuple[str, str]:
    out: Path = args.out / "overload"
    title = "Overload: a burst is absorbed, a sustained overload is shed at the door (CPU)"
    bursts: dict[str, dict[str, object]] = {}
    idle: dict[str, dict[str, int]] = {}
    steps: list[tuple[float, StepResult, float]] = []  # (load, result, event-loop CPU seconds)
    flags = ["--log-level", "warning", "--target-latency-ms", f"{TARGET_MS:g}"]
    with servers.running(_spec(args, "coalesce", flags), out / "logs", args.ready_timeout) as srv:
        # The mixed burst first, while the server is idle: a queue that stood (as the ingestion burst
        # makes it) is quick to stand again for a few seconds after.
        idle["coalesce"] = asyncio.run(_idle_burst(srv.url))
        bursts["coalesce"] = {**_burst(srv.base_url, seed=1), "429s": _too_many(srv.base_url)}
        # The raw client: aiohttp's costs the shared cores several times more per request, which at
        # 4× load was CPU taken from the model (the goodput measured the generator as much as the server).
        probe = Scenario(mode=Mode.CLOSED, concurrency=64, duration=10.0, warmup=2.0, mix=Mix.SHORT,
                         client="raw")
        probed = _run(srv.url, probe, "capacity", out)
        capacity = probed.achieved_rps
        for load in LOADS:
            scenario = Scenario(mode=Mode.OPEN, rate=round(load * capacity, 1), duration=args.duration,
                                warmup=WARMUP_S, mix=Mix.SHORT, timeout=60.0, max_inflight=8192, client="raw")
            before = main_thread_cpu_seconds(srv.proc.pid)
            st = _run(srv.url, scenario, f"open {load:g}x", out)
            # (The warm-up's CPU out: the step's requests are those of its measured window.)
            cpu = main_thread_cpu_seconds(srv.proc.pid) - before
            steps.append((load, st, cpu * st.duration_s / (st.duration_s + WARMUP_S)))
    # A fresh server, flooded from its first second: every connection new, no warm-up left out.
    cold_flood = Scenario(mode=Mode.OPEN, rate=round(COLD_LOAD * capacity, 1), duration=COLD_S, warmup=0.0,
                          mix=Mix.SHORT, timeout=60.0, max_inflight=8192, client="raw")
    with servers.running(_spec(args, "coalesce", flags), out / "logs", args.ready_timeout) as srv:
        dropped = _listen_overflows()
        cold = _run(srv.url, cold_flood, f"cold {COLD_LOAD:g}x", out)
        after = _listen_overflows()
        cold_dropped = after - dropped if after is not None and dropped is not None else None
    binary = Path(args.infinity_bin)
    if binary.exists():
        spec = servers.infinity_spec(str(binary), _model_dir(), "all-MiniLM-L6-v2")
        with servers.running(spec, out / "logs", args.ready_timeout) as srv:
            idle["infinity"] = asyncio.run(_idle_burst(srv.url))
            bursts["infinity"] = {**_burst(srv.base_url, seed=2), "429s": "-"}
    return title, _report(bursts, idle, steps, probed) + _cold_report(cold, cold_dropped, capacity)


def _listen_overflows() -> int | None:
    """The kernel's count of connections it dropped with a listening socket's accept queue full
    (``TcpExtListenOverflows`` in /proc/net/netstat: every socket on the machine), or None."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:") and "ListenOverflows" in names.split():
            return int(values.split()[names.split().index("ListenOverflows")])
    return None


def _cold_report(st: StepResult, dropped: int | None, capacity: float) -> str:
    """The cold flood's table."""
    goodput = st.ok / st.duration_s if st.duration_s else 0.0
    lat, t = st.latency, st.tail
    row = [f"{COLD_LOAD:g}×, cold", fmt(st.offered_rps), fmt(goodput), f"{goodput / capacity:.2f}×",
           fmt(lat.p50_ms if lat else None), fmt(lat.p99_ms if lat else None),
           fmt(lat.p999_ms if lat else None), _refused_share(st), _answers(st),
           fmt(t.outside_ms) if t else "-", fmt(t.queue_ms) if t else "-",
           "-" if dropped is None else str(dropped)]
    return (
        f"\nA cold flood: a fresh server, offered {COLD_LOAD:g}× capacity from its first second for "
        f"{COLD_S:g} s by the raw client, whose every connection is new (a replica that comes up under "
        "load; nothing left out as warm-up). The slowest 1% of the admitted requests taken apart as above; "
        "handshakes dropped: connections the kernel turned away with a listening socket's queue of "
        "connections waiting to be accepted full, which a client retries after 1, 3, 7, 15 s "
        "(`TcpExtListenOverflows`, every socket on the machine):\n\n"
        + markdown_table(["load", "offered/s", "goodput/s", "÷ capacity", "p50 ms", "p99 ms", "p99.9 ms",
                          "refused", "answers", "slowest 1%: outside ms", "slowest 1%: queue ms",
                          "handshakes dropped"], [row])
        + "\n"
    )


def _report(bursts: dict[str, dict[str, object]], idle: dict[str, dict[str, int]],
            steps: list[tuple[float, StepResult, float]], probed: StepResult) -> str:
    capacity = probed.achieved_rps
    co, inf = bursts["coalesce"], bursts.get("infinity")
    ratio = (float(co["wall_s"]) / float(inf["wall_s"])) if inf else None  # type: ignore[arg-type]
    burst_rows = [[name, f"{b['failed']} of {b['calls']}", fmt(float(b["wall_s"]), 2),  # type: ignore[arg-type]
                   str(b["429s"]), _kinds(b["failed_by_kind"])] for name, b in bursts.items()]
    idle_rows = [[name, ", ".join(f"{k}×{v}" for k, v in sorted(c.items()))] for name, c in idle.items()]
    # The event loop's CPU per admitted request, at the busiest step below 2× that refused none (batches
    # nearest the loaded steps'): what a refusal's estimate subtracts.
    unrefused = [(load, cpu / st.ok) for load, st, cpu in steps
                 if load < 2 and st.ok and st.ok == st.requests]
    basis, cpu_ok = max(unrefused) if unrefused else (None, None)
    step_rows = []
    checks = [
        ["burst: calls failed after the client's retries", "0", str(co["failed"]), _met(co["failed"] == 0)],
        ["burst: wall time ÷ Infinity's", "≤ 1.1×", f"{ratio:.2f}×" if ratio else "Infinity not run",
         _met(ratio is not None and ratio <= 1.1)],
        ["mixed burst at idle: refusals", "0", str(sum(v for k, v in idle["coalesce"].items() if k != "200")),
         _met(set(idle["coalesce"]) == {"200"})],
    ]
    tail_rows = []
    for load, st, cpu in steps:
        t = st.tail
        tail_rows.append([f"{load:g}×", *(["-"] * 6 if t is None else [
            str(t.count), fmt(t.latency_ms), fmt(t.queue_ms), fmt(t.forward_ms), fmt(st.header_inference_ms),
            fmt(t.outside_ms)])])
        refused = st.requests - st.ok
        per_refusal = ((cpu - st.ok * cpu_ok) / refused * 1e6) if cpu_ok and refused else None
        p99 = st.latency.p99_ms if st.latency else None
        goodput = st.ok / st.duration_s if st.duration_s else 0.0
        step_rows.append([f"{load:g}×", fmt(st.offered_rps), fmt(goodput), f"{goodput / capacity:.2f}×",
                          fmt(st.latency.p50_ms if st.latency else None), fmt(p99),
                          _refused_share(st), _late_share(st), _answers(st),
                          fmt(cpu / st.duration_s, 2) if st.duration_s else "-",
                          fmt(per_refusal) if per_refusal is not None and load > 1 else "-",
                          fmt(st.send_lag.p99_ms if st.send_lag else None),
                          *_forward_figures(st, probed)])
        if load >= 2:
            checks.append([f"{load:g}×: admitted p99 (from scheduled send)", f"≤ {TARGET_MS:g} ms",
                           fmt(p99), _met(p99 is not None and p99 <= TARGET_MS)])
            checks.append([f"{load:g}×: goodput ÷ capacity", "≥ 0.9×", f"{goodput / capacity:.2f}×",
                           _met(goodput >= 0.9 * capacity)])
    return (
        "Coalesce with its defaults (`--target-latency-ms 500`), then Infinity with its defaults "
        "(`infinity_emb v2 --device cpu --no-bettertransformer`), each started fresh, on the packaged "
        f"all-MiniLM-L6-v2. Capacity (closed loop, 64 clients, mix `short`): **{capacity:.1f} req/s**.\n\n"
        + markdown_table(["figure", "target", "measured", ""], checks)
        + "\n\nRAG ingestion burst (`python -m coalesce.loadtests.burst URL --chunks 1000`: the `openai` "
        "client, default retries, one call per chunk under `asyncio.gather`, in a process of its own):\n\n"
        + markdown_table(["server", "failed", "wall s", "429s sent", "failures"], burst_rows)
        + f"\n\nMixed burst at idle ({IDLE_BURST} concurrent one-text requests of 1 to 200 words, no "
        "retries), answers by status:\n\n"
        + markdown_table(["server", "answers"], idle_rows)
        + "\n\nOpen loop (Poisson, mix `short`, the capacity probe and every step driven by the raw client, "
        "`coalesce loadtest --client raw`; latency of admitted requests from their scheduled send "
        "time; event-loop CPU: the server's main thread, which reads, checks and answers every request; "
        "per refusal: its CPU beyond what the admitted requests cost it at "
        + (f"{basis:g}×" if basis is not None else "a step that refused none")
        + " (the busiest step below 2× that refused none), over the refusals; "
        "late: the server's refusals (`coalesce_rejected_total`) that were admitted, decoded and tokenised "
        "first, then dropped at dequeue; model busy: the server's forward seconds over the step's (with "
        "forwards side by side, all of theirs: up to their number); forward "
        "tokens/s: padded tokens over forward seconds, ÷ the capacity probe's — with the model busy "
        "throughout, goodput below capacity is forwards that ran slower per token, on cores shared with "
        "the event loop and the generator, or more padding):\n\n"
        + markdown_table(["load", "offered/s", "goodput/s", "÷ capacity", "p50 ms", "p99 ms", "refused",
                          "late (of the server's refusals)", "answers", "event-loop CPU s/s",
                          "event-loop CPU µs per refusal", "generator lag p99 ms", "model busy",
                          "forward tokens/s ÷ the probe's"], step_rows)
        + "\n\nThe slowest admitted requests taken apart (those at or past each step's p99, means): their "
        "wait for a batch and their batch's forward as the server's `x-queue-time` and `x-inference-time` "
        "say, beside the mean forward of every admitted request, and the rest of their latency (outside: "
        "the send, the time before the server stamped the head, tokenising, the answer's way back):\n\n"
        + markdown_table(["load", "requests", "latency ms", "queue ms", "forward ms",
                          "forward ms, all admitted", "outside ms"], tail_rows)
        + "\n"
    )


def _forward_figures(st: StepResult, probed: StepResult) -> list[str]:
    """The step's model busy share (forward seconds over the step's) and its forward's padded tokens/s ÷
    the capacity probe's, from the server's metrics ("-" where they are missing)."""
    b, p = st.batch, probed.batch
    if b is None or b.mean_forward_ms is None or not st.duration_s:
        return ["-", "-"]
    busy = b.batches * b.mean_forward_ms / 1e3 / st.duration_s
    ratio = (b.forward_tokens_per_s / p.forward_tokens_per_s
             if p is not None and b.forward_tokens_per_s and p.forward_tokens_per_s else None)
    return [f"{busy:.2f}", f"{ratio:.2f}×" if ratio is not None else "-"]


def _refused_share(st: StepResult) -> str:
    """The step's requests answered other than 200, as a share of them ("-" if none were sent)."""
    return f"{(st.requests - st.ok) / st.requests:.1%}" if st.requests else "-"


def _answers(st: StepResult) -> str:
    """The step's answers other than 200, by status ("-" if none)."""
    return ", ".join(f"{k}×{v}" for k, v in st.by_status.items() if k != "200") or "-"


def _late_share(st: StepResult) -> str:
    """The server's ``late`` refusals and their share of all it refused in the step ("-" if none)."""
    rejected = st.batch.server_rejected if st.batch is not None else {}
    refusals = sum(rejected.values())
    late = rejected.get("late", 0)
    return f"{late} ({late / refusals:.0%})" if refusals else "-"


def _kinds(counts: object) -> str:
    return ", ".join(f"{k}×{v}" for k, v in counts.items()) or "-" if isinstance(counts, dict) else "-"


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"
