"""``coalesce loadtest compare``: one scenario against several servers, one after another, one table.

Each ``--config NAME=ARGS`` starts ``coalesce serve ARGS`` on a free loopback port, runs the scenario,
and stops it before the next starts, so the configurations never share the CPU. ``--peer NAME=URL``
adds a server that is already running (Infinity, TEI, another Coalesce). Ratios are against the first.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
from coalesce.loadtests import servers
from coalesce.loadtests.cli import (
    add_scenario_args,
    default_out,
    plotting_available,
    run_async,
    scenario_from_args,
    write_outputs,
)
from coalesce.loadtests.progress import Progress
from coalesce.loadtests.report import COMPARE_HEADERS, comparison_rows, markdown_table, text_table
from coalesce.loadtests.results import RunResult
from coalesce.loadtests.scenario import Runner, Scenario, Target

DEFAULT_CONFIGS = (
    "none=--batching none",
    "fixed=--batching fixed --max-wait-ms 5 --max-batch-size 32",
    "adaptive=--batching adaptive",
)


@dataclass(frozen=True)
class Contender:
    """A server in the comparison: started from ``spec``, or already listening at ``url``."""

    name: str
    spec: servers.ServerSpec | None = None
    url: str | None = None


Outcome = tuple[str, RunResult | None, str]  # name, result (None if it could not run), note


def _split(text: str, what: str) -> tuple[str, str]:
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"error: {what} must look like NAME=VALUE, got {text!r}")
    return name.strip(), rest.strip()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def run_one(
    c: Contender,
    scenario: Scenario,
    log_dir: Path,
    model: str | None,
    progress: Progress,
    ready_timeout_s: float = 300.0,
) -> Outcome:
    """Run ``scenario`` against one contender, starting and stopping it if it has a spec."""
    if c.spec is None:
        assert c.url is not None
        return c.name, run_async(Runner(Target(c.url, model), scenario, progress).run(c.name)), ""
    try:
        with servers.running(c.spec, log_dir, ready_timeout_s) as srv:
            result = run_async(Runner(Target(srv.url, model), scenario, progress).run(c.name))
    except servers.ServerUnsupported as exc:
        return c.name, None, f"not supported by this server: {_last_line(str(exc))}"
    except servers.ServerError as exc:
        return c.name, None, f"did not start: {_last_line(str(exc))}"
    return c.name, result, ""


def run_all(
    contenders: Sequence[Contender],
    scenario: Scenario,
    log_dir: Path,
    model: str | None = None,
    progress: Progress | None = None,
    ready_timeout_s: float = 300.0,
) -> list[Outcome]:
    progress = progress or Progress(enabled=False)
    return [run_one(c, scenario, log_dir, model, progress, ready_timeout_s) for c in contenders]


def comparison_markdown(outcomes: Sequence[Outcome]) -> str:
    return markdown_table(COMPARE_HEADERS, comparison_rows(outcomes))


def write_compare(outcomes: Sequence[Outcome], out: Path, plots: bool = True) -> list[Path]:
    """compare.json, compare.md, plots, and each contender's own report in a sub-folder."""
    out.mkdir(parents=True, exist_ok=True)
    blob = {name: (msgspec.to_builtins(r) if r is not None else {"note": note}) for name, r, note in outcomes}
    (out / "compare.json").write_bytes(msgspec.json.format(msgspec.json.encode(blob), indent=2) + b"\n")
    pngs: list[Path] = []
    ran = [(name, r) for name, r, _ in outcomes if r is not None]
    plots = plots and bool(ran) and plotting_available()
    if plots:
        from coalesce.loadtests.plots import write_compare_plots

        pngs = write_compare_plots(ran, out)
    for name, r in ran:
        write_outputs(r, out / name, plots=plots)
    md = ["# Comparison", "", comparison_markdown(outcomes), "", *(f"![{p.stem}]({p.name})" for p in pngs)]
    (out / "compare.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    return [out / "compare.json", out / "compare.md", *pngs]


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="coalesce loadtest compare", description=__doc__)
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="a `coalesce serve` configuration, e.g. 'adaptive=--batching adaptive "
        "--target-latency-ms 200' (repeatable; default: none, fixed and adaptive)",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an already running server's embeddings URL (repeatable)",
    )
    p.add_argument(
        "--serve-cmd", default=None, help="command that starts Coalesce (default: this env's coalesce)"
    )
    p.add_argument("--model", default=None, help="model name to send (default: each server's first model)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for a server's /ready")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    add_scenario_args(p)
    args = p.parse_args(argv)
    scenario = scenario_from_args(args)
    command = shlex.split(args.serve_cmd) if args.serve_cmd else None
    configs = args.config or ([] if args.peer else list(DEFAULT_CONFIGS))
    contenders = [
        Contender(name, spec=servers.coalesce_spec(name, shlex.split(rest), command))
        for name, rest in (_split(c, "--config") for c in configs)
    ] + [Contender(name, url=url) for name, url in (_split(c, "--peer") for c in args.peer)]
    out = args.out or default_out()
    progress = Progress(sys.stderr.isatty() if args.progress is None else args.progress)
    outcomes = run_all(contenders, scenario, out / "logs", args.model, progress, args.ready_timeout)
    print(text_table(COMPARE_HEADERS, comparison_rows(outcomes)))
    files = write_compare(outcomes, out, plots=not args.no_plots)
    print("Wrote " + ", ".join(str(f) for f in files))
    return 0 if any(r is not None for _, r, _ in outcomes) else 1
