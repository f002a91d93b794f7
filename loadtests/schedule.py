"""Arrival schedules: when each request of an open-loop run is due, as offsets in seconds from the start.

Pure functions on numbers, so they are tested without a clock or a network.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from coalesce.loadtests.workload import TraceEntry


def poisson_arrivals(rate: float, duration: float, rng: random.Random, start: float = 0.0) -> list[float]:
    """Arrivals of a Poisson process of ``rate`` per second over ``[start, start + duration)``.

    The process is conditioned on its count: exactly ``round(rate * duration)`` arrivals at uniformly
    random times, which is the Poisson process given its count. Inter-arrival gaps keep their
    exponential shape, and two runs at the same rate offer the same number of requests, so their
    achieved rates compare without the count's sampling noise.
    """
    if rate < 0 or duration < 0:
        raise ValueError("rate and duration must be non-negative")
    n = round(rate * duration)
    return sorted(start + rng.random() * duration for _ in range(n))


def burst_arrivals(
    rate_on: float,
    on_s: float,
    off_s: float,
    duration: float,
    rng: random.Random,
    rate_off: float = 0.0,
) -> list[float]:
    """On/off load: Poisson at ``rate_on`` for ``on_s`` seconds, then ``rate_off`` for ``off_s``, repeated."""
    if on_s <= 0 or off_s < 0:
        raise ValueError("burst on time must be positive and off time non-negative")
    arrivals: list[float] = []
    t = 0.0
    while t < duration:
        on = min(on_s, duration - t)
        arrivals += poisson_arrivals(rate_on, on, rng, start=t)
        t += on
        off = min(off_s, duration - t)
        if off > 0:
            arrivals += poisson_arrivals(rate_off, off, rng, start=t)
        t += off
    return arrivals


def ramp_rates(start: float, step: float, max_rate: float) -> list[float]:
    """The offered rates of a ramp: ``start``, ``start + step``, … up to ``max_rate`` inclusive."""
    if start <= 0 or step <= 0 or max_rate < start:
        raise ValueError("a ramp needs 0 < start <= max rate and a positive step")
    rates = []
    i = 0
    while start + i * step <= max_rate * (1 + 1e-9):
        rates.append(round(start + i * step, 6))
        i += 1
    return rates


def trace_arrivals(entries: Sequence[TraceEntry], speed: float = 1.0) -> list[float]:
    """Arrival offsets of a recorded trace, played ``speed`` times faster, starting at zero."""
    if speed <= 0:
        raise ValueError("speed must be positive")
    if not entries:
        return []
    t0 = entries[0].t
    return [(e.t - t0) / speed for e in entries]


def alternating_windows(
    rates: Sequence[float], step_s: float, duration: float
) -> list[tuple[float, float, float]]:
    """The phases of an alternating schedule as ``(start, end, rate)``: ``rates`` in turn, each for
    ``step_s`` seconds, cycled until ``duration`` (the last phase cut short if need be)."""
    if not rates or any(r < 0 for r in rates) or step_s <= 0 or duration <= 0:
        raise ValueError("an alternating schedule needs rates >= 0, a positive step and a positive duration")
    windows = []
    t, i = 0.0, 0
    while t < duration - 1e-9:
        end = min(t + step_s, duration)
        windows.append((t, end, rates[i % len(rates)]))
        t, i = end, i + 1
    return windows


def alternating_arrivals(
    rates: Sequence[float], step_s: float, duration: float, rng: random.Random, start: float = 0.0
) -> list[float]:
    """Open-loop arrivals of :func:`alternating_windows`, offset by ``start``: Poisson at each phase's
    rate, one phase after the other with no gap, so a backlog left by a high phase runs into the next."""
    arrivals: list[float] = []
    for t0, t1, rate in alternating_windows(rates, step_s, duration):
        arrivals += poisson_arrivals(rate, t1 - t0, rng, start=start + t0)
    return arrivals
