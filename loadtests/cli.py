"""Command lines: ``coalesce loadtest [compare|selftest] ...`` and ``coalesce plan ...``.

The ``coalesce`` console script hands the arguments after the subcommand word to
:func:`loadtest_main` and :func:`plan_main`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from coalesce.loadtests import planner
from coalesce.loadtests.progress import Progress
from coalesce.loadtests.report import markdown_report, terminal_summary
from coalesce.loadtests.results import RunResult, load, save
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target
from coalesce.loadtests.workload import Mix

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh uvloop event loop (asyncio's own where uvloop is missing)."""
    factory: Callable[[], asyncio.AbstractEventLoop]
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def default_out() -> Path:
    return Path("bench-out") / ("loadtest-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S"))


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        rates = ()
    if not rates or any(r < 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative rates, got {text!r}")
    return rates


def add_scenario_args(p: argparse.ArgumentParser) -> None:
    """Options that define the offered load; shared by loadtest, compare and plan's calibration."""
    d = Scenario()
    g = p.add_argument_group("load")
    g.add_argument(
        "--mode",
        type=Mode,
        choices=list(Mode),
        default=Mode.OPEN,
        help="open: Poisson arrivals at --rate (latency from scheduled send time); closed: "
        "--concurrency clients back to back (hides queueing, like wrk/hey); burst: --rate for "
        "--burst-on s then --burst-base-rate for --burst-off s; ramp: open-loop steps up from "
        "--rate until --p99-ms breaks; replay: a recorded --trace; alternate: Poisson at each of "
        "--rates in turn for --step-duration s, for --duration s, one result per phase (soaks)",
    )
    g.add_argument("--rate", type=float, default=d.rate, help="requests/s (open, burst on-rate, ramp start)")
    g.add_argument("--concurrency", type=int, default=d.concurrency, help="clients in closed loop")
    g.add_argument("--duration", type=float, default=d.duration, help="measured seconds (after --warmup)")
    g.add_argument(
        "--warmup",
        type=float,
        default=d.warmup,
        help="seconds of load before measuring (excluded from figures)",
    )
    g.add_argument("--burst-on", type=float, default=d.burst_on)
    g.add_argument("--burst-off", type=float, default=d.burst_off)
    g.add_argument(
        "--burst-base-rate", type=float, default=d.burst_base_rate, help="requests/s between bursts"
    )
    g.add_argument("--ramp-step", type=float, default=None, help="rate added per ramp step (default: --rate)")
    g.add_argument("--max-rate", type=float, default=d.max_rate, help="highest ramp rate")
    g.add_argument(
        "--step-duration", type=float, default=d.step_duration,
        help="measured seconds per ramp step or alternate phase",
    )
    g.add_argument(
        "--rates", type=_rates, default=d.rates, help="alternate: comma-separated requests/s, e.g. 20,80"
    )
    g.add_argument("--p99-ms", type=float, default=None, help="p99 target: stops a ramp, marks the SLO")
    g.add_argument(
        "--max-error-rate",
        type=float,
        default=d.max_error_rate,
        help="share of failed requests a step may have and still meet the target",
    )
    g.add_argument(
        "--trace", default=None, help='JSONL trace for replay: {"t": s, "inputs": n, "lengths": [words]}'
    )
    g.add_argument("--speed", type=float, default=d.speed, help="replay speed-up factor")
    g = p.add_argument_group("inputs")
    g.add_argument(
        "--mix",
        type=Mix,
        choices=list(Mix),
        default=d.mix,
        help="short: 6-16 word queries; long: 150-250 word passages; mixed: log-normal lengths; "
        "multi: mixed lengths, 16 inputs per request",
    )
    g.add_argument(
        "--inputs-per-request", type=int, default=None, help="override the mix's inputs per request"
    )
    g.add_argument(
        "--text-file", default=None, help="corpus: its lines are sent as inputs instead of generated words"
    )
    g.add_argument("--encoding-format", choices=("base64", "float"), default=d.encoding_format)
    g.add_argument(
        "--repeat", type=float, default=d.repeat,
        help="share of requests (0..1) that resend an earlier request's body: what a result cache "
        "answers (default 0: every request fresh)",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("client")
    g.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds before a request counts as timed out"
    )
    g.add_argument(
        "--max-inflight",
        type=int,
        default=d.max_inflight,
        help="open-loop connection cap; requests past it wait, and the wait counts as latency",
    )
    g.add_argument(
        "--client", choices=("aiohttp", "raw"), default=d.client,
        help="HTTP client: aiohttp (default), or raw, a lean keep-alive client costing a fraction of the "
        "CPU per request (use it when the generator shares the server's cores)",
    )
    g.add_argument(
        "--cost-per-hour", type=float, default=None, help="price of one replica-hour, for cost figures"
    )


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    fields = {f: getattr(args, f) for f in Scenario.__struct_fields__ if hasattr(args, f)}
    scenario = Scenario(**fields)
    if scenario.mode is Mode.REPLAY and not scenario.trace:
        raise SystemExit("error: --mode replay needs --trace FILE")
    if scenario.mode is Mode.ALTERNATE and not scenario.rates:
        raise SystemExit("error: --mode alternate needs --rates R1,R2,...")
    if scenario.mode is Mode.RAMP and scenario.p99_ms is None:
        raise SystemExit("error: --mode ramp needs --p99-ms (the target that ends the ramp)")
    return scenario


def plotting_available() -> bool:
    """Whether matplotlib (the ``loadtest`` extra) is installed; says so once on stderr when not."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print("note: no plots (matplotlib is not installed: pip install 'coalesce[loadtest]')", file=sys.stderr)
    return False


def write_outputs(result: RunResult, out: Path, plots: bool = True) -> list[Path]:
    """result.json, report.md and the plots, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    save(result, out / "result.json")
    pngs: list[Path] = []
    if plots and plotting_available():
        from coalesce.loadtests.plots import write_plots

        pngs = write_plots(result, out)
    (out / "report.md").write_text(markdown_report(result, pngs), encoding="utf-8")
    return [out / "result.json", out / "report.md", *pngs]


def _loadtest_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coalesce loadtest",
        description="Load-test an OpenAI-compatible embeddings URL. Subcommands: 'compare' (start the "
        "service under several configurations, same scenario, one table) and 'selftest' (the "
        "generator's own ceiling).",
    )
    p.add_argument("--url", required=True, help="embeddings URL, e.g. http://127.0.0.1:8080/v1/embeddings")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--metrics-url", default="", help="Prometheus endpoint (default: /metrics of --url)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape server metrics")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: bench-out/loadtest-TIME)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--selftest",
        action="store_true",
        help="first measure the generator's own ceiling on this machine and add it to the report",
    )
    p.add_argument(
        "--save-trace",
        type=Path,
        default=None,
        help="also write the offered schedule as a replayable JSONL trace",
    )
    add_scenario_args(p)
    return p


def loadtest_main(argv: list[str]) -> int:
    """``coalesce loadtest ...``; returns the exit status."""
    if argv[:1] == ["compare"]:
        from coalesce.loadtests.compare import compare_main

        return compare_main(argv[1:])
    if argv[:1] == ["selftest"]:
        from coalesce.loadtests.selftest import selftest_main

        return selftest_main(argv[1:])
    args = _loadtest_parser().parse_args(argv)
    scenario = scenario_from_args(args)
    target = Target(url=args.url, model=args.model, metrics_url=None if args.no_metrics else args.metrics_url)
    progress = Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    ceiling = None
    if args.selftest:
        from coalesce.loadtests.selftest import measure_ceiling

        ceiling = measure_ceiling(duration=2.0)
    runner = Runner(target, scenario, progress)
    try:
        result = run_async(runner.run())
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if ceiling is not None:
        result.generator.ceiling_closed_rps = ceiling.closed_rps
        result.generator.ceiling_open_rps = ceiling.open_rps
    if args.save_trace is not None:
        runner.save_trace(args.save_trace)
    print(terminal_summary(result))
    out = args.out or default_out()
    files = write_outputs(result, out, plots=not args.no_plots)
    print("Wrote " + ", ".join(str(f) for f in files))
    return 0


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coalesce plan",
        description="Capacity plan from a load-test curve: the highest rate one replica sustains within a "
        "p99 target, replicas for a target rate, cost, and knob values. Give a saved --result "
        "(best: a ramp) or a --url to calibrate against now.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--result", type=Path, help="result.json of a coalesce loadtest run")
    src.add_argument("--url", help="embeddings URL to calibrate against (a short probe and ramp)")
    p.add_argument("--p99-ms", type=float, required=True, help="p99 latency target")
    p.add_argument("--rate", type=float, required=True, help="target requests/s across all replicas")
    p.add_argument("--cost-per-hour", type=float, required=True, help="price of one replica-hour")
    p.add_argument(
        "--utilization",
        type=float,
        default=0.8,
        help="share of a replica's sustained rate to plan for (headroom for bursts, scaling lag)",
    )
    p.add_argument("--max-error-rate", type=float, default=0.01)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    g = p.add_argument_group("calibration (with --url)")
    g.add_argument("--model", default=None)
    g.add_argument("--mix", type=Mix, choices=list(Mix), default=Mix.SHORT)
    g.add_argument("--inputs-per-request", type=int, default=None)
    g.add_argument("--step-duration", type=float, default=5.0)
    g.add_argument("--out", type=Path, default=None, help="where to save the calibration run")
    return p


def plan_main(argv: list[str]) -> int:
    """``coalesce plan ...``; returns the exit status."""
    args = _plan_parser().parse_args(argv)
    if args.result is not None:
        result = load(args.result)
    else:
        from coalesce.loadtests.calibrate import calibrate

        result = run_async(
            calibrate(
                Target(url=args.url, model=args.model),
                args.p99_ms,
                args.mix,
                args.inputs_per_request,
                args.step_duration,
                args.max_error_rate,
            )
        )
        out = args.out or default_out()
        write_outputs(result, out)
        print(f"Calibration run saved in {out}", file=sys.stderr)
    p = planner.plan(
        result.steps, args.p99_ms, args.rate, args.cost_per_hour, args.utilization, args.max_error_rate
    )
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(p)).decode() + "\n")
    else:
        print(planner.render(p))
    return 0 if p.replicas is not None else 1
