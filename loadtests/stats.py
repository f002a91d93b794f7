"""Turning raw samples into figures: HDR-histogram percentiles, timelines and cost."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from coalesce.loadtests.results import Cost, Latency, Timeline
from hdrh.histogram import HdrHistogram

# Microsecond resolution from 1 µs to one hour, three significant digits (0.1% relative error).
_LOWEST_US = 1
_HIGHEST_US = 3_600_000_000
_DIGITS = 3

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


class LatencyHistogram:
    """An HDR histogram of durations given in seconds."""

    def __init__(self) -> None:
        self._h = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)

    def record(self, seconds: float) -> None:
        us = round(seconds * 1e6)
        self._h.record_value(min(max(us, _LOWEST_US), _HIGHEST_US))

    def record_all(self, seconds: Iterable[float]) -> None:
        for s in seconds:
            self.record(s)

    @property
    def count(self) -> int:
        return int(self._h.get_total_count())

    def percentile_ms(self, p: float) -> float:
        return float(self._h.get_value_at_percentile(p)) / 1000.0

    def summary(self) -> Latency | None:
        if self.count == 0:
            return None
        p50, p90, p95, p99, p999 = (self.percentile_ms(p) for p in PERCENTILES)
        return Latency(
            count=self.count,
            mean_ms=float(self._h.get_mean_value()) / 1000.0,
            p50_ms=p50,
            p90_ms=p90,
            p95_ms=p95,
            p99_ms=p99,
            p999_ms=p999,
            max_ms=float(self._h.get_max_value()) / 1000.0,
        )


def summarize(seconds: Iterable[float]) -> Latency | None:
    """Percentiles of ``seconds`` (None when there are none)."""
    h = LatencyHistogram()
    h.record_all(seconds)
    return h.summary()


def timeline(
    sched: Sequence[float],
    latency: Sequence[float],
    ok: Sequence[bool],
    start: float,
    duration: float,
    bins: int = 100,
) -> Timeline:
    """Bin requests by scheduled send time over ``[start, start + duration)``: counts and p50/p99."""
    bin_s = max(0.05, duration / bins)
    n = max(1, int(duration / bin_s + 0.999))
    hists = [LatencyHistogram() for _ in range(n)]
    sent = [0] * n
    good = [0] * n
    for t, lat, success in zip(sched, latency, ok, strict=True):
        i = int((t - start) / bin_s)
        if not 0 <= i < n:
            continue
        sent[i] += 1
        if success:
            good[i] += 1
            hists[i].record(lat)
    return Timeline(
        bin_s=bin_s,
        start_s=[round(i * bin_s, 6) for i in range(n)],
        sent=sent,
        ok=good,
        failed=[s - g for s, g in zip(sent, good, strict=True)],
        p50_ms=[h.percentile_ms(50) if h.count else None for h in hists],
        p99_ms=[h.percentile_ms(99) if h.count else None for h in hists],
    )


def cost(per_hour: float, requests_per_s: float, inputs_per_s: float) -> Cost:
    """What a replica costs per 1k requests and per 1M embeddings when it serves these rates."""

    def per(unit: float, rate: float) -> float | None:
        return per_hour / (rate * 3600.0) * unit if rate > 0 else None

    return Cost(
        per_hour=per_hour,
        per_1k_requests=per(1_000, requests_per_s),
        per_1m_embeddings=per(1_000_000, inputs_per_s),
    )
