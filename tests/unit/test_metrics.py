"""Metrics written per batch read exactly as if written per input; under ``--workers``, written cheaply."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from coalesce.service.metrics import FLUSH_S, BatchTally, Metrics, observe_all
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


def test_under_workers_series_are_written_without_asking_the_kernel_and_a_fork_writes_its_own_file(
    tmp_path: Path,
) -> None:
    """Under ``--workers`` a series write asks for no process id (a system call each, per counter,
    bucket and gauge), yet a forked child still writes to a file of its own, and a scrape adds both up."""
    script = r"""
import os, sys
from coalesce.service.metrics import Metrics
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

m = Metrics()
series = m.model_series("m")
asked = []
sys.setprofile(lambda frame, event, arg: asked.append(1) if event == "c_call" and arg is os.getpid else None)
for _ in range(100):
    series.batches.inc()
    series.batch_size.observe(3)
    series.queue_depth.set(7)
sys.setprofile(None)
assert not asked, f"{len(asked)} getpid calls"
child = os.fork()
if child == 0:
    series.batches.inc(5)
    os._exit(0)
os.waitpid(child, 0)
reg = CollectorRegistry()
MultiProcessCollector(reg)
sys.stdout.write(generate_latest(reg).decode())
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert 'coalesce_batches_total{model="m"} 105.0' in out
    assert 'coalesce_batch_size_count{model="m"} 100.0' in out
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("counter_"))
    assert len(files) == 2  # the parent's and the forked child's


def test_a_scrape_of_a_replica_reads_past_a_series_file_not_yet_sized(tmp_path: Path) -> None:
    """prometheus_client creates a process's series file empty and sizes it a moment later (and a process
    that dies in between leaves it empty for good): a scrape then still answers, every other series in
    it. Its own collector failed the whole scrape on such a file (a 500 from /metrics at a replica's
    start-up)."""
    script = r"""
import sys
from pathlib import Path
from coalesce.service.metrics import Metrics

m = Metrics()
m.model_series("m").batches.inc(3)
m.flush()
Path(m.multiprocess_dir, "counter_4194303.db").touch()  # created, not yet sized, by another process
sys.stdout.write(m.render().decode())
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert 'coalesce_batches_total{model="m"} 3.0' in out


def _batch_series(text: str) -> dict[str, float]:
    """The batcher's samples of a scrape, by series and labels."""
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name.startswith(("coalesce_batch", "coalesce_inputs", "coalesce_tokens", "coalesce_forward",
                                "coalesce_queue_wait"))}


def test_a_tally_of_batches_reads_as_each_batch_observed_when_it_ran() -> None:
    """The batcher's per-batch series counted in a tally read, once written, exactly as prometheus_client's
    own ``observe`` and ``inc`` of every value: bucket edges, values beyond the last bound, three
    priority classes, several writes."""
    batches = [  # size, tokens, padded, padding share, forward seconds, (priority, wait) per input
        (1, 7, 7, 0.0, 0.001, [(1, 0.0)]),
        (3, 20, 30, 1 / 3, 0.0025, [(0, 0.001), (1, 0.0010001), (2, 31.0)]),
        (512, 4000, 4096, 0.0234375, 0.7, [(1, 0.5)] * 512),
        (600, 70000, 300000, 0.7666, 45.0, [(2, 1e9)] * 600),
    ]
    tallied, plain = Metrics(), Metrics()
    tally = BatchTally(tallied, tallied.model_series("m"))
    each = plain.model_series("m")
    for n, (size, tokens, padded, padding, forward, waits) in enumerate(batches):
        tally.batch(size, tokens, padded, padding, forward)
        for priority, wait in waits:
            tally.waited(priority, (wait,))
        if n == 1:
            tally.flush()  # written twice: counts add up, nothing written twice
        each.batches.inc()
        each.inputs.inc(size)
        each.tokens.inc(tokens)
        each.batch_size.observe(size)
        each.batch_tokens.observe(padded)
        each.padding_ratio.observe(padding)
        each.forward_seconds.observe(forward)
        for priority, wait in waits:
            each.queue_wait[priority].observe(wait)
    got, want = _batch_series(tallied.render().decode()), _batch_series(plain.render().decode())
    assert want['coalesce_inputs_total{model="m"}'] == 1116
    assert want['coalesce_queue_wait_seconds_bucket{le="+Inf",model="m",priority="low"}'] == 601
    assert got == pytest.approx(want, rel=1e-12)  # (sums added in another order: the last bit may differ)


async def test_a_tally_is_written_within_the_flush_interval_without_a_scrape() -> None:
    """Under ``--workers`` nothing renders the engine's registry: its tallies reach the shared files on
    their own, one write per interval however many batches ran in it."""
    metrics = Metrics()
    series = metrics.model_series("m")
    tally = BatchTally(metrics, series)
    for _ in range(50):
        tally.batch(2, 10, 12, 1 / 6, 0.001)
        tally.waited(1, (0.002, 0.003))
    read = lambda name: metrics.registry.get_sample_value(name, {"model": "m"})  # noqa: E731 (no flush)
    assert read("coalesce_batches_total") == 0, "written at once, not per interval"
    await asyncio.sleep(FLUSH_S * 4)
    assert read("coalesce_batches_total") == 50
    assert read("coalesce_inputs_total") == 100
    assert metrics.registry.get_sample_value(
        "coalesce_queue_wait_seconds_count", {"model": "m", "priority": "normal"}) == 100
    tally.batch(1, 5, 5, 0.0, 0.001)  # the next interval's
    assert read("coalesce_batches_total") == 50
    await asyncio.sleep(FLUSH_S * 4)
    assert read("coalesce_batches_total") == 51


async def test_requests_in_flight_are_written_once_an_interval_and_read_exactly_by_a_scrape() -> None:
    """``coalesce_inflight_requests`` is the net change of the requests started and ended within
    ``FLUSH_S``, written then; a scrape at any moment reads every start and end so far (itself included,
    as a route does)."""
    metrics = Metrics()
    read = lambda: metrics.registry.get_sample_value("coalesce_inflight_requests")  # noqa: E731 (no flush)
    for _ in range(5):
        metrics.request_started()
    metrics.request_done("/v1/embeddings", 200, 0.01, started=True)
    metrics.request_done("/v1/embeddings", 429, 0.001)  # refused from its head (shed): never started
    assert read() == 0, "written at once, not once an interval"
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert read() == 0, "written when the turn ends, not once an interval"
    await asyncio.sleep(FLUSH_S * 4)
    assert read() == 4
    assert metrics.registry.get_sample_value(
        "coalesce_requests_total", {"route": "/v1/embeddings", "status": "200"}) == 1
    for _ in range(4):
        metrics.request_done("/v1/embeddings", 200, 0.01, started=True)
    metrics.request_started()  # a scrape: counted as in flight while it renders
    assert 'coalesce_inflight_requests 1.0' in metrics.render().decode()
    assert metrics.registry.get_sample_value(
        "coalesce_requests_total", {"route": "/v1/embeddings", "status": "200"}) == 5
    metrics.request_done("/metrics", 200, 0.001, started=True)
    await asyncio.sleep(FLUSH_S * 4)
    assert read() == 0


def test_requests_in_flight_without_an_event_loop_are_written_at_once() -> None:
    metrics = Metrics()
    metrics.request_started()
    assert metrics.registry.get_sample_value("coalesce_inflight_requests") == 1
    metrics.request_done("/v1/embeddings", 200, 0.01, started=True)
    assert metrics.registry.get_sample_value("coalesce_inflight_requests") == 0
