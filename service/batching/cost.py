"""The cost model: predicted seconds of one forward as ``a + b × padded tokens``.

Fitted online from measured batches over a sliding window by least squares, refitted after discarding
points whose residual is far beyond the window's typical one (a GC pause or a noisy neighbour should not
move the model). Seeded by warm-up batches so the first decisions are already measured, not guessed.
A refit walks the whole window several times in pure Python, which at low load would be once per
request, so after the first 16 points it runs every ``window // 16``-th batch: the fit is
never more than 1/16 of a window behind. Pure: no clock, no asyncio, no torch.
"""

from __future__ import annotations

from collections import deque
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
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self._refit_every = max(1, window // 16)
        self.observations = 0

    def observe(self, padded_tokens: int, seconds: float) -> None:
        if seconds <= 0 or padded_tokens <= 0:
            return
        self._points.append((float(padded_tokens), seconds))
        self.observations += 1
        if self.observations <= 16 or self.observations % self._refit_every == 0:
            self._refit()

    def predict(self, padded_tokens: int) -> float:
        return self.coef.predict(padded_tokens)

    def _refit(self) -> None:
        pts = list(self._points)
        if len(pts) < 2:
            x, y = pts[0]
            # One point: keep the prior's split between a and b, scaled to match it.
            scale = y / max(self.coef.predict(int(x)), 1e-12)
            self.coef = Coefficients(self.coef.overhead_s * scale, self.coef.per_token_s * scale)
            return
        fit = _least_squares(pts)
        if fit is None:
            return
        a, b = fit
        residuals = sorted(abs(y - (a + b * x)) for x, y in pts)
        mad = residuals[len(residuals) // 2]
        if mad > 0:
            kept = [(x, y) for x, y in pts if abs(y - (a + b * x)) <= 4 * mad + 1e-6]
            if len(kept) >= 2:
                fit = _least_squares(kept) or fit
                a, b = fit
        # Time never shrinks with more tokens and a forward never costs less than nothing.
        b = max(b, 1e-9)
        a = max(a, 0.0)
        self.coef = Coefficients(a, b)


def _least_squares(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    n = len(pts)
    sx = sum(x for x, _ in pts)
    sy = sum(y for _, y in pts)
    sxx = sum(x * x for x, _ in pts)
    sxy = sum(x * y for x, y in pts)
    den = n * sxx - sx * sx
    if den <= 1e-12 * max(1.0, sxx):
        # Every batch had the same size: attribute the time to tokens.
        return (0.0, sy / sx) if sx > 0 else None
    b = (n * sxy - sx * sy) / den
    a = (sy - b * sx) / n
    return a, b
