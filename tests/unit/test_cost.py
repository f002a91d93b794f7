"""The cost model fits a + b·tokens from measurements and shrugs off outliers."""

from __future__ import annotations

import random

import pytest
from coalesce.service.batching.cost import Coefficients, CostModel


def test_recovers_a_linear_cost_from_noisy_batches() -> None:
    rng = random.Random(0)
    model = CostModel()
    for _ in range(200):
        tokens = rng.randint(16, 8192)
        model.observe(tokens, (0.004 + 2e-5 * tokens) * rng.uniform(0.95, 1.05))
    assert model.coef.overhead_s == pytest.approx(0.004, rel=0.3)
    assert model.coef.per_token_s == pytest.approx(2e-5, rel=0.05)


def test_outliers_do_not_move_the_fit() -> None:
    rng = random.Random(1)
    model = CostModel(window=64)
    for i in range(64):
        tokens = rng.randint(16, 4096)
        seconds = 0.003 + 1e-5 * tokens
        if i % 10 == 0:
            seconds += 0.5  # a GC pause
        model.observe(tokens, seconds)
    assert model.predict(1000) == pytest.approx(0.013, rel=0.1)


def test_adapts_when_the_hardware_changes() -> None:
    model = CostModel(window=32)
    for t in range(100, 3300, 100):
        model.observe(t, 0.01 + 1e-4 * t)
    for t in range(100, 3300, 100):
        model.observe(t, 0.001 + 1e-6 * t)  # moved to a faster device
    assert model.predict(1000) == pytest.approx(0.002, rel=0.1)


def test_single_point_scales_the_prior() -> None:
    model = CostModel(prior=Coefficients(0.001, 1e-5))
    model.observe(100, 0.004)  # prior predicted 0.002
    assert model.predict(100) == pytest.approx(0.004)


def test_ignores_nonsense() -> None:
    model = CostModel()
    before = model.coef
    model.observe(0, 1.0)
    model.observe(100, -1.0)
    assert model.coef == before


def test_the_fit_is_never_more_than_a_sixteenth_of_the_window_behind() -> None:
    model = CostModel(window=64)
    for t in range(100, 6500, 100):
        model.observe(t, 0.01 + 1e-4 * t)
    before = model.predict(1000)
    for i, t in enumerate(range(100, 6500, 100)):
        model.observe(t, 0.001 + 1e-6 * t)  # a faster device: the fit must follow within 4 batches
        if i >= 3:
            assert model.predict(1000) < before
            break


def test_the_fit_does_not_depend_on_the_order_of_its_sums() -> None:
    # The same window in another order must give the same coefficients to the last bit: a BLAS dot
    # product's summation order depends on the CPU's kernel (OPENBLAS_CORETYPE), and so would a decision
    # that compares two predicted times. Exactly rounded sums make the order irrelevant.
    rng = random.Random(7)
    points = [(rng.randint(16, 8192), 0.004 + 2e-5 * rng.randint(16, 8192) * rng.uniform(0.9, 1.1))
              for _ in range(48)]
    fits = set()
    for seed in range(6):
        shuffled = points[:]
        random.Random(seed).shuffle(shuffled)
        model = CostModel(window=64)
        for tokens, seconds in shuffled:
            model.observe(tokens, seconds)
        fits.add((model.coef.overhead_s, model.coef.per_token_s))
    assert len(fits) == 1
