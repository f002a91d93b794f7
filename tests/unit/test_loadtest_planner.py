"""The capacity planner's arithmetic on a known latency-versus-load curve."""

from __future__ import annotations

import pytest
from coalesce.loadtests import planner
from coalesce.loadtests.results import BatchStats, Latency, StepResult


def _step(
    rate: float,
    p99: float,
    mean: float | None = None,
    errors: float = 0.0,
    achieved: float | None = None,
    batch: BatchStats | None = None,
    inputs: float = 1.0,
) -> StepResult:
    lat = Latency(
        count=100,
        mean_ms=mean if mean is not None else p99 / 2,
        p50_ms=p99 / 2,
        p90_ms=p99,
        p95_ms=p99,
        p99_ms=p99,
        p999_ms=p99,
        max_ms=p99,
    )
    done = rate if achieved is None else achieved
    return StepResult(
        label=f"{rate:g}/s",
        mode="ramp",
        offered_rps=rate,
        concurrency=None,
        duration_s=10,
        requests=100,
        ok=100,
        by_status={"200": 100},
        error_rate=errors,
        achieved_rps=done,
        achieved_inputs_per_s=done * inputs,
        mean_inputs_per_request=inputs,
        latency=lat,
        send_lag=None,
        header_queue_ms=None,
        header_inference_ms=None,
        batch=batch,
    )


def _batch(tokens_per_s: float) -> BatchStats:
    return BatchStats(
        batches=10,
        inputs=100,
        mean_batch_size=10,
        size_buckets=[],
        mean_padding_ratio=0.1,
        mean_queue_ms=5,
        p50_queue_ms=4,
        p99_queue_ms=9,
        mean_forward_ms=20,
        mean_batch_tokens=500,
        forward_tokens_per_s=tokens_per_s,
        server_requests={},
    )


CURVE = [_step(10, 40), _step(20, 60), _step(30, 100, mean=50, batch=_batch(25_000)), _step(40, 400)]


def test_sustained_rate_is_the_highest_step_within_the_target() -> None:
    assert planner.sustained_step(CURVE, p99_ms=150, max_error_rate=0.01) is CURVE[2]
    assert planner.sustained_step(CURVE, p99_ms=50, max_error_rate=0.01) is CURVE[0]
    assert planner.sustained_step(CURVE, p99_ms=30, max_error_rate=0.01) is None


def test_a_pass_above_a_failure_is_not_capacity() -> None:
    noisy = [_step(10, 40), _step(20, 900), _step(30, 100)]
    assert planner.sustained_step(noisy, p99_ms=150, max_error_rate=0.01) is noisy[0]


def test_errors_or_falling_behind_break_the_target() -> None:
    assert not planner.holds(_step(10, 40, errors=0.05), 150, 0.01)
    assert not planner.holds(_step(10, 40, achieved=8.0), 150, 0.01)  # answered only 80% of the offer
    assert planner.holds(_step(10, 40, achieved=9.5), 150, 0.01)


def test_plan_arithmetic_on_the_known_curve() -> None:
    p = planner.plan(CURVE, p99_ms=150, target_rps=100, cost_per_hour=2.0, utilization=0.8)
    assert p.sustained_rps == 30 and p.sustained_p99_ms == 100
    assert "lower bound" not in p.reason
    assert p.planned_rps_per_replica == pytest.approx(24)
    assert p.replicas == 5  # ceil(100 / 24)
    assert p.cost_per_hour_total == pytest.approx(10.0)
    assert p.cost_per_1k_requests == pytest.approx(10.0 / (100 * 3600) * 1000)
    assert p.cost_per_1m_embeddings == pytest.approx(10.0 / (100 * 3600) * 1e6)
    assert p.knobs is not None
    # Half of 150 ms at 25,000 padded tokens/s is 1,875 tokens: the power of two below is 1,024.
    assert p.knobs.max_batch_tokens == 1024
    # Little's law: 24 req/s per replica x 50 ms mean = 1.2 in flight -> 2; at the p99: 30 x 0.15 = 4.5 -> 5.
    assert (p.knobs.concurrency_target, p.knobs.concurrency_limit) == (2, 5)


def test_multi_input_requests_cost_less_per_embedding() -> None:
    curve = [_step(10, 40, inputs=16.0)]
    p = planner.plan(curve, p99_ms=150, target_rps=10, cost_per_hour=3.6, utilization=1.0)
    assert p.replicas == 1
    assert p.cost_per_1m_embeddings == pytest.approx(3.6 / (10 * 16 * 3600) * 1e6)


def test_exact_fit_needs_no_extra_replica() -> None:
    p = planner.plan([_step(25, 40)], p99_ms=150, target_rps=100, cost_per_hour=1.0, utilization=1.0)
    assert p.replicas == 4
    assert "lower bound" in p.reason  # nothing broke the target: the replica may do more


def test_no_plan_when_nothing_met_the_target() -> None:
    p = planner.plan(CURVE, p99_ms=10, target_rps=100, cost_per_hour=1.0)
    assert p.replicas is None and "lowest load" in p.reason
    assert "No plan" in planner.render(p)


def test_rendered_plan_names_the_knobs() -> None:
    text = planner.render(planner.plan(CURVE, p99_ms=150, target_rps=100, cost_per_hour=2.0))
    assert "Replicas needed: 5" in text
    assert "--max-batch-tokens 1024" in text
    assert "autoscaling.knative.dev/target" in text and "containerConcurrency" in text
