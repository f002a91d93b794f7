"""A busy neighbour: what one core kept busy by another program does to a CPU forward on every core.

    python -m coalesce.loadtests.neighbour [--baseline-site DIR] [--rounds 2] [--lone 30] [--out DIR]
                                           [--servers "NAME;NAME"]

Each server below is started fresh with one core kept busy by a process that spins (the neighbour,
started before the server, so it is there through its start as a neighbour on a shared host is), and
again with every core free:

* ``--workers 2`` and one process with ``--cpu-forwards 1``, whose forward runs on every core (one at a
  time), and one process as it ships (on two cores, two forwards side by side, one core each), the
  control: its forwards wait for no other thread;
* lone requests: ``--lone`` one-sentence requests one at a time, 0.3 s apart, once the server is ready
  (client latency: median, 90th percentile, the slowest);
* the overload section's mixed burst at idle right after (120 concurrent requests of 1 to 200 words, no
  retries): the refusals, which should be none;
* a closed loop of 32 clients (the raw client, short sentences, 2 s warm-up then 6 s): requests/s.

With ``--baseline-site DIR`` (``loadtests/baseline_site.sh`` builds a revision there) each server also
runs from that code, first on ``PYTHONPATH``, alternated with this checkout's in every round (the order
reversed every other round). Prints one markdown table: each figure's median over the rounds. The
packaged model; the machine's cores as they are (the neighbour takes one of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coalesce.loadtests import servers
from coalesce.loadtests.bench_overload import _idle_burst
from coalesce.loadtests.bench_sections import _run, interleaved
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix

SERVERS = {
    "--workers 2": ["--workers", "2"],
    "one process, --cpu-forwards 1": ["--cpu-forwards", "1"],
    "one process (control)": [],
}
GAP_S = 0.3
CLOSED = Scenario(mode=Mode.CLOSED, concurrency=32, duration=6.0, warmup=2.0, mix=Mix.SHORT, client="raw")


def spin() -> subprocess.Popen[bytes]:
    """The neighbour: a process that keeps one core busy until it is stopped."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def lone(url: str, n: int, gap_s: float = GAP_S) -> list[float]:
    """``n`` one-sentence requests one at a time, ``gap_s`` apart: each one's latency, ms."""
    out = []
    for i in range(n):
        body = json.dumps({"model": "all-MiniLM-L6-v2", "input": f"a short question, number {i}, on things"})
        request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(gap_s)
    return out


def measure(name: str, flags: Sequence[str], env: dict[str, str], busy: bool, lone_n: int,
            out: Path) -> dict[str, Any]:
    """One fresh server of ``flags`` (with ``env``), a neighbour spinning throughout when ``busy``."""
    neighbour = spin() if busy else None
    try:
        spec = servers.coalesce_spec(name, ["--log-level", "warning", *flags])
        spec = servers.ServerSpec(spec.name, spec.argv, env={**spec.env, **env})
        with servers.running(spec, out / "logs", 300.0) as srv:
            times = lone(srv.url, lone_n)
            burst = asyncio.run(_idle_burst(srv.url))
            closed = _run(srv.url, CLOSED, f"{name} {'busy' if busy else 'free'}", out)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    ordered = sorted(times)
    return {"lone_p50_ms": statistics.median(times), "lone_p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
            "lone_max_ms": ordered[-1], "burst_refused": sum(v for k, v in burst.items() if k != "200"),
            "closed_rps": closed.achieved_rps}


def report(results: dict[tuple[str, str, str], list[dict[str, Any]]], codes: Sequence[str]) -> str:
    """The table: a row per neighbour, server and code, each figure the median over its rounds; then,
    beside a baseline, this code's ÷ the baseline's lone median and closed-loop rate."""
    rows = []
    for (busy, name, code), runs in results.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median(r[key] for r in runs))

        rows.append([busy, name, code, fmt(med("lone_p50_ms"), 1), fmt(med("lone_p90_ms"), 1),
                     fmt(med("lone_max_ms"), 1), "/".join(str(r["burst_refused"]) for r in runs),
                     fmt(med("closed_rps"), 1)])
    table = markdown_table(["neighbour", "server", "code", "lone p50 ms", "lone p90 ms", "lone slowest ms",
                            "burst refused (each round)", "32 clients req/s"], rows)
    if len(codes) < 2:
        return table
    ratios = []
    for (busy, name, code), runs in results.items():
        if code != codes[0]:
            continue
        base = results[(busy, name, codes[1])]

        def ratio(key: str, runs: list[dict[str, Any]] = runs, base: list[dict[str, Any]] = base) -> str:
            return f"{statistics.median(r[key] for r in runs) / statistics.median(r[key] for r in base):.2f}×"

        ratios.append([busy, name, ratio("lone_p50_ms"), ratio("closed_rps")])
    over = f"{codes[0]} ÷ {codes[1]}"
    heads = ["neighbour", "server", f"lone p50, {over}", f"req/s, {over}"]
    return table + "\n\n" + markdown_table(heads, ratios)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.neighbour", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-site", type=Path, help="a baseline's site directory (baseline_site.sh)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--lone", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("bench-out/neighbour"))
    p.add_argument("--servers", default=";".join(SERVERS),
                   help="which, separated by ';', of: " + "; ".join(SERVERS))
    args = p.parse_args(argv)
    codes: dict[str, dict[str, str]] = {"current": {}}
    if args.baseline_site is not None:
        path = os.environ.get("PYTHONPATH")
        codes["baseline"] = {"PYTHONPATH": f"{args.baseline_site}{':' + path if path else ''}"}
    names = [n.strip() for n in args.servers.split(";")]
    cells = [(busy, name, code) for busy in ("busy", "free") for name in names for code in codes]

    def run(cell: tuple[str, str, str], r: int) -> dict[str, Any]:
        busy, name, code = cell
        result = measure(name, SERVERS[name], codes[code], busy == "busy", args.lone, args.out / f"{code}{r}")
        print(json.dumps({"round": r, "neighbour": busy, "server": name, "code": code, **result}), flush=True)
        return result

    results = interleaved(cells, run, args.rounds)
    print(report(results, list(codes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
