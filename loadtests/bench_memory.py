"""The ``memory`` bench section: resident memory under varying load, one allocator beside another.

    python -m coalesce.loadtests.bench --only memory [--memory-minutes 3]

One ``coalesce serve`` per allocator, in turn on loopback, each with ``--cache-mb 0`` (the result cache
has its own bound; this is about what else grows): glibc's malloc untouched (``--allocator system``),
glibc tuned as ``auto`` leaves it where jemalloc is missing (``--allocator glibc``: 2 arenas,
``malloc_trim`` after batches), jemalloc as ``auto`` runs it where it is installed (``--allocator
jemalloc``; the engine keeps its forwards' freed pages between batches and purges every 10 s), the
same jemalloc with its one-second decay throughout (our options under an operator's ``MALLOC_CONF``,
which the engine leaves alone: as it ran before it kept freed pages), and tcmalloc preloaded
(``--allocator system`` with ``LD_PRELOAD``) when installed, each
with oneDNN's kernel caches at the default ``--cpu-kernel-cache 64``; then the default allocator with
those caches at the libraries' own 1,024 entries (``--cpu-kernel-cache 0``), the behaviour before the
knob; and, where OpenVINO is installed, an export of the model on ``--backend openvino`` with the
default and with the CPU plugin's own 5,000 shapes. Each gets the same load: open-loop Poisson
arrivals alternating half and twice the capacity measured first (on a torch server of its own), phases
of 15 s, for ``--memory-minutes``, while the server's resident memory is sampled every second. Per
server: resident memory when the load begins, after 60 s and at the end, end ÷ 60 s (target ≤ 1.10)
and the last minute (target ≤ +2%), beside throughput and latency.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from coalesce.loadtests import servers
from coalesce.loadtests.bench_onnx import _export
from coalesce.loadtests.bench_sections import _met, _run, _spec
from coalesce.loadtests.bench_soak import (
    HIGH,
    LOW,
    RSS_GROWTH,
    RSS_LAST_MINUTE,
    Memory,
    Sampler,
    allocator_of,
)
from coalesce.loadtests.cli import run_async, write_outputs
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.results import StepResult
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target
from coalesce.loadtests.workload import Mix

PHASE_S = 15.0
TCMALLOC = "libtcmalloc_minimal.so.4"


@dataclass(frozen=True)
class Config:
    """One allocator to measure: its label, ``coalesce serve`` flags and extra environment."""

    label: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    export: bool = False  # serve a `coalesce export` of the default model (the torch-free backends)


def configs() -> list[Config]:
    """The allocators this machine can run, glibc untouched first (the baseline), then the default
    allocator with oneDNN's kernel caches at the libraries' defaults, then OpenVINO (where installed)
    bounded and at its plugin's default."""
    from coalesce.service.allocator import JEMALLOC_CONF, find_jemalloc, library_dirs

    out = [Config("glibc, untouched (`--allocator system`)", ["--allocator", "system"]),
           Config("glibc, 2 arenas + trim (`--allocator glibc`)", ["--allocator", "glibc"])]
    jemalloc = find_jemalloc()
    if jemalloc:
        out.append(Config("jemalloc, re-exec (`--allocator jemalloc`)", ["--allocator", "jemalloc"]))
        # Our options in another order: an operator's own MALLOC_CONF, which the engine leaves alone, so
        # the one-second decay runs throughout (what the engine did before it kept freed pages).
        conf = ",".join(reversed(JEMALLOC_CONF.split(",")))
        out.append(Config("jemalloc, decay 1 s throughout (an operator's `MALLOC_CONF`)",
                          ["--allocator", "jemalloc"], {"MALLOC_CONF": conf}))
    tcmalloc = next((p for d in library_dirs() if os.path.isfile(p := os.path.join(d, TCMALLOC))), None)
    if tcmalloc:
        out.append(Config("tcmalloc, preloaded (`--allocator system`)", ["--allocator", "system"],
                          {"LD_PRELOAD": tcmalloc}))
    default = "jemalloc" if jemalloc else "glibc"  # what --allocator auto runs here
    out.append(Config(f"{default}, oneDNN's kernel caches at 1,024 (`--cpu-kernel-cache 0`)",
                      ["--allocator", default, "--cpu-kernel-cache", "0"]))
    if importlib.util.find_spec("openvino") is not None:
        openvino = ["--allocator", default, "--backend", "openvino"]
        out.append(Config(f"{default}, OpenVINO (`--backend openvino`, an export)", openvino, export=True))
        out.append(Config(f"{default}, OpenVINO, its 5,000 shapes (`--cpu-kernel-cache 0`)",
                          [*openvino, "--cpu-kernel-cache", "0"], export=True))
    return out


def _by_rate(steps: list[StepResult], rate: float) -> tuple[float, float, float]:
    """Mean achieved req/s, median p50 and worst p99 of the phases offered ``rate``."""
    phases = [st for st in steps if abs(st.offered_rps - rate) < 0.5]
    p50s = sorted(st.latency.p50_ms for st in phases if st.latency)
    achieved = sum(st.achieved_rps for st in phases) / len(phases) if phases else float("nan")
    p50 = p50s[len(p50s) // 2] if p50s else float("nan")
    p99 = max((st.latency.p99_ms for st in phases if st.latency), default=float("nan"))
    return achieved, p50, p99


def memory(args: argparse.Namespace) -> tuple[str, str]:
    seconds = args.memory_minutes * 60.0
    reference_s = min(60.0, seconds / 2)
    out: Path = args.out / "memory"
    rows, load_rows = [], []
    # Capacity on a server of its own, so that each measured one starts as fresh as the others.
    with servers.running(_spec(args, "memory-capacity", ["--cache-mb", "0", "--log-level", "warning"]),
                         out / "logs", args.ready_timeout) as srv:
        probe = Scenario(mode=Mode.CLOSED, concurrency=64, duration=15.0, warmup=3.0, mix=Mix.SHORT)
        capacity = _run(srv.url, probe, "capacity", out).achieved_rps
    rates = (round(LOW * capacity, 1), round(HIGH * capacity, 1))
    window_s = reference_s
    export = out / "minilm-fp32"
    for i, config in enumerate(configs()):
        flags = ["--cache-mb", "0", "--log-level", "warning", *config.flags]
        if config.export:
            if not export.is_dir():
                _export(export, "fp32")
            flags += ["--model", str(export), "--openvino-cache-dir", str(out / f"openvino-cache-{i}")]
        spec = _spec(args, f"memory-{i}", flags)
        spec = servers.ServerSpec(spec.name, spec.argv, env={**spec.env, **config.env})
        with servers.running(spec, out / "logs", args.ready_timeout) as srv:
            malloc = allocator_of(srv.proc.pid)
            # One seed for every allocator: the same texts, in the same order, at the same times.
            scenario = Scenario(mode=Mode.ALTERNATE, rates=rates, step_duration=PHASE_S, duration=seconds,
                                warmup=0.0, mix=Mix.SHORT, timeout=60.0, max_inflight=4096, seed=7)
            with Sampler(srv.proc.pid) as sampler:
                result = run_async(Runner(Target(srv.url), scenario).run(f"memory {i}"))
            write_outputs(result, out / f"alternate-{i}", plots=False)
        m = Memory.of(sampler, reference_s)
        window_s = m.window_s
        mib = 2**20
        rows.append([config.label, malloc, f"{m.start / mib:,.0f}", f"{m.reference / mib:,.0f}",
                     f"{m.end / mib:,.0f}", f"{m.end / m.reference:.2f}× {_met(m.growth <= RSS_GROWTH)}",
                     f"{m.last_minute:+.1%} {_met(m.last_minute <= RSS_LAST_MINUTE)}"])
        for rate in rates:
            achieved, p50, p99 = _by_rate(result.steps, rate)
            load_rows.append([config.label, fmt(rate), fmt(achieved), fmt(p50), fmt(p99)])
    body = (
        "Each server in turn: `coalesce serve --cache-mb 0` with the flags shown (oneDNN's kernel caches at "
        "the default `--cpu-kernel-cache 64` but in the row with `--cpu-kernel-cache 0`, where they keep "
        "the libraries' 1,024 "
        "entries each; OpenVINO: `--cpu-kernel-cache 0` leaves its CPU plugin 5,000 shapes), under open-loop "
        f"Poisson arrivals alternating {rates[0]:g} and {rates[1]:g} req/s ({LOW:g}× and {HIGH:g}× the "
        f"closed-loop capacity of a server of its own) every {PHASE_S:g} s for {args.memory_minutes:g} min, "
        "mix `short`, the same texts for each; resident memory of the server process sampled every second "
        "(`loadtests/bench_memory.py`). The allocator column is read from the server's memory map.\n\n"
        + markdown_table(["server", "allocator", "MiB at start", f"MiB at {reference_s:g} s", "MiB at end",
                          f"end ÷ {reference_s:g} s (≤ {1 + RSS_GROWTH:.2f}×)",
                          f"last {window_s:.0f} s (≤ +{RSS_LAST_MINUTE:.0%})"], rows)
        + "\n\n"
        + markdown_table(["server", "offered/s", "achieved/s (mean)", "p50 ms (median phase)",
                          "p99 ms (worst phase)"], load_rows)
        + "\n"
    )
    return "Memory: resident memory under alternating load, per allocator (CPU)", body
