"""Metrics written per batch read exactly as if written per input; under ``--workers``, written cheaply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from coalesce.service.metrics import observe_all, observe_one
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


def test_one_value_observed_by_bisection_reads_as_prometheus_clients_own_observe() -> None:
    buckets = (0.001, 0.0025, 0.005, 0.01, 1.0, 30.0)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = Histogram("wait_seconds", "w", buckets=buckets, registry=ours)
    plain = Histogram("wait_seconds", "w", buckets=buckets, registry=theirs)
    for v in (0.0, 0.001, 0.0010001, 0.0025, 0.7, 1.0, 29.9, 30.0, 31.0, 1e9):  # edges, between, beyond
        observe_one(fast, v)
        plain.observe(v)
    assert generate_latest(ours) == generate_latest(theirs)
