"""The cost model: predicted seconds of one forward as ``a + b × padded tokens``, at the pace forwards
run now.

Fitted online from measured batches over a sliding window by least squares, refitted after discarding
points whose residual is far beyond the window's typical one (a GC pause or a noisy neighbour should not
move the model). Seeded by warm-up batches so the first decisions are already measured, not guessed.
After the first 16 points a refit runs every ``window // 16``-th batch, so the fit is never more than
1/16 of a window behind — unless those batches' forwards took less than :data:`REFIT_FORWARD_S` together:
a refit costs the event loop about 30 µs, and on a device whose forwards take microseconds (a GPU's
small batches, the null model) refits every few batches were a tenth of the engine's work per batch.
Then it waits for that much forward time, and at most a window of batches. The pace (below) follows
every batch either way. Pure: no clock, no asyncio, no torch.

**The pace.** A fit that ignores a noisy neighbour also ignores, for as long as its window takes to turn
over (minutes at a few batches a second under overload), other programs that take the cores for good:
every forward then runs slower than it predicts. Admission that trusted it admitted, under a standing
queue, requests that could not start in time and dropped them late — each one decoded, tokenised and
queued for nothing — while batch forming sized batches for a machine that was gone, and the admitted
requests' tail passed the target (``tests/unit/test_overload.py``, a machine slowed after warm-up). So
the coefficients everyone reads (:attr:`CostModel.coef`) are the fit's scaled by the pace: the median,
over the last :data:`PACE_SPAN` batches, of measured ÷ fitted seconds, against the fit as it is after each
refit (while the window holds fast and slow batches the robust fit may keep either kind; the pace is
what makes the pair agree with the last few batches). It follows a lasting change within
a few batches, ignores a single slow one, and is 1 while forwards run as the fit says; once the fit has
caught up with a slower machine the pace is back near 1. When every one of the last :data:`PACE_SPAN`
batches is off the fit by more than :data:`PACE_SHIFT` the same way, the fit itself starts again from
them: a window holding both machines fits neither, and takes a shape (an overhead several times the
real one) that no single scale corrects.

**The spread.** A mean is all a fit can predict, and on a machine whose cores the forward shares (the
event loop refusing an overload on two cores, other programs) some forwards run far past it at random: at
4× load in the bench the slowest 1% of admitted requests rode forwards of 353 ms where the mean was 156.
Promises made by the mean are then broken by every slow batch, and the admitted p99 passes the target by
as much. So each refit also measures, over the fit's window, how far the slow forwards run past the
typical one: the :data:`SPREAD_QUANTILE`-th of measured ÷ fitted seconds over their median
(:attr:`CostModel.spread`, ≥ 1; within a tenth it is noise, and 1: :data:`SPREAD_NOISE`). It falls by
at most a tenth a refit (:data:`SPREAD_HOLD`: a window that
happens to hold few slow batches does not undo it at once); it stands still while the recent batches run
off the fit by more than :data:`PACE_SHIFT`, and is 1 again when the fit restarts (a window of two
machines' batches spreads as neither does). Admission under a confirmed overload counts the batch a
request rides in at it (``admit.Admitter._ride``). A lasting slowdown is not spread: it moves every
batch alike, which is the pace's to follow and the fit's to learn.

**The run spread.** A request's wait in a standing queue is the forwards of the few batches ahead of
it, and a sum of forwards runs past its median prediction too, if less far than one forward. A wait
predicted at the median was broken by every slow run of batches, and the requests admitted on it
waited to the bound (the soak's 2× phases: logged in a scratch run, so no figures here). What slows a
forward on a shared machine (the event loop refusing a flood, another program) often lasts longer than
one batch, and then a run is as slow as its batches. So each refit also measures
:attr:`CostModel.run_spread`: the same quantile over the median, of the seconds of :data:`RUN_SPAN`
batches in a row (in the order they ran) against their fitted seconds, with the spread's noise floor
and hold, and never above the spread. Admission under a confirmed overload counts a standing queue's
wait at it (``admit.Admitter._pace``). Slow forwards that come alone leave it well below the spread (a
run averages a slow one with its neighbours); in spells it nears the spread.

**The same inputs give the same coefficients on every machine, to the last bit.** Scheduling compares
predicted times (a batch against ``--interactive-batch-ms``, a run's rate against another's), and some
of those comparisons can land exactly on a boundary; if the fit went through BLAS (``x @ x``), its
summation order — and so its last bits — would depend on the kernel OpenBLAS or MKL picks for the CPU
(``OPENBLAS_CORETYPE`` changes it), and a decision with them. So the fit is plain Python arithmetic:
every product is one correctly rounded IEEE multiplication and every sum is :func:`math.fsum`, which is
exactly rounded and so independent of order. It is two parameters over at most ``window`` points, about
30 µs a refit, every few batches. The sums are taken about the means, which also keeps the slope exact
for the large token counts where ``n·Σx² − (Σx)²`` would cancel.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from operator import add, mul, sub, truediv
from typing import Any

# A refit waits for this many seconds of forward time since the last one (the module's docstring): its
# ~30 µs are then at most 1% of the forward's own time.
REFIT_FORWARD_S = 0.003
# The pace: the median of this many batches' measured ÷ fitted seconds, within these bounds (a broken
# measurement must neither stop admission nor open it wide). It starts once the fit has this many
# points behind it (warm-up's first batches are measured against a prior, not a fit).
PACE_SPAN = 9
PACE_BOUNDS = (0.5, 10.0)
PACE_AFTER = 4
# Every one of the last PACE_SPAN batches this far off the fit (slower, or faster by its inverse) is a
# lasting change, not noise: the fit starts again from them.
PACE_SHIFT = 1.5
# The spread (see the module's docstring): over the fit's window, once it holds SPREAD_AFTER batches, the
# SPREAD_QUANTILE-th of measured ÷ fitted seconds over their median, within SPREAD_BOUNDS, falling by at most
# SPREAD_HOLD's complement a refit.
SPREAD_QUANTILE = 0.95
SPREAD_AFTER = 16
SPREAD_BOUNDS = (1.0, 3.0)
SPREAD_HOLD = 0.9
# The run spread (see the module's docstring): the same, of the seconds of RUN_SPAN batches in a row.
RUN_SPAN = 3
# A spread within this is the forwards' everyday noise, which admission's door already leaves a tenth of
# slack for (``admit.DOOR``): it counts as none. (Counted, ±5% noise shortened a slowed machine's batches
# and promises enough to fail the simulator's goodput bound for it, 0.9× of what it serves.)
SPREAD_NOISE = 1.1


@dataclass(frozen=True, slots=True)
class Coefficients:
    overhead_s: float  # a: fixed cost of one forward
    per_token_s: float  # b: cost of one padded token

    def predict(self, padded_tokens: int) -> float:
        return self.overhead_s + self.per_token_s * padded_tokens


# What each setting of a cost model keeps of its own (CostModel.use).
_STATE = ("fit", "coef", "pace", "_recent_x", "_recent_y", "_x", "_y", "_next", "_since_refit",
          "observations", "restarts", "spread", "run_spread")


class CostModel:
    """Online robust fit of batch time against padded tokens, scaled by the recent pace."""

    def __init__(self, prior: Coefficients | None = None, window: int = 128) -> None:
        self._window = window
        self._refit_every = max(1, window // 16)
        # A prior keeps predictions sane before any batch ran: 5 ms + 50 µs/token is a slow CPU.
        self._start(prior or Coefficients(overhead_s=0.005, per_token_s=5e-5))
        # The setting forwards run at (:meth:`use`: a CPU forward's thread count), and the state of each
        # other setting seen, kept whole for when forwards run at it again.
        self.setting: Hashable = None
        self._settings: dict[Hashable, dict[str, Any]] = {}

    def _start(self, fit: Coefficients) -> None:
        """A state with nothing observed, predicting ``fit`` (every field of :data:`_STATE`)."""
        self.fit = fit
        self.coef = fit  # the fit at the pace: what a forward is predicted to take now
        self.pace = 1.0
        # The recent batches' padded tokens and seconds (the pace's).
        self._recent_x: deque[float] = deque(maxlen=PACE_SPAN)
        self._recent_y: deque[float] = deque(maxlen=PACE_SPAN)
        self._x: list[float] = []  # padded tokens of the last `window` batches (a ring once full)
        self._y: list[float] = []  # their seconds
        self._next = 0
        self._since_refit = (0, 0.0)  # batches and forward seconds observed since the last refit
        self.observations = 0
        self.restarts = 0  # times the fit started again from the recent batches (a lasting change)
        self.spread = 1.0  # how far past the typical forward the slow ones run (the module's docstring)
        self.run_spread = 1.0  # and RUN_SPAN forwards in a row

    # -- settings ------------------------------------------------------------------------------------
    def use(self, setting: Hashable, scale: float = 1.0) -> None:
        """Forwards run at ``setting`` from now on (a CPU forward's thread count: ``engine/threads.py``): the
        fit, pace, spreads and window of each setting are its own, since a forward on one thread and on
        two are two machines. Coming back to a setting takes up its state as it was left; a setting not
        seen yet starts from the current fit times ``scale`` (the caller's guess, until its own batches
        refit it: one batch rescales it, two fit it), with nothing else carried over.

        Why: the forward's thread count changes under load (``LoopShare`` leaves the event loop or the
        gateways a thread) and beside a busy core (``engine/threads.py``). When it did, the fit measured on
        two threads went on predicting forwards on one: beside a busy core the two-thread seeds of a
        ``--workers 2`` engine ran many times slower than its one-thread forwards, and an idle burst of
        120 requests after start was refused in part at the 20 s burst bound (BENCHMARKS.md, issue 25:
        the neighbour bench)."""
        if setting == self.setting:
            return
        if self.setting is None:  # (the first: what was observed so far ran at it)
            self.setting = setting
            return
        self._settings[self.setting] = self._state()
        self._take_up(setting, Coefficients(self.fit.overhead_s * scale, self.fit.per_token_s * scale))

    def predict_at(self, setting: Hashable, padded_tokens: int) -> float | None:
        """What a forward of ``padded_tokens`` is predicted to take at ``setting``: the current one's
        prediction, another's as its state was left, None for one never used."""
        if setting == self.setting:
            return self.coef.predict(padded_tokens)
        saved = self._settings.get(setting)
        return None if saved is None else saved["coef"].predict(padded_tokens)

    def _state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _STATE}

    def _take_up(self, setting: Hashable, prior: Coefficients) -> None:
        """``setting``'s state as it was left, or a fresh one predicting ``prior`` for one never used."""
        saved = self._settings.pop(setting, None)
        if saved is None:
            self._start(prior)
        else:
            for name, value in saved.items():
                setattr(self, name, value)
        self.setting = setting

    def _observe_at(self, setting: Hashable, padded_tokens: int, seconds: float) -> None:
        was = self.setting
        self._settings[was] = self._state()
        self._take_up(setting, self.fit)  # (a setting first seen in a batch: the current fit its prior)
        try:
            self.observe(padded_tokens, seconds)
        finally:
            self._settings[setting] = self._state()
            self._take_up(was, self.fit)

    def observe(self, padded_tokens: int, seconds: float, setting: Hashable = None) -> None:
        """A forward of ``padded_tokens`` took ``seconds``; at ``setting`` when given (a batch that ran at
        another setting than the current one — handed over before a change, or a measurement of the
        other — teaches that setting's state, not this one's)."""
        if setting is not None and setting != self.setting:
            self._observe_at(setting, padded_tokens, seconds)
            return
        if seconds <= 0 or padded_tokens <= 0:
            return
        if self.observations >= PACE_AFTER:
            self._recent_x.append(float(padded_tokens))
            self._recent_y.append(float(seconds))
        if len(self._x) < self._window:
            self._x.append(float(padded_tokens))
            self._y.append(float(seconds))
        else:
            self._x[self._next] = float(padded_tokens)
            self._y[self._next] = float(seconds)
        self._next = (self._next + 1) % self._window
        self.observations += 1
        batches, forward_s = self._since_refit
        batches, forward_s = batches + 1, forward_s + seconds
        if len(self._x) <= 16 or batches >= self._window or (
                batches >= self._refit_every and forward_s >= REFIT_FORWARD_S):
            self._refit()
        else:
            self._since_refit = (batches, forward_s)
        if self._recent_x:
            ratios = self._ratios()
            if len(ratios) == PACE_SPAN and (ratios[0] > PACE_SHIFT or ratios[-1] < 1 / PACE_SHIFT):
                # Every recent batch off the fit the same way, by more than noise or a passing stall:
                # the window describes a machine that is gone. Start again from the recent batches (a
                # fit of old and new points together takes a shape that fits neither).
                self._x = list(self._recent_x)
                self._y = list(self._recent_y)
                self._next = len(self._x) % self._window
                self.restarts += 1
                self.spread = self.run_spread = 1.0  # (the old and new machine's batches spread as neither)
                self._refit()
                ratios = self._ratios()
            lo, hi = PACE_BOUNDS
            self.pace = min(max(ratios[len(ratios) // 2], lo), hi)
        fit, pace = self.fit, self.pace
        if self.coef.overhead_s != fit.overhead_s * pace or self.coef.per_token_s != fit.per_token_s * pace:
            self.coef = Coefficients(fit.overhead_s * pace, fit.per_token_s * pace)

    def predict(self, padded_tokens: int) -> float:
        return self.coef.predict(padded_tokens)

    def _ratios(self) -> list[float]:
        """Measured ÷ fitted seconds of the recent batches, against the fit as it is now (a refit may
        have moved it), ascending."""
        a, b = self.fit.overhead_s, self.fit.per_token_s  # (fit.predict inlined: this runs every batch)
        # t / max(a + b·x, 1e-12) of each: operator's functions, as least_squares, no bytecode per batch
        fitted = map(max, map(add, repeat(a), map(mul, repeat(b), self._recent_x)), repeat(1e-12))
        return sorted(map(truediv, self._recent_y, fitted))

    def _refit(self) -> None:
        self._since_refit = (0, 0.0)
        x, y = self._x, self._y
        if len(x) < 2:
            # One point: keep the prior's split between a and b, scaled to match it.
            scale = y[0] / max(self.fit.predict(int(x[0])), 1e-12)
            self.fit = Coefficients(self.fit.overhead_s * scale, self.fit.per_token_s * scale)
            return
        fit = least_squares(x, y)
        if fit is None:
            return
        a, b = fit
        # |y − (a + b·x)| of each point (as least_squares: operator's functions, no bytecode per point)
        residuals = list(map(abs, map(sub, y, map(add, repeat(a), map(mul, repeat(b), x)))))
        mad = sorted(residuals)[len(residuals) // 2]
        if mad > 0:
            keep = list(map((4 * mad + 1e-6).__ge__, residuals))  # within four MADs
            kept_x = list(compress(x, keep))
            if len(kept_x) >= 2:
                a, b = least_squares(kept_x, list(compress(y, keep))) or (a, b)
        # Time never shrinks with more tokens and a forward never costs less than nothing.
        self.fit = Coefficients(max(a, 0.0), max(b, 1e-9))
        # (Not while the recent batches run off the fit by more than PACE_SHIFT: the window then holds two
        # machines' batches, the restart's case, whose spread is neither's.)
        if len(x) >= SPREAD_AFTER and 1 / PACE_SHIFT < self.pace < PACE_SHIFT:
            # (fitted seconds > 0: a ≥ 0, b > 0 and every x > 0, as observe() keeps)
            a, b = self.fit.overhead_s, self.fit.per_token_s
            fitted = list(map(add, repeat(a), map(mul, repeat(b), x)))
            ratios = sorted(map(truediv, y, fitted))
            median = ratios[len(ratios) // 2]
            self.spread = _spread(ratios, median, self.spread, SPREAD_BOUNDS[1])
            # Runs in the order the batches ran: the ring from its oldest point (``_next`` once full; until
            # then ``_next`` is its length, and the slices give it whole).
            start = self._next
            ran = list(accumulate(y[start:] + y[:start], initial=0.0))
            due = list(accumulate(fitted[start:] + fitted[:start], initial=0.0))
            runs = sorted(map(truediv, map(sub, ran[RUN_SPAN:], ran[:-RUN_SPAN]),
                              map(sub, due[RUN_SPAN:], due[:-RUN_SPAN])))
            self.run_spread = _spread(runs, median, self.run_spread, self.spread)


def _spread(ratios: list[float], median: float, was: float, most: float) -> float:
    """The spread of ascending measured ÷ fitted ``ratios`` over the ``median`` single one: their
    SPREAD_QUANTILE-th over it, 1 within SPREAD_NOISE, falling from ``was`` by at most SPREAD_HOLD's
    complement, within SPREAD_BOUNDS and at most ``most``."""
    tail = ratios[int(SPREAD_QUANTILE * (len(ratios) - 1))] / median
    return min(max(tail if tail > SPREAD_NOISE else 1.0, was * SPREAD_HOLD, SPREAD_BOUNDS[0]), most)


def least_squares(x: list[float], y: list[float]) -> tuple[float, float] | None:
    """(a, b) minimising Σ(a + b·x − y)², with exactly rounded sums (see the module docstring)."""
    n = len(x)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    # (map over operator's functions: the same correctly rounded operations, in the same order, as
    # comprehensions would do, with no bytecode per point: a refit runs every few batches)
    dx = list(map(sub, x, repeat(mx)))
    sxx = math.fsum(map(mul, dx, dx))
    if sxx <= 1e-12 * max(1.0, mx * mx):
        # Every batch had the same size: attribute the time to tokens.
        return (0.0, my / mx) if mx > 0 else None
    b = math.fsum(map(mul, dx, map(sub, y, repeat(my)))) / sxx
    return my - b * mx, b
