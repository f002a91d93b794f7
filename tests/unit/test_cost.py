"""The cost model fits a + b·tokens from measurements and shrugs off outliers."""

from __future__ import annotations

import random

import pytest
from coalesce.service.batching.cost import REFIT_FORWARD_S, Coefficients, CostModel


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


def test_refits_wait_for_forward_time_on_a_device_of_microsecond_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A refit costs the event loop tens of µs: after the first 16 points it runs every 1/16 window of
    batches at a CPU's pace, and on a device whose forwards take microseconds it waits for REFIT_FORWARD_S
    of them, and at most a window of batches."""
    def refits(per_batch_s: float) -> int:
        model = CostModel(window=128)
        count = 0
        refit = model._refit

        def counted() -> None:
            nonlocal count
            count += 1
            refit()

        monkeypatch.setattr(model, "_refit", counted)
        for i in range(16 + 1024):
            model.observe(100 + i % 7 * 50, per_batch_s)
        return count - 16  # (the first 16 points refit each)

    assert REFIT_FORWARD_S == 0.003
    assert refits(2**-7) == 1024 // 8  # 7.8 ms forwards: every 8th batch
    assert refits(2**-13) == 1024 // 25  # 122 µs forwards: every 25th, once 3 ms of them ran
    assert refits(2**-20) == 1024 // 128  # 1 µs forwards: once a window


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
        assert model.restarts == 0  # the same 48 points in every fit
        fits.add((model.fit.overhead_s, model.fit.per_token_s))
    assert len(fits) == 1


def test_a_lasting_slowdown_is_followed_within_a_few_batches() -> None:
    # Other programs take the cores after a long run at full speed: every forward takes three times
    # what the window of 128 fast batches says. Predictions follow within a few batches (the pace), and
    # the fit itself starts again from the slow batches, so its shape (not only its scale) is right.
    rng = random.Random(3)
    model = CostModel()
    sizes = [rng.randint(16, 4096) for _ in range(400)]
    for t in sizes[:200]:
        model.observe(t, (0.003 + 1e-5 * t) * rng.uniform(0.95, 1.05))
    assert model.predict(1000) == pytest.approx(0.013, rel=0.05)
    for i, t in enumerate(sizes[200:215]):
        model.observe(t, 3 * (0.003 + 1e-5 * t) * rng.uniform(0.95, 1.05))
        if i >= 5:  # the median of the last nine is a slow one
            assert model.predict(1000) == pytest.approx(0.039, rel=0.1), i
    assert model.restarts == 1
    for t in sizes[215:260]:
        model.observe(t, 3 * (0.003 + 1e-5 * t) * rng.uniform(0.95, 1.05))
    assert model.pace == pytest.approx(1.0, abs=0.05)  # the fit has caught up: no scale left to apply
    assert model.fit.overhead_s == pytest.approx(0.009, rel=0.3)
    assert model.fit.per_token_s == pytest.approx(3e-5, rel=0.05)


def test_a_few_slow_batches_hardly_move_the_predictions() -> None:
    # A noisy neighbour for a moment: four batches in fifty run three times slower. Four of the last
    # nine leave the median a normal batch's, so predictions stay within a quarter of the truth (a
    # pace taken from the last batch alone would triple them); noise of ±15% never restarts the fit.
    rng = random.Random(4)
    model = CostModel()
    for i in range(400):
        t = rng.randint(16, 4096)
        slow = 3.0 if 25 <= i % 50 < 29 else 1.0
        model.observe(t, slow * (0.003 + 1e-5 * t) * rng.uniform(0.85, 1.15))
        if i > 150:
            assert model.predict(1000) == pytest.approx(0.013, rel=0.25), i
    assert model.restarts == 0


def test_the_spread_is_how_far_the_slow_forwards_run_past_the_typical_one() -> None:
    # A tenth of forwards, at random, take twice what they should (a thread the cores' other work
    # preempts): the robust fit leaves them out, and the spread says the slow end of what runs is
    # twice the typical forward. Noise of ±5% alone is no spread (within a tenth: the door's slack); a
    # lasting slowdown is the pace's (all batches slower by the same factor), not the spread's.
    rng = random.Random(5)
    spiky, steady, slowed = CostModel(), CostModel(), CostModel()
    for i in range(600):
        t = rng.randint(16, 4096)
        base = (0.003 + 1e-5 * t) * rng.uniform(0.95, 1.05)
        spiky.observe(t, base * (2.0 if rng.random() < 0.1 else 1.0))
        steady.observe(t, base)
        slowed.observe(t, base * (3.0 if i >= 300 else 1.0))
        if i >= 200:
            assert 1.6 <= spiky.spread <= 2.2, i
            assert steady.spread == 1.0, i
        if i >= 330:
            assert slowed.spread <= 1.11, i
    assert spiky.predict(1000) == pytest.approx(0.013, rel=0.1)  # the mean is no slower for it
    assert slowed.restarts == 1


def test_the_run_spread_is_how_far_slow_spells_run_past_the_typical_forwards_in_a_row() -> None:
    # About a tenth of forwards run twice as long, alone at random or in spells of four in a row (what
    # takes the cores lasts longer than a batch): one forward is as spread either way, but three in a
    # row — a wait of the few batches ahead — run slow together only in spells. Alone, a slow one is
    # mostly averaged with its neighbours, and the run spread stays clearly below the spread.
    rng = random.Random(2)
    alone, spells = CostModel(), CostModel()
    left = 0
    seen: dict[str, list[float]] = {"alone": [], "alone run": [], "spells": [], "spells run": []}
    for i in range(800):
        t = rng.randint(16, 4096)
        base = (0.003 + 1e-5 * t) * rng.uniform(0.95, 1.05)
        alone.observe(t, base * (2.0 if rng.random() < 0.1 else 1.0))
        if left:
            left -= 1
        elif rng.random() < 0.03:
            left = 4
        spells.observe(t, base * (2.0 if left else 1.0))
        for model in (alone, spells):
            assert 1.0 <= model.run_spread <= model.spread, i  # (a run is never more spread than one)
        if i >= 300:
            for name, model in (("alone", alone), ("spells", spells)):
                seen[name].append(model.spread)
                seen[f"{name} run"].append(model.run_spread)
    mean = {name: sum(v) / len(v) for name, v in seen.items()}
    assert mean["alone"] >= 1.6 and mean["spells"] >= 1.6, mean
    assert mean["spells run"] >= 0.85 * mean["spells"], mean
    assert mean["alone run"] <= 0.8 * mean["alone"], mean
    assert mean["alone run"] < mean["spells run"], mean


def test_least_squares_is_the_closed_form_with_exactly_rounded_sums_to_the_last_bit() -> None:
    # Written out as the module's docstring states it: sums about the means, every sum math.fsum, every
    # product one IEEE multiplication. However the function is written, it must agree bit for bit.
    import math

    from coalesce.service.batching.cost import least_squares

    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(2, 128)
        x = [float(rng.choice([16, 48, 64, 300, 4096]) * rng.randint(1, 64)) for _ in range(n)]
        y = [0.003 + 2e-6 * xi * rng.uniform(0.5, 1.5) for xi in x]
        mx, my = math.fsum(x) / n, math.fsum(y) / n
        dx = [xi - mx for xi in x]
        sxx = math.fsum([d * d for d in dx])
        if sxx <= 1e-12 * max(1.0, mx * mx):
            assert least_squares(x, y) == (0.0, my / mx)
            continue
        b = math.fsum([d * (yi - my) for d, yi in zip(dx, y, strict=True)]) / sxx
        assert least_squares(x, y) == (my - b * mx, b)


# -- a fit per setting (a CPU forward's thread count: engine/threads.py) ---------------------------------
def test_each_thread_count_keeps_a_fit_of_its_own_and_a_change_takes_up_the_count_s() -> None:
    model = CostModel()
    model.use(2)
    for t in (18, 264):  # two-thread seeds beside a busy core: a hundred times what one thread takes
        model.observe(t, 0.3 + 2e-3 * t)
    model.observe(18, 0.004, 1)  # one thread fewer, as the engine seeds it: a batch of that count
    model.observe(264, 0.03, 1)
    assert model.predict(264) == pytest.approx(0.3 + 2e-3 * 264), "the count in use predicts"
    assert model.predict_at(1, 264) == pytest.approx(0.03)
    model.use(1)  # LoopShare leaves a thread: a burst is now judged on the one-thread fit
    assert model.predict(264) == pytest.approx(0.03) and model.setting == 1
    assert model.predict_at(2, 264) == pytest.approx(0.3 + 2e-3 * 264), "the other count's, as left"
    model.observe(264, 0.04, 2)  # a batch handed over before the change ran on two threads
    assert model.predict(264) == pytest.approx(0.03), "it taught its own count's fit, not this one's"
    model.use(2)
    assert model.predict(264) != pytest.approx(0.3 + 2e-3 * 264), "which it moved"
    assert model.predict_at(3, 100) is None, "a count never used predicts nothing"


def test_a_count_not_seen_yet_starts_from_the_guess_and_its_first_batches_fit_it() -> None:
    model = CostModel()
    for t in (100, 1000):
        model.observe(t, 0.001 + 1e-5 * t)
    model.use(4)  # (the first setting names what ran so far)
    assert model.predict(1000) == pytest.approx(0.011)
    model.use(2, scale=2.0)  # half the threads: guessed twice as slow
    assert model.predict(1000) == pytest.approx(0.022)
    model.observe(1000, 0.015)
    assert model.predict(1000) == pytest.approx(0.015), "one batch rescales it"
    model.observe(100, 0.003)
    assert model.predict(100) == pytest.approx(0.003) and model.predict(1000) == pytest.approx(0.015)
    model.use(4)
    assert model.predict(1000) == pytest.approx(0.011), "the other count's state came back whole"
