"""The soak section's pure parts: what it samples from /proc, and that it runs only when named."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from coalesce.loadtests import bench
from coalesce.loadtests.bench_soak import Sampler, settled_fds, usage
from coalesce.loadtests.procs import tree


def test_a_process_tree_and_its_memory_and_descriptors_are_read_from_proc() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in tree(os.getpid())
        rss, fds = usage(os.getpid())
        alone_rss, alone_fds = usage(child.pid)
        assert rss > alone_rss > 1 << 20 and fds > alone_fds >= 3
        # One more open descriptor is counted. (Against a count taken just before, a few times: a
        # thread left by an earlier test may close one of its own between two reads.)
        for _ in range(5):
            before = usage(os.getpid())[1]
            with open(os.devnull) as extra:
                assert extra.fileno() > 0
                during = usage(os.getpid())[1]
            if during >= before + 1:
                break
        else:
            raise AssertionError(f"an open descriptor was not counted: {before} then {during}")
    finally:
        child.kill()
        child.wait(10)


def test_the_sampler_records_until_stopped_and_descriptors_settle() -> None:
    with Sampler(os.getpid(), every=0.05) as sampler:
        deadline = time.monotonic() + 10  # three samples, the last 0.1 s in: ~0.15 s unless the host crawls
        while (len(sampler.samples) < 3 or sampler.samples[-1][0] < 0.1) and time.monotonic() < deadline:
            time.sleep(0.01)
    n = len(sampler.samples)
    assert n >= 3 and sampler.at(0.1)[0] >= 0.1 and sampler.at(1e9) == sampler.samples[-1]
    time.sleep(0.2)
    assert len(sampler.samples) == n
    assert settled_fds(os.getpid(), at_most=10**6, timeout=2) == usage(os.getpid())[1]


def test_the_soak_runs_only_when_named() -> None:
    assert "soak" not in bench.parse_args([]).sections
    args = bench.parse_args(["--only", "soak", "--soak-minutes", "1"])
    assert args.sections == ["soak"] and args.soak_minutes == 1.0


def test_the_soak_drives_its_probe_and_its_phases_with_the_lean_client() -> None:
    """The soak's p99 runs from scheduled send times: a generator that lags adds its lag to it."""
    from coalesce.loadtests.bench_soak import alternating, capacity_probe
    from coalesce.loadtests.scenario import Mode

    probe, phases = capacity_probe(), alternating((100.0, 400.0), 30.0, 600.0)
    assert (probe.mode, probe.concurrency, probe.client) == (Mode.CLOSED, 64, "raw")
    assert (phases.mode, phases.rates, phases.client) == (Mode.ALTERNATE, (100.0, 400.0), "raw")
    assert phases.seed != probe.seed  # the result cache must not answer the soak from the probe's texts
