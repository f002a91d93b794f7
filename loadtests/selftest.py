"""The generator's own ceiling: how many requests per second it issues and completes against a stub
server that answers at once, so that a figure measured against a real server can be checked against it.

The stub runs in its own process (``python -m coalesce.loadtests.stub``), so on a machine with two or
more cores the generator has a core to itself, as it should when it measures a server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import msgspec
from coalesce.loadtests import servers
from coalesce.loadtests.scenario import LAG_LIMIT_MS, Mode, Runner, Scenario, Target

# An open-loop rate "holds" when at least this share of it was achieved with little dispatch lag.
HOLD = 0.95


class Ceiling(msgspec.Struct):
    closed_rps: float  # closed loop, ``concurrency`` clients, against an instant stub
    concurrency: int
    closed_cpu: float  # generator CPU (cores) during the closed-loop run
    open_rps: float | None  # highest open-loop rate held (achieved >= 95%, dispatch lag p99 <= 5 ms)
    open_lag_p99_ms: float | None
    tried: list[tuple[float, float, float]]  # (offered, achieved, lag p99 ms) of each open-loop step
    closed_status: dict[str, int] = {}  # the closed-loop run's answers by status ("200", "connection", ...)


def stub_spec() -> servers.ServerSpec:
    argv = [sys.executable, "-m", "coalesce.loadtests.stub", "--port", "{port}"]
    return servers.ServerSpec(name="stub", argv=argv)


async def _measure(url: str, duration: float, concurrency: int) -> Ceiling:
    target = Target(url=url, model="stub-model", metrics_url=None)
    warmup = min(1.0, duration)
    closed = await Runner(
        target, Scenario(mode=Mode.CLOSED, concurrency=concurrency, duration=duration, warmup=warmup)
    ).run("closed")
    closed_rps = closed.steps[0].achieved_rps
    tried: list[tuple[float, float, float]] = []
    best: tuple[float, float] | None = None
    for frac in (0.25, 0.5, 0.75, 1.0):
        rate = round(closed_rps * frac)
        res = await Runner(
            target, Scenario(mode=Mode.OPEN, rate=rate, duration=duration, warmup=warmup)
        ).run()
        st = res.steps[0]
        lag = st.send_lag.p99_ms if st.send_lag else 0.0
        tried.append((float(rate), st.achieved_rps, lag))
        if st.achieved_rps < HOLD * rate or lag > LAG_LIMIT_MS:
            break
        best = (float(rate), lag)
    return Ceiling(
        closed_rps=closed_rps,
        concurrency=concurrency,
        closed_cpu=closed.generator.cpu_util,
        open_rps=best[0] if best else None,
        open_lag_p99_ms=best[1] if best else None,
        tried=tried,
        closed_status=dict(closed.steps[0].by_status),
    )


def measure_ceiling(duration: float = 5.0, concurrency: int = 64, log_dir: Path | None = None) -> Ceiling:
    """Start the stub, measure, stop it."""
    from coalesce.loadtests.cli import run_async

    with tempfile.TemporaryDirectory() as tmp, servers.running(stub_spec(), log_dir or Path(tmp), 30) as srv:
        return run_async(_measure(srv.url, duration, concurrency))


def render(c: Ceiling) -> str:
    lines = [
        f"Closed loop, {c.concurrency} clients: {c.closed_rps:,.0f} requests/s completed "
        f"(generator CPU {c.closed_cpu:.0%} of a core).",
    ]
    if c.open_rps is not None:
        lines.append(
            f"Open loop: holds {c.open_rps:,.0f} requests/s (dispatch lag p99 {c.open_lag_p99_ms:.1f} ms)."
        )
    else:
        lines.append("Open loop: did not hold even a quarter of the closed-loop rate.")
    lines += [f"  offered {o:,.0f}/s -> achieved {a:,.0f}/s, lag p99 {lg:.1f} ms" for o, a, lg in c.tried]
    return "\n".join(lines)


def selftest_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="coalesce loadtest selftest", description=__doc__)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per step")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    ceiling = measure_ceiling(args.duration, args.concurrency)
    print(msgspec.json.encode(ceiling).decode() if args.json else render(ceiling))
    return 0
