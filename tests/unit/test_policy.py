"""Batch formation as a pure function: no asyncio, no model."""

from __future__ import annotations

import random

from coalesce.service.batching.policy import Limits, form_batch, padding_ratio, window_size


def eager(n: int, longest: int) -> int:
    return n * longest


def linear(a: float, b: float):  # type: ignore[no-untyped-def]
    return lambda padded: a + b * padded


CPU = linear(0.008, 0.0004)  # ~ MiniLM on 2 cores: 8 ms a batch + 0.4 ms a padded token
GPU = linear(0.002, 1e-7)  # launch-bound: 2 ms a batch, 0.1 µs a padded token


def test_lone_input_is_dispatched_alone() -> None:
    assert form_batch([12], 0, Limits(64, 16384), eager, CPU) == [0]


def test_batching_off_takes_only_the_oldest() -> None:
    assert form_batch([12, 12, 12], 0, Limits(1, 16384), eager, CPU) == [0]


def test_similar_inputs_fill_the_batch_up_to_the_size_cap() -> None:
    picked = form_batch([10] * 100, 0, Limits(32, 16384), eager, CPU)
    assert len(picked) == 32
    assert 0 in picked
    assert picked == list(range(32)), "among equal lengths the oldest go first"


def test_token_budget_caps_padded_cost() -> None:
    lengths = [100] * 50
    picked = form_batch(lengths, 0, Limits(64, 1000), eager, CPU)
    assert len(picked) == 10


def test_oldest_is_always_included_even_when_it_is_the_odd_one_out() -> None:
    lengths = [200] + [10] * 40
    picked = form_batch(lengths, 0, Limits(64, 16384), eager, CPU)
    assert 0 in picked


def test_long_input_does_not_drag_short_ones_on_a_compute_bound_device() -> None:
    # On a CPU the forward is token-bound: padding 31 short inputs to 200 tokens would cost ~20× their
    # real work, so the long input goes alone and the short ones form the next batch.
    lengths = [200] + [10] * 31
    assert form_batch(lengths, 0, Limits(64, 16384), eager, CPU) == [0]
    nxt = form_batch(lengths[1:], 0, Limits(64, 16384), eager, CPU)
    assert len(nxt) == 31


def test_launch_bound_device_batches_mixed_lengths_together() -> None:
    # On a launch-bound GPU the fixed cost dominates: one batch beats two.
    lengths = [200] + [10] * 31
    assert len(form_batch(lengths, 0, Limits(64, 16384), eager, GPU)) == 32


def test_short_and_long_are_grouped_by_length() -> None:
    rng = random.Random(7)
    lengths = [rng.choice([8, 9, 10, 11, 120, 125, 128]) for _ in range(200)]
    picked = form_batch(lengths, 0, Limits(64, 16384), eager, CPU)
    chosen = [lengths[i] for i in picked]
    assert max(chosen) <= 2 * min(chosen) or len(chosen) == 1
    padded = eager(len(chosen), max(chosen))
    assert padding_ratio(chosen, padded) < 0.3


def test_bucketed_cost_prefers_filling_the_cell() -> None:
    # A graph grid of batch cells 1, 8, 32: 9 inputs cost as much as 32, so take 32 when they wait.
    cells = (1, 8, 32)

    def cell_cost(n: int, longest: int) -> int:
        return next(c for c in cells if c >= n) * 16

    picked = form_batch([12] * 40, 0, Limits(32, 16384), cell_cost, GPU)
    assert len(picked) == 32


def test_time_limit_tightens_the_batch_and_yields_when_it_cannot_be_met() -> None:
    # CPU: 8 ms + 4 ms per 10-token input. 30 ms fits 5 inputs; a limit even one input misses is
    # dropped (the target is lost anyway), and the batch goes back to the most efficient size: all 50.
    assert len(form_batch([10] * 50, 0, Limits(64, 16384), eager, CPU, max_seconds=0.030)) == 5
    assert len(form_batch([10] * 50, 0, Limits(64, 16384), eager, CPU, max_seconds=0.001)) == 50


def test_batches_never_exceed_limits_on_random_inputs() -> None:
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 300)
        lengths = [rng.randint(3, 256) for _ in range(n)]
        limits = Limits(rng.choice([1, 4, 32, 128]), rng.choice([256, 2048, 16384]))
        predict = rng.choice([CPU, GPU])
        picked = form_batch(lengths, 0, limits, eager, predict)
        assert 0 in picked
        assert len(set(picked)) == len(picked) and all(0 <= i < n for i in picked)
        assert len(picked) <= limits.max_batch_size
        if len(picked) > 1:
            assert eager(len(picked), max(lengths[i] for i in picked)) <= limits.max_batch_tokens


def test_repeated_formation_drains_everything_in_bounded_steps() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(3, 256) for _ in range(500)]
    waiting = list(range(len(lengths)))
    rounds = 0
    while waiting:
        window = waiting[: window_size(Limits(32, 8192))]
        picked = form_batch([lengths[i] for i in window], 0, Limits(32, 8192), eager, CPU)
        chosen = {window[i] for i in picked}
        assert waiting[0] in chosen  # the oldest never waits behind a newer batch
        waiting = [i for i in waiting if i not in chosen]
        rounds += 1
    # Batches stay well above one input on average (81 here; 500 would mean the anchor ran alone each
    # time), while lengths from 3 to 256 tokens are grouped.
    assert rounds <= 100


def test_padding_ratio() -> None:
    assert padding_ratio([10, 5], 20) == 0.25
    assert padding_ratio([], 0) == 0.0


def test_a_short_anchor_among_many_long_inputs_fills_the_batch_when_one_forward_is_cheaper() -> None:
    # A query (the anchor: fair order serves it first) behind a bulk request's chunks, launch-bound: the
    # chunks ride along, the most urgent of them (lowest indices) first.
    lengths = [12] + [200] * 255
    assert form_batch(lengths, 0, Limits(64, 16384), eager, GPU) == list(range(64))


def test_a_short_anchor_is_not_padded_to_long_inputs_when_its_own_batch_is_cheaper() -> None:
    # On a CPU padding two 12-token queries to 200 costs more than a forward of their own (8 ms), even
    # though mixing them in would raise that one batch's tokens per second.
    lengths = [12, 12] + [200] * 254
    assert form_batch(lengths, 0, Limits(64, 16384), eager, CPU) == [0, 1]


def test_among_equal_lengths_the_more_urgent_are_taken_on_either_side_of_the_anchor() -> None:
    # Launch-bound, batches of 8 around an anchor of length 50 (index 20): of its longer neighbours, and
    # of its shorter ones when only those wait, the ones listed first (most urgent) go.
    longer = [10] * 20 + [50] + [60] * 20
    assert form_batch(longer, 20, Limits(8, 16384), eager, GPU) == list(range(20, 28))
    shorter = [10] * 20 + [50]
    assert form_batch(shorter, 20, Limits(8, 16384), eager, GPU) == [*range(7), 20]


def test_a_small_window_is_formed_in_a_few_cost_lookups_whatever_the_size_cap() -> None:
    # The engine forms a batch per step; under a light load, or a launch-bound device's, the window holds
    # a few inputs while the cap is hundreds: the search for the largest run stops at the window, not at
    # log2 of the cap for every run end (an engine's per-batch Python at small batches: issue 25).
    lookups: list[tuple[int, int]] = []

    def counted(n: int, longest: int) -> int:
        lookups.append((n, longest))
        return n * longest

    counts = []
    for cap in (32, 256, 4096):
        lookups.clear()
        picked = form_batch([9, 11, 12, 10], 0, Limits(cap, 1 << 20), counted, GPU, max_seconds=0.05)
        assert picked == [0, 1, 2, 3]
        assert max(n for n, _ in lookups) <= 4, "no size past the window is ever asked for"
        counts.append(len(lookups))
    assert len(set(counts)) == 1 and counts[0] <= 12, counts
