"""Metrics written per batch read exactly as if written per input."""

from __future__ import annotations

from coalesce.service.metrics import observe_all
from prometheus_client import CollectorRegistry, Histogram, generate_latest


def test_a_batch_observed_at_once_reads_as_each_input_observed_alone() -> None:
    waits = [0.0, 0.001, 0.0007, 0.003, 0.5, 0.5000001, 45.0, 0.02, 0.001]
    one, each = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 30.0)
    at_once = Histogram("wait_seconds", "w", buckets=buckets, registry=one)
    alone = Histogram("wait_seconds", "w", buckets=buckets, registry=each)
    observe_all(at_once, waits)
    observe_all(at_once, [])
    for w in waits:
        alone.observe(w)
    assert generate_latest(one) == generate_latest(each)
