"""The scheduler on a virtual clock with a simulated runner (batch time a + b·tokens, ±5% noise)."""

from __future__ import annotations

import random

import pytest
from coalesce.service.batching.cost import CostModel
from coalesce.service.batching.policy import Limits
from coalesce.service.batching.scheduler import Dispatch, Entry, Scheduler, SchedulerConfig, Wait

from .sim import Arrival, poisson, simulate

A, B = 0.010, 0.0002  # 10 ms a batch + 0.2 ms a padded token: MiniLM-like on 2 CPU cores
TOKENS = 16
LIMITS = Limits(64, 16384)
CAPACITY = 64 / (A + B * 64 * TOKENS)  # inputs/s at the largest batch: ~298/s
TARGET = 0.5


def adaptive(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "strategy": "adaptive",
        "limits": LIMITS,
        "target_latency_s": TARGET,
        "max_queued_tokens": 1 << 20,
        "tenant_max_queued_tokens": 1 << 19,
    }
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("load", [0.5, 0.8])
def test_below_capacity_p99_stays_within_target(load: float) -> None:
    arrivals = poisson(load * CAPACITY, 30.0, random.Random(1), tokens=TOKENS)
    res = simulate(adaptive(), arrivals, A, B, seed=2, measure_from=2.0)
    assert res.completed > 0.9 * load * CAPACITY * 28
    assert res.pct(0.99) <= TARGET
    assert not res.refused


def test_low_load_has_no_batching_penalty() -> None:
    # One request every 100 ms: each runs alone, at once, in the time of a batch of one.
    arrivals = [Arrival(0.1 * i, TOKENS) for i in range(50)]
    res = simulate(adaptive(), arrivals, A, B, noise=0.0)
    assert set(res.batch_sizes) == {1}
    assert res.pct(1.0) == pytest.approx(A + B * TOKENS, rel=1e-6)


def saturated_throughput(config: SchedulerConfig, seed: int = 3) -> float:
    arrivals = poisson(2.0 * CAPACITY, 20.0, random.Random(seed), tokens=TOKENS)
    res = simulate(config, arrivals, A, B, seed=seed, horizon=20.0, measure_from=2.0)
    return res.completed / (res.end - 2.0)


def test_saturation_throughput_matches_the_best_fixed_batch_size() -> None:
    fixed = {
        size: saturated_throughput(
            SchedulerConfig("fixed", Limits(size, 16384), max_wait_s=0.005, max_queued_tokens=1 << 20)
        )
        for size in (1, 4, 16, 32, 64)
    }
    best = max(fixed.values())
    assert best > 3 * fixed[1], "batching must pay on this cost curve"
    assert saturated_throughput(adaptive()) >= 0.95 * best


def test_queued_tokens_never_exceed_the_bound_under_a_flood() -> None:
    arrivals = poisson(10 * CAPACITY, 5.0, random.Random(4), tokens=lambda r: r.randint(4, 200))
    res = simulate(adaptive(max_queued_tokens=20_000), arrivals, A, B, horizon=5.0)
    assert res.max_queued_tokens <= 20_000
    assert res.refused["queue_full"] > 0
    assert res.completed > 0


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0)])
def test_tenants_at_ten_times_different_rates_get_their_fair_share(weights: tuple[float, float]) -> None:
    rng = random.Random(5)
    heavy = poisson(6.0 * CAPACITY, 20.0, rng, tokens=TOKENS, tenant="heavy", weight=weights[0])
    light = poisson(0.6 * CAPACITY, 20.0, rng, tokens=TOKENS, tenant="light", weight=weights[1])
    arrivals = sorted(heavy + light, key=lambda x: x.time)
    res = simulate(
        adaptive(max_queued_tokens=40_000, tenant_max_queued_tokens=20_000),
        arrivals,
        A,
        B,
        horizon=20.0,
        measure_from=2.0,
    )
    total = res.served_tokens["heavy"] + res.served_tokens["light"]
    share_heavy = weights[0] / sum(weights)
    assert res.served_tokens["heavy"] / total == pytest.approx(share_heavy, rel=0.10)
    assert res.served_tokens["light"] / total == pytest.approx(1 - share_heavy, rel=0.10)


def test_a_flooding_tenant_does_not_push_a_light_one_past_target() -> None:
    rng = random.Random(6)
    flood = poisson(5.0 * CAPACITY, 20.0, rng, tokens=TOKENS, tenant="flood")
    light = poisson(0.1 * CAPACITY, 20.0, rng, tokens=TOKENS, tenant="light")
    res = simulate(
        adaptive(max_queued_tokens=40_000, tenant_max_queued_tokens=10_000),
        sorted(flood + light, key=lambda x: x.time),
        A,
        B,
        horizon=20.0,
        measure_from=2.0,
    )
    assert res.pct(0.99, res.by_tenant["light"]) <= TARGET
    assert res.refused["tenant_queue_full"] > 0  # the flood is refused, not the light tenant
    assert len(res.by_tenant["light"]) >= 0.9 * 0.1 * CAPACITY * 17


def test_priorities_go_first_and_low_never_starves() -> None:
    rng = random.Random(7)
    # Well past capacity, for 10 s: high, normal and low all arrive continuously.
    arrivals = sorted(
        poisson(0.8 * CAPACITY, 10.0, rng, tokens=TOKENS, priority=0)
        + poisson(0.8 * CAPACITY, 10.0, rng, tokens=TOKENS, priority=1)
        + poisson(0.2 * CAPACITY, 10.0, rng, tokens=TOKENS, priority=2),
        key=lambda x: x.time,
    )
    res = simulate(adaptive(priority_aging_s=1.0, max_queued_tokens=30_000), arrivals, A, B)
    high, normal, low = (res.by_priority[p] for p in (0, 1, 2))
    assert res.pct(0.5, high) < res.pct(0.5, normal)
    assert len(low) > 0.5 * 0.2 * CAPACITY * 10, "low priority keeps being served under overload"
    assert max(low) < 10.0


def test_a_tiny_weight_tenant_still_progresses() -> None:
    rng = random.Random(8)
    arrivals = sorted(
        poisson(3 * CAPACITY, 10.0, rng, tokens=TOKENS, tenant="big", weight=100.0)
        + poisson(0.05 * CAPACITY, 10.0, rng, tokens=TOKENS, tenant="small", weight=0.5),
        key=lambda x: x.time,
    )
    res = simulate(adaptive(max_queued_tokens=40_000, tenant_max_queued_tokens=20_000), arrivals, A, B)
    assert len(res.by_tenant["small"]) >= 0.9 * 0.05 * CAPACITY * 10


def test_expired_and_unmeetable_deadlines_are_never_computed() -> None:
    rng = random.Random(9)
    arrivals = poisson(3 * CAPACITY, 5.0, rng, tokens=TOKENS, timeout=0.3)
    res = simulate(adaptive(max_queued_tokens=1 << 20), arrivals, A, B, horizon=6.0)
    assert res.late_dispatches == 0
    assert res.expired + res.shed + res.refused["deadline_unmeetable"] > 0
    assert res.pct(1.0) <= 0.3 + A + B * 64 * TOKENS  # nothing completes much past its deadline


def test_none_strategy_runs_one_input_at_a_time() -> None:
    arrivals = poisson(0.5 * CAPACITY, 2.0, random.Random(10), tokens=TOKENS)
    res = simulate(SchedulerConfig("none", LIMITS), arrivals, A, B, horizon=5.0)
    assert set(res.batch_sizes) == {1}


def test_fixed_strategy_waits_for_its_window_then_dispatches() -> None:
    s = Scheduler(
        SchedulerConfig("fixed", Limits(8, 16384), max_wait_s=0.005), CostModel(), lambda n, m: n * m
    )
    s.add([Entry(16, 0.0)])
    decision, _, _ = s.next(0.001)
    assert isinstance(decision, Wait) and decision.until == pytest.approx(0.005)
    s.add([Entry(16, 0.002) for _ in range(7)])
    decision, _, _ = s.next(0.003)
    assert isinstance(decision, Dispatch) and len(decision.batch) == 8  # full before the window ends


def test_adaptive_hold_waits_only_when_asked_and_when_it_fits_the_target() -> None:
    cfg = adaptive(max_wait_s=0.004)
    s = Scheduler(cfg, CostModel(), lambda n, m: n * m)
    s.add([Entry(16, 0.0)])
    decision, _, _ = s.next(0.0)
    assert isinstance(decision, Wait) and decision.until == pytest.approx(0.004)
    decision, _, _ = s.next(0.004)
    assert isinstance(decision, Dispatch)
    plain = Scheduler(adaptive(), CostModel(), lambda n, m: n * m)
    plain.add([Entry(16, 0.0)])
    assert isinstance(plain.next(0.0)[0], Dispatch)


def test_admission_refuses_what_cannot_fit() -> None:
    s = Scheduler(
        adaptive(max_queued_tokens=100, tenant_max_queued_tokens=50), CostModel(), lambda n, m: n * m
    )
    assert s.admit([200], "default", None, 0.0).reason == "too_large"  # type: ignore[union-attr]
    assert s.admit([60], "acme", None, 0.0).reason == "tenant_queue_full"  # type: ignore[union-attr]
    assert s.admit([60], "default", None, 0.0) is None  # the default tenant has the model bound
    s.add([Entry(90, 0.0)])
    refusal = s.admit([20], "default", None, 0.0)
    assert refusal is not None and refusal.reason == "queue_full" and refusal.retry_after > 0
    assert s.admit([5], "default", 0.0 + 1e-6, 0.0).reason == "deadline_unmeetable"  # type: ignore[union-attr]


def test_removed_entries_release_their_tokens() -> None:
    s = Scheduler(adaptive(), CostModel(), lambda n, m: n * m)
    entries = [Entry(10, 0.0, payload=i) for i in range(5)]
    s.add(entries)
    gone = s.remove(lambda e: e.payload in (1, 3))
    assert len(gone) == 2 and s.queued_tokens == 30 and s.queued_items == 3
    decision, _, _ = s.next(0.0)
    assert isinstance(decision, Dispatch)
    assert {e.payload for e in decision.batch} == {0, 2, 4}


def test_idle_tenants_are_forgotten_so_client_chosen_names_cannot_grow_memory() -> None:
    from coalesce.service.batching.scheduler import IDLE_TENANTS_KEPT

    s = Scheduler(adaptive(), CostModel(), lambda n, m: n * m)
    for i in range(3 * IDLE_TENANTS_KEPT):
        s.add([Entry(4, 0.0, tenant=f"t{i}")])
        decision, _, _ = s.next(0.0)
        assert isinstance(decision, Dispatch)
        s.done(4, 0.001, 0.0)
    assert len(s._tenants) <= IDLE_TENANTS_KEPT + 1
    s.add([Entry(4, 0.0, tenant="waiting")])
    assert s.tenant_queued_tokens() == {"waiting": 4}


@pytest.mark.parametrize("strategy", ["adaptive", "fixed", "none"])
def test_entries_of_different_kinds_never_share_a_batch(strategy: str) -> None:
    s = Scheduler(adaptive(strategy=strategy, max_wait_s=0.0), CostModel(), lambda n, m: n * m)
    kinds = ["pooled", "tokens", "pooled", "tokens", "tokens", "pooled"]
    s.add([Entry(8, 0.001 * i, payload=i, kind=k) for i, k in enumerate(kinds)])
    served: list[list[int]] = []
    while s.queued_items:
        decision, _, _ = s.next(1.0)
        assert isinstance(decision, Dispatch)
        assert len({e.kind for e in decision.batch}) == 1
        served.append([e.payload for e in decision.batch])
        s.done(decision.padded_tokens, 0.001, 1.0)
    assert sorted(i for batch in served for i in batch) == list(range(6))
    if strategy != "none":  # the oldest entry's kind goes first, with every waiting entry of its kind
        assert served == [[0, 2, 5], [1, 3, 4]]
