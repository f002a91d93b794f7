"""Percentiles, timelines, cost, and reading the server's Prometheus metrics."""

from __future__ import annotations

import pytest
from coalesce.loadtests import promtext
from coalesce.loadtests.stats import LatencyHistogram, cost, summarize, timeline


def test_percentiles_of_known_samples() -> None:
    # 1..10000 ms: the p-th percentile is p% of 10 s, to the histogram's 0.1% precision.
    lat = summarize(i / 1000 for i in range(1, 10_001))
    assert lat is not None
    assert lat.count == 10_000
    assert lat.p50_ms == pytest.approx(5000, rel=1e-3)
    assert lat.p90_ms == pytest.approx(9000, rel=1e-3)
    assert lat.p95_ms == pytest.approx(9500, rel=1e-3)
    assert lat.p99_ms == pytest.approx(9900, rel=1e-3)
    assert lat.p999_ms == pytest.approx(9990, rel=1e-3)
    assert lat.max_ms == pytest.approx(10_000, rel=1e-3)
    assert lat.mean_ms == pytest.approx(5000.5, rel=1e-3)


def test_a_tail_shows_in_the_high_percentiles_only() -> None:
    h = LatencyHistogram()
    h.record_all([0.010] * 990 + [2.0] * 10)
    assert h.percentile_ms(50) == pytest.approx(10, rel=1e-3)
    assert h.percentile_ms(99) == pytest.approx(10, rel=1e-3)
    assert h.percentile_ms(99.9) == pytest.approx(2000, rel=1e-3)


def test_no_samples_no_summary() -> None:
    assert summarize([]) is None


def test_timeline_bins_by_scheduled_time() -> None:
    tl = timeline([0.1, 0.2, 1.1, 1.2], [0.01, 0.02, 0.5, 9.0], [True, True, True, False], 0.0, 2.0, bins=2)
    assert tl.bin_s == 1.0
    assert tl.sent == [2, 2] and tl.ok == [2, 1] and tl.failed == [0, 1]
    assert tl.p99_ms[0] == pytest.approx(20, rel=1e-3) and tl.p50_ms[1] == pytest.approx(500, rel=1e-3)


def test_cost_per_thousand_requests_and_million_embeddings() -> None:
    c = cost(3.6, requests_per_s=10.0, inputs_per_s=100.0)  # $3.60/h = $0.001/s
    assert c.per_1k_requests == pytest.approx(0.1)
    assert c.per_1m_embeddings == pytest.approx(10.0)
    assert cost(1.0, 0.0, 0.0).per_1k_requests is None


_BEFORE = """
# TYPE coalesce_batch_size histogram
coalesce_batch_size_bucket{model="m",le="1.0"} 10
coalesce_batch_size_bucket{model="m",le="2.0"} 10
coalesce_batch_size_bucket{model="m",le="4.0"} 10
coalesce_batch_size_bucket{model="m",le="+Inf"} 10
coalesce_batch_size_sum{model="m"} 10
coalesce_batch_size_count{model="m"} 10
coalesce_batch_size_bucket{model="other",le="1.0"} 0
coalesce_batch_size_bucket{model="other",le="2.0"} 0
coalesce_batch_size_bucket{model="other",le="4.0"} 500
coalesce_batch_size_bucket{model="other",le="+Inf"} 500
coalesce_batch_size_sum{model="other"} 2000
coalesce_batch_size_count{model="other"} 500
# TYPE coalesce_batches_total counter
coalesce_batches_total{model="m"} 10
coalesce_batches_total{model="other"} 500
# TYPE coalesce_inputs_total counter
coalesce_inputs_total{model="m"} 10
coalesce_inputs_total{model="other"} 2000
# TYPE coalesce_queue_wait_seconds histogram
coalesce_queue_wait_seconds_bucket{model="m",le="0.01"} 10
coalesce_queue_wait_seconds_bucket{model="m",le="0.1"} 10
coalesce_queue_wait_seconds_bucket{model="m",le="+Inf"} 10
coalesce_queue_wait_seconds_sum{model="m"} 0.05
coalesce_queue_wait_seconds_count{model="m"} 10
# TYPE coalesce_requests_total counter
coalesce_requests_total{route="/v1/embeddings",status="200"} 10
"""

_AFTER = """
# TYPE coalesce_batch_size histogram
coalesce_batch_size_bucket{model="m",le="1.0"} 12
coalesce_batch_size_bucket{model="m",le="2.0"} 14
coalesce_batch_size_bucket{model="m",le="4.0"} 20
coalesce_batch_size_bucket{model="m",le="+Inf"} 21
coalesce_batch_size_sum{model="m"} 50
coalesce_batch_size_count{model="m"} 21
coalesce_batch_size_bucket{model="other",le="1.0"} 0
coalesce_batch_size_bucket{model="other",le="2.0"} 0
coalesce_batch_size_bucket{model="other",le="4.0"} 500
coalesce_batch_size_bucket{model="other",le="+Inf"} 500
coalesce_batch_size_sum{model="other"} 2000
coalesce_batch_size_count{model="other"} 500
# TYPE coalesce_batches_total counter
coalesce_batches_total{model="m"} 21
coalesce_batches_total{model="other"} 500
# TYPE coalesce_inputs_total counter
coalesce_inputs_total{model="m"} 50
coalesce_inputs_total{model="other"} 2000
# TYPE coalesce_batch_padding_ratio histogram
coalesce_batch_padding_ratio_bucket{model="m",le="+Inf"} 11
coalesce_batch_padding_ratio_sum{model="m"} 2.2
coalesce_batch_padding_ratio_count{model="m"} 11
# TYPE coalesce_batch_tokens histogram
coalesce_batch_tokens_bucket{model="m",le="+Inf"} 11
coalesce_batch_tokens_sum{model="m"} 4400
coalesce_batch_tokens_count{model="m"} 11
# TYPE coalesce_forward_seconds histogram
coalesce_forward_seconds_bucket{model="m",le="+Inf"} 11
coalesce_forward_seconds_sum{model="m"} 0.22
coalesce_forward_seconds_count{model="m"} 11
# TYPE coalesce_queue_wait_seconds histogram
coalesce_queue_wait_seconds_bucket{model="m",le="0.01"} 10
coalesce_queue_wait_seconds_bucket{model="m",le="0.1"} 50
coalesce_queue_wait_seconds_bucket{model="m",le="+Inf"} 50
coalesce_queue_wait_seconds_sum{model="m"} 2.05
coalesce_queue_wait_seconds_count{model="m"} 50
# TYPE coalesce_requests_total counter
coalesce_requests_total{route="/v1/embeddings",status="200"} 45
coalesce_requests_total{route="/v1/embeddings",status="429"} 5
# TYPE coalesce_rejected_total counter
coalesce_rejected_total{model="m",reason="queue_full"} 5
"""


def test_batch_figures_come_from_the_delta_of_two_scrapes_for_our_model() -> None:
    window = promtext.delta(promtext.parse(_BEFORE), promtext.parse(_AFTER))
    b = promtext.batch_stats(window, model="m")
    assert b is not None
    assert (b.batches, b.inputs) == (11, 40)
    assert b.mean_batch_size == pytest.approx(40 / 11)
    assert [(bc.hi, bc.count) for bc in b.size_buckets] == [(1.0, 2), (2.0, 2), (4.0, 6), (None, 1)]
    assert b.mean_padding_ratio == pytest.approx(0.2)
    assert b.mean_queue_ms == pytest.approx(2000 / 40)
    # All 40 new waits fell in (0.01, 0.1]: the median interpolates to the middle of that bucket.
    assert b.p50_queue_ms == pytest.approx(55.0)
    assert b.mean_forward_ms == pytest.approx(20.0)
    assert b.mean_batch_tokens == pytest.approx(400.0)
    assert b.forward_tokens_per_s == pytest.approx(20_000.0)
    assert b.server_requests == {"200": 35, "429": 5}
    assert b.server_rejected == {"queue_full": 5}


def test_an_unknown_model_name_takes_every_model() -> None:
    window = promtext.delta(promtext.parse(_BEFORE), promtext.parse(_AFTER))
    b = promtext.batch_stats(window, model="alias-we-do-not-see")
    assert b is not None and b.batches == 11  # "other" did nothing in the window


def test_servers_without_coalesce_metrics_give_no_batch_figures() -> None:
    snap = promtext.parse("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.0\n")
    assert promtext.batch_stats(promtext.delta(snap, snap)) is None


def test_bucket_quantile_edges() -> None:
    assert promtext.bucket_quantile([], 0.5) is None
    assert promtext.bucket_quantile([(1.0, 0.0), (float("inf"), 10.0)], 0.5) == 1.0
    assert promtext.bucket_quantile([(1.0, 10.0), (2.0, 20.0)], 0.75) == pytest.approx(1.5)


def test_a_step_s_slowest_requests_say_how_many_were_due_in_its_first_second() -> None:
    # A soak's 2x phase whose onset is slow: of the slowest 1%, those due in its first second are
    # counted (an overload's start, told apart from a tail spread over the phase).
    from coalesce.loadtests.engine import Recorder
    from coalesce.loadtests.scenario import summarize_step

    rec = Recorder()
    for k in range(1000):
        due = 30.0 + k * 0.01  # the step runs 30-40 s into the run
        # Five slow ones at its start, three mid-step, the rest quick (slower towards the end).
        latency = 0.9 if k < 5 else 0.95 if k in (500, 501, 502) else 0.05 + k * 1e-4
        rec.add(due, due, due + latency, 200, 1, 50.0, 40.0)
    step = summarize_step(rec, label="soak 2", mode="alternate", window=(30.0, 40.0), offered_rps=100.0,
                          concurrency=None)
    assert step.tail is not None and step.tail.count >= 8 and step.tail.first_s == 5
