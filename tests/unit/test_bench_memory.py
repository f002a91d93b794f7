"""The memory figures of the soak and memory bench sections, from samples (no server, no load)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from coalesce.loadtests import bench, bench_memory
from coalesce.loadtests.bench_soak import Memory, Sampler, allocator_of

MIB = 1 << 20


def sampler_of(samples: list[tuple[float, int]]) -> Sampler:
    s = Sampler(os.getpid())
    s.samples = [(t, rss * MIB, 10) for t, rss in samples]
    return s


def test_memory_reads_the_first_minute_the_last_minute_and_the_end() -> None:
    # Every 10 s for three minutes: a climb in the first minute, then level within a few MiB.
    level = [400, 410, 420, 430, 440, 450, 460, 462, 459, 458, 463, 460, 461, 459, 462, 458, 460, 463, 460]
    m = Memory.of(sampler_of(list(zip(range(0, 181, 10), level, strict=True))))
    assert (m.start, m.reference, m.minute_before, m.end) == (400 * MIB, 460 * MIB, 461 * MIB, 460 * MIB)
    assert m.growth == 0.0 and m.last_minute == pytest.approx(-1 / 461)
    assert [row[-1] for row in m.checks()] == ["met", "met"]
    creeping = Memory.of(sampler_of([(t, 400 + t) for t in range(0, 181, 10)]))
    assert creeping.growth == pytest.approx(580 / 460 - 1)
    assert creeping.last_minute == pytest.approx(580 / 520 - 1)
    assert [row[-1] for row in creeping.checks()] == ["missed", "missed"]


def test_a_short_run_takes_half_of_it_for_each_reference() -> None:
    m = Memory.of(sampler_of([(t, 500 + t) for t in range(0, 61, 5)]), reference_s=30.0)
    assert (m.reference, m.minute_before, m.end) == (530 * MIB, 530 * MIB, 560 * MIB)


def test_the_allocator_column_comes_from_the_process_map(monkeypatch: pytest.MonkeyPatch) -> None:
    assert allocator_of(os.getpid()) in {"glibc", "jemalloc", "tcmalloc"}
    assert allocator_of(2**22 + 12345) == "unknown"  # no such process


def test_the_memory_section_runs_only_when_named_and_measures_glibc_first_unbounded_kernel_caches_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "memory" not in bench.parse_args([]).sections
    args = bench.parse_args(["--only", "memory", "--memory-minutes", "2"])
    assert args.sections == ["memory"] and args.memory_minutes == 2.0
    from coalesce.service import allocator

    monkeypatch.setattr(allocator, "find_jemalloc", lambda dirs=None: None)
    monkeypatch.setattr(bench_memory.os.path, "isfile", lambda p: False)
    monkeypatch.setattr(bench_memory.importlib.util, "find_spec", lambda name: None)  # no OpenVINO
    flags: list[Any] = [c.flags for c in bench_memory.configs()]
    assert flags == [["--allocator", "system"], ["--allocator", "glibc"],
                     ["--allocator", "glibc", "--cpu-kernel-cache", "0"]]
    monkeypatch.setattr(bench_memory.importlib.util, "find_spec", lambda name: object())
    openvino = [c for c in bench_memory.configs() if c.export]
    assert [c.flags for c in openvino] == [["--allocator", "glibc", "--backend", "openvino"],
                                           ["--allocator", "glibc", "--backend", "openvino",
                                            "--cpu-kernel-cache", "0"]]
    monkeypatch.setattr(allocator, "find_jemalloc", lambda dirs=None: "/usr/lib/libjemalloc.so.2")
    monkeypatch.setattr(bench_memory.os.path, "isfile", lambda p: p.endswith(bench_memory.TCMALLOC))
    configs = [c for c in bench_memory.configs() if not c.export]
    assert [c.flags for c in configs][2:] == [["--allocator", "jemalloc"], ["--allocator", "jemalloc"],
                                              ["--allocator", "system"],
                                              ["--allocator", "jemalloc", "--cpu-kernel-cache", "0"]]
    # The second jemalloc row: our options under another spelling, which the engine takes for an
    # operator's and leaves alone (the decay throughout, as the engine ran before it kept freed pages).
    conf, ours = configs[3].env["MALLOC_CONF"], allocator.JEMALLOC_CONF
    assert conf != ours and sorted(conf.split(",")) == sorted(ours.split(","))
    assert configs[4].env["LD_PRELOAD"].endswith(bench_memory.TCMALLOC)
