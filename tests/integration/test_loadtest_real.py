"""A short load test against the real service: `coalesce serve` with the packaged model, on loopback."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from coalesce.loadtests import servers
from coalesce.loadtests.cli import run_async
from coalesce.loadtests.results import load
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.RunningServer]:
    spec = servers.coalesce_spec("real", ["--device", "cpu", "--log-level", "warning"])
    with servers.running(spec, tmp_path_factory.mktemp("logs"), ready_timeout_s=180) as srv:
        yield srv


def test_closed_loop_run_against_the_real_service(server: servers.RunningServer) -> None:
    result = run_async(
        Runner(Target(server.url), Scenario(mode=Mode.CLOSED, concurrency=8, duration=2.5, warmup=0.5)).run(
            "real"
        )
    )
    step = result.steps[0]
    assert result.model == "all-MiniLM-L6-v2"
    assert step.ok > 0 and step.error_rate == 0, step.by_status
    assert step.latency is not None and step.latency.p50_ms > 0
    assert step.header_queue_ms is not None  # x-queue-time
    b = step.batch
    assert b is not None, "no coalesce_* batch metrics scraped from /metrics"
    assert b.batches > 0 and b.inputs >= step.ok * 0.9
    assert b.mean_batch_size is not None and b.mean_batch_size >= 1
    assert sum(bc.count for bc in b.size_buckets) == b.batches
    assert b.mean_forward_ms is not None and b.mean_forward_ms > 0


def test_the_coalesce_command_runs_a_loadtest(server: servers.RunningServer, tmp_path: Path) -> None:
    argv = [
        *servers.coalesce_command(),
        "loadtest",
        "--url",
        server.url,
        "--mode",
        "open",
        "--rate",
        "10",
        "--duration",
        "2",
        "--warmup",
        "0.5",
        "--inputs-per-request",
        "4",
        "--out",
        str(tmp_path),
        "--no-plots",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    step = load(tmp_path / "result.json").steps[0]
    assert step.requests == 20 and step.error_rate == 0, step.by_status
    assert step.batch is not None and step.batch.inputs >= 4 * 18
