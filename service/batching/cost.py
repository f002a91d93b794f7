"""The cost model: predicted seconds of one forward as ``a + b × padded tokens``.

Fitted online from measured batches over a sliding window by least squares, refitted after discarding
points whose residual is far beyond the window's typical one (a GC pause or a noisy neighbour should not
move the model). Seeded by warm-up batches so the first decisions are already measured, not guessed.
After the first 16 points a refit runs every ``window // 16``-th batch, so the fit is never more than
1/16 of a window behind. Pure: no clock, no asyncio, no torch.

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
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Coefficients:
    overhead_s: float  # a: fixed cost of one forward
    per_token_s: float  # b: cost of one padded token

    def predict(self, padded_tokens: int) -> float:
        return self.overhead_s + self.per_token_s * padded_tokens


class CostModel:
    """Online robust fit of batch time against padded tokens."""

    def __init__(self, prior: Coefficients | None = None, window: int = 128) -> None:
        # A prior keeps predictions sane before any batch ran: 5 ms + 50 µs/token is a slow CPU.
        self.coef = prior or Coefficients(overhead_s=0.005, per_token_s=5e-5)
        self._window = window
        self._x: list[float] = []  # padded tokens of the last `window` batches (a ring once full)
        self._y: list[float] = []  # their seconds
        self._next = 0
        self._refit_every = max(1, window // 16)
        self.observations = 0

    def observe(self, padded_tokens: int, seconds: float) -> None:
        if seconds <= 0 or padded_tokens <= 0:
            return
        if len(self._x) < self._window:
            self._x.append(float(padded_tokens))
            self._y.append(float(seconds))
        else:
            self._x[self._next] = float(padded_tokens)
            self._y[self._next] = float(seconds)
        self._next = (self._next + 1) % self._window
        self.observations += 1
        if self.observations <= 16 or self.observations % self._refit_every == 0:
            self._refit()

    def predict(self, padded_tokens: int) -> float:
        return self.coef.predict(padded_tokens)

    def _refit(self) -> None:
        x, y = self._x, self._y
        if len(x) < 2:
            # One point: keep the prior's split between a and b, scaled to match it.
            scale = y[0] / max(self.coef.predict(int(x[0])), 1e-12)
            self.coef = Coefficients(self.coef.overhead_s * scale, self.coef.per_token_s * scale)
            return
        fit = least_squares(x, y)
        if fit is None:
            return
        a, b = fit
        residuals = [abs(yi - (a + b * xi)) for xi, yi in zip(x, y, strict=True)]
        mad = sorted(residuals)[len(residuals) // 2]
        if mad > 0:
            bound = 4 * mad + 1e-6
            kept = [i for i, r in enumerate(residuals) if r <= bound]
            if len(kept) >= 2:
                a, b = least_squares([x[i] for i in kept], [y[i] for i in kept]) or (a, b)
        # Time never shrinks with more tokens and a forward never costs less than nothing.
        self.coef = Coefficients(max(a, 0.0), max(b, 1e-9))


def least_squares(x: list[float], y: list[float]) -> tuple[float, float] | None:
    """(a, b) minimising Σ(a + b·x − y)², with exactly rounded sums (see the module docstring)."""
    n = len(x)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    dx = [xi - mx for xi in x]
    sxx = math.fsum([d * d for d in dx])
    if sxx <= 1e-12 * max(1.0, mx * mx):
        # Every batch had the same size: attribute the time to tokens.
        return (0.0, my / mx) if mx > 0 else None
    b = math.fsum([d * (yi - my) for d, yi in zip(dx, y, strict=True)]) / sxx
    return my - b * mx, b
