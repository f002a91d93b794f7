"""A short calibration for ``coalesce plan --url``: find the saturation rate, then ramp up to it.

A closed-loop probe (32 clients) measures what the server completes when it is never idle; an open-loop
ramp from 20% to 130% of that, in 10% steps, then draws the latency-versus-load curve the planner reads.
"""

from __future__ import annotations

from coalesce.loadtests.results import RunResult
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target
from coalesce.loadtests.workload import Mix
from msgspec.structs import replace

PROBE_CLIENTS = 32


async def saturation_rps(target: Target, scenario: Scenario) -> float:
    """Closed-loop throughput at ``PROBE_CLIENTS`` clients (the server's capacity for this mix)."""
    probe = replace(scenario, mode=Mode.CLOSED, concurrency=PROBE_CLIENTS)
    result = await Runner(target, probe).run("probe")
    return result.steps[0].achieved_rps


async def calibrate(
    target: Target,
    p99_ms: float,
    mix: Mix = Mix.SHORT,
    inputs_per_request: int | None = None,
    step_duration: float = 5.0,
    max_error_rate: float = 0.01,
) -> RunResult:
    """The ramp's result; its steps are the curve to plan from."""
    base = Scenario(
        mix=mix,
        inputs_per_request=inputs_per_request,
        duration=step_duration,
        warmup=1.0,
        step_duration=step_duration,
        p99_ms=p99_ms,
        max_error_rate=max_error_rate,
    )
    capacity = await saturation_rps(target, base)
    if capacity <= 0:
        raise ValueError("the server completed no request in the calibration probe")
    step = max(0.1, round(0.1 * capacity, 1))
    ramp = replace(base, mode=Mode.RAMP, rate=2 * step, ramp_step=step, max_rate=13 * step)
    return await Runner(target, ramp).run("calibration")
