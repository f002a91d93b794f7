"""The cost model: predicted seconds of one forward as ``a + b × padded tokens``.

Fitted online from measured batches over a sliding window by least squares, refitted after discarding
points whose residual is far beyond the window's typical one (a GC pause or a noisy neighbour should not
move the model). Seeded by warm-up batches so the first decisions are already measured, not guessed.
The window lives in two numpy arrays and a refit is a handful of array operations (tens of
microseconds); still, after the first 16 points it runs every ``window // 16``-th batch, so the fit is
never more than 1/16 of a window behind. Pure: no clock, no asyncio, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        self._x = np.zeros(window)  # padded tokens of the last `window` batches (a ring)
        self._y = np.zeros(window)  # their seconds
        self._filled = 0
        self._next = 0
        self._refit_every = max(1, window // 16)
        self.observations = 0

    def observe(self, padded_tokens: int, seconds: float) -> None:
        if seconds <= 0 or padded_tokens <= 0:
            return
        self._x[self._next] = padded_tokens
        self._y[self._next] = seconds
        self._next = (self._next + 1) % self._x.size
        self._filled = min(self._filled + 1, self._x.size)
        self.observations += 1
        if self.observations <= 16 or self.observations % self._refit_every == 0:
            self._refit()

    def predict(self, padded_tokens: int) -> float:
        return self.coef.predict(padded_tokens)

    def _refit(self) -> None:
        x, y = self._x[: self._filled], self._y[: self._filled]
        if x.size < 2:
            # One point: keep the prior's split between a and b, scaled to match it.
            scale = float(y[0]) / max(self.coef.predict(int(x[0])), 1e-12)
            self.coef = Coefficients(self.coef.overhead_s * scale, self.coef.per_token_s * scale)
            return
        fit = _least_squares(x, y)
        if fit is None:
            return
        a, b = fit
        residuals = np.abs(y - (a + b * x))
        mad = float(np.sort(residuals)[residuals.size // 2])
        if mad > 0:
            kept = residuals <= 4 * mad + 1e-6
            if int(kept.sum()) >= 2:
                a, b = _least_squares(x[kept], y[kept]) or (a, b)
        # Time never shrinks with more tokens and a forward never costs less than nothing.
        self.coef = Coefficients(max(a, 0.0), max(b, 1e-9))


def _least_squares(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    n = x.size
    sx, sy = float(x.sum()), float(y.sum())
    sxx, sxy = float(x @ x), float(x @ y)
    den = n * sxx - sx * sx
    if den <= 1e-12 * max(1.0, sxx):
        # Every batch had the same size: attribute the time to tokens.
        return (0.0, sy / sx) if sx > 0 else None
    b = (n * sxy - sx * sy) / den
    a = (sy - b * sx) / n
    return a, b
