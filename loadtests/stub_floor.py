"""How much of a request's CPU is aiohttp's: the stub on aiohttp beside the same stub framing HTTP itself.

    python -m coalesce.loadtests.stub_floor [--rounds 3] [--seconds 8] [--clients 16]

Four servers up at once, their runs interleaved (``--rounds`` rounds of each, the round of median CPU
shown), short one-sentence requests in a closed loop of ``--clients``: the aiohttp stub the bench's
gateway and engine sections divide by (``coalesce.loadtests.stub``), the same stub with ``--raw`` (an
``asyncio.Protocol`` that frames HTTP/1.1 itself, with the same decode, metrics and encode), and the
null-model service (``coalesce.loadtests.nullmodel``) in one process and with ``--workers 2``. CPU µs per
request from /proc. The difference between the two stubs is what aiohttp's request and response objects,
its dispatch and its writer cost a request here: the most that answering plain requests below them (the
way the connection already answers a standing queue's refusals) could take off one process or a gateway,
which the last lines set against issue 25's targets (one process ≤ 2.5×, gateways ≤ 3× the aiohttp stub).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import servers
from .bench_engine import NULL, _all_ready, cpu_per_request
from .bench_sections import interleaved, median_by
from .scenario import Mode, Scenario
from .workload import Mix


def measure(rounds: int, seconds: float, clients: int, out: Path) -> dict[str, dict[str, float]]:
    """CPU µs per request by process role (``all`` for a single process) of each server, the median
    round's, and its achieved requests/s (``rps``)."""
    specs = [
        servers.stub_spec("aiohttp stub"),
        servers.stub_spec("raw stub", "--raw"),
        servers.coalesce_spec("one process", [*NULL, "--workers", "1"]),
        servers.coalesce_spec("--workers 2", [*NULL, "--workers", "2"]),
    ]
    scenario = Scenario(mode=Mode.CLOSED, concurrency=clients, duration=seconds, warmup=1.0, mix=Mix.SHORT)
    with contextlib.ExitStack() as stack:
        up = {}
        for spec in specs:
            up[spec.name] = stack.enter_context(servers.running(spec, out / "logs", 120))
            if spec.name in ("one process", "--workers 2"):
                _all_ready(up[spec.name].base_url)
        time.sleep(1.0)  # let start-up settle

        def cost(name: str, r: int) -> tuple[dict[str, float], Any]:
            return cpu_per_request(up[name], scenario, f"{name} round {r + 1}", out)

        runs = interleaved(list(up), cost, rounds)
    figures = {}
    for name, results in runs.items():
        per, st = median_by(results, lambda run: sum(run[0].values()))
        figures[name] = {**per, "rps": st.achieved_rps}
    return figures


def report(figures: dict[str, dict[str, float]]) -> str:
    def total(name: str) -> float:
        return sum(v for role, v in figures[name].items() if role != "rps")

    stub, raw = total("aiohttp stub"), total("raw stub")
    lines = ["server          achieved/s  CPU µs/request  ÷ aiohttp stub"]
    for name in figures:
        lines.append(f"{name:<15} {figures[name]['rps']:>10,.0f}  {total(name):>14,.1f}  "
                     f"{total(name) / stub:>13.2f}×")
    gateways = figures["--workers 2"].get("gateway", 0.0)
    lines.append(f"--workers 2: engine {figures['--workers 2'].get('engine', 0.0):,.1f} µs, "
                 f"gateways {gateways:,.1f} µs a request")
    aiohttp = stub - raw
    one = total("one process")
    lines.append(f"aiohttp's part of a request: {aiohttp:,.1f} µs ({aiohttp / stub:.0%} of the stub's)")
    lines.append(f"at most, without it: one process {one - aiohttp:,.1f} µs ({(one - aiohttp) / stub:.2f}× "
                 f"the aiohttp stub; target ≤ 2.5×), gateways {gateways - aiohttp:,.1f} µs "
                 f"({(gateways - aiohttp) / stub:.2f}×; target ≤ 3×)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.stub_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each server (3)")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds a run (8)")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (16)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(report(measure(args.rounds, args.seconds, args.clients, Path(tmp))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
