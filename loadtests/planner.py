"""Capacity planning from a measured latency-versus-load curve: pure arithmetic on result figures.

Given the steps of a load test (offered rate, p99, errors), a p99 target, a target request rate and a
price per replica-hour, :func:`plan` says how much one replica sustains, how many replicas the target
needs, what that costs, and which knob values fit the measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
from coalesce.loadtests.results import StepResult

# A step "keeps up" when the server answered at least this share of the offered rate.
KEEP_UP = 0.9


def holds(step: StepResult, p99_ms: float, max_error_rate: float) -> bool:
    """Whether a step met the service level: p99 within target, few errors, and the server kept up."""
    if step.latency is None or step.latency.p99_ms > p99_ms or step.error_rate > max_error_rate:
        return False
    return step.offered_rps is None or step.achieved_rps >= KEEP_UP * step.offered_rps


def _load(step: StepResult) -> float:
    """The load a step put on the server: the offered rate (open loop) or the achieved one (closed)."""
    return step.offered_rps if step.offered_rps is not None else step.achieved_rps


def sustained_step(steps: Sequence[StepResult], p99_ms: float, max_error_rate: float) -> StepResult | None:
    """The highest-load step that held the service level below the lowest load that broke it.

    Conservative on purpose: a step that passed above a failed one is treated as noise, not capacity.
    """
    ordered = sorted(steps, key=_load)
    best = None
    for step in ordered:
        if not holds(step, p99_ms, max_error_rate):
            break
        best = step
    return best


class Knobs(msgspec.Struct):
    """Settings that follow from the measurement."""

    max_batch_tokens: int | None  # largest batch whose forward pass fits in half the p99 target
    concurrency_target: int  # Knative autoscaling.knative.dev/target: mean in-flight per replica
    concurrency_limit: int  # containerConcurrency / Cloud Run --concurrency: in-flight at the p99
    note: str


class Plan(msgspec.Struct):
    """What the planner concludes."""

    p99_target_ms: float
    target_rps: float
    cost_per_hour: float
    utilization: float
    sustained_rps: float | None  # per replica, within the target
    sustained_p99_ms: float | None
    inputs_per_request: float | None
    planned_rps_per_replica: float | None  # sustained x utilization
    replicas: int | None
    cost_per_hour_total: float | None
    cost_per_1k_requests: float | None
    cost_per_1m_embeddings: float | None
    knobs: Knobs | None
    reason: str  # why no plan, or the basis of the plan


def _pow2_floor(x: float) -> int:
    return 1 << max(0, math.floor(math.log2(max(1.0, x))))


def knobs(step: StepResult, p99_ms: float, planned_rps: float) -> Knobs:
    """Knob values from the sustained step.

    * Max batch tokens: a request may wait for the batch in flight and then ride in the next one, so
      one forward pass should take at most half the p99 budget. The server's measured forward speed
      (padded tokens per second of forward time) turns that time into tokens, rounded down to a power
      of two.
    * Concurrency: Little's law. At ``planned_rps`` per replica and the measured mean latency, the
      mean number in flight is ``rps × mean``; that is the autoscaler's target. The hard limit is the
      number in flight when every request takes the p99 target.
    """
    mean_s = (step.latency.mean_ms if step.latency else p99_ms) / 1000.0
    target = max(1, math.ceil(planned_rps * mean_s))
    limit = max(target, math.ceil(_load(step) * p99_ms / 1000.0))
    speed = step.batch.forward_tokens_per_s if step.batch else None
    if speed:
        tokens: int | None = _pow2_floor(speed * p99_ms / 2000.0)
        note = f"forward speed {speed:,.0f} padded tokens/s measured at {_load(step):.1f} req/s"
    else:
        tokens = None
        note = "max batch tokens needs the server's coalesce_forward_seconds and coalesce_batch_tokens"
    return Knobs(max_batch_tokens=tokens, concurrency_target=target, concurrency_limit=limit, note=note)


def plan(
    steps: Sequence[StepResult],
    p99_ms: float,
    target_rps: float,
    cost_per_hour: float,
    utilization: float = 0.8,
    max_error_rate: float = 0.01,
) -> Plan:
    """Replicas and cost for ``target_rps`` at a p99 of ``p99_ms``, each replica run at ``utilization``
    of the highest rate it sustained (headroom for bursts and for the autoscaler's reaction time)."""
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be in (0, 1]")
    base = {
        "p99_target_ms": p99_ms,
        "target_rps": target_rps,
        "cost_per_hour": cost_per_hour,
        "utilization": utilization,
    }
    step = sustained_step(steps, p99_ms, max_error_rate)
    if step is None:
        lowest = min((_load(s) for s in steps), default=None)
        why = "no measured step" if lowest is None else f"even the lowest load ({lowest:.1f} req/s) missed it"
        return Plan(
            **base,
            sustained_rps=None,
            sustained_p99_ms=None,
            inputs_per_request=None,
            planned_rps_per_replica=None,
            replicas=None,
            cost_per_hour_total=None,
            cost_per_1k_requests=None,
            cost_per_1m_embeddings=None,
            knobs=None,
            reason=f"no step met p99 <= {p99_ms:g} ms: {why}",
        )
    sustained = _load(step)
    per_replica = sustained * utilization
    replicas = max(1, math.ceil(target_rps / per_replica - 1e-9))
    total = replicas * cost_per_hour
    inputs = step.mean_inputs_per_request or 1.0
    return Plan(
        **base,
        sustained_rps=sustained,
        sustained_p99_ms=step.latency.p99_ms if step.latency else None,
        inputs_per_request=inputs,
        planned_rps_per_replica=per_replica,
        replicas=replicas,
        cost_per_hour_total=total,
        cost_per_1k_requests=total / (target_rps * 3600.0) * 1_000 if target_rps > 0 else None,
        cost_per_1m_embeddings=total / (target_rps * inputs * 3600.0) * 1_000_000 if target_rps > 0 else None,
        knobs=knobs(step, p99_ms, min(per_replica, target_rps)),
        reason=f"step '{step.label}' held p99 {step.latency.p99_ms if step.latency else 0:.1f} ms "
        f"at {sustained:.1f} req/s"
        + (
            "; a lower bound: no measured load broke the target"
            if sustained >= max(map(_load, steps))
            else ""
        ),
    )


def render(p: Plan) -> str:
    """The plan as a few lines for a terminal."""
    lines = [
        f"Target: {p.target_rps:g} req/s at p99 <= {p.p99_target_ms:g} ms, "
        f"${p.cost_per_hour:g} per replica-hour"
    ]
    if p.sustained_rps is None or p.replicas is None:
        return "\n".join([*lines, f"No plan: {p.reason}."])
    assert p.planned_rps_per_replica is not None and p.cost_per_hour_total is not None
    lines += [
        f"One replica sustains {p.sustained_rps:.1f} req/s within the target ({p.reason}).",
        f"Planned at {p.utilization:.0%} of that: {p.planned_rps_per_replica:.1f} req/s per replica.",
        f"Replicas needed: {p.replicas}  (${p.cost_per_hour_total:.2f}/hour)",
    ]
    if p.cost_per_1k_requests is not None and p.cost_per_1m_embeddings is not None:
        lines.append(
            f"Cost at the target rate: ${p.cost_per_1k_requests:.4f} per 1k requests, "
            f"${p.cost_per_1m_embeddings:.4f} per 1M embeddings ({p.inputs_per_request:.2f} inputs/request)"
        )
    if p.knobs:
        k = p.knobs
        tokens = str(k.max_batch_tokens) if k.max_batch_tokens else "n/a"
        lines += [
            "Knobs:",
            f"  --max-batch-tokens {tokens}   ({k.note})",
            f'  autoscaling.knative.dev/target: "{k.concurrency_target}"   (mean in flight per replica)',
            f"  containerConcurrency / Cloud Run --concurrency: {k.concurrency_limit}"
            "   (in flight at the p99)",
        ]
    return "\n".join(lines)
