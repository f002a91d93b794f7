"""The ``soak`` bench section (``make soak``): overload on and off for ``--soak-minutes``, and what the
server keeps through it.

One server (the default configuration with ``--target-latency-ms``) on loopback. First its capacity:
closed-loop throughput at 64 clients. Then ``coalesce loadtest --mode alternate``: open-loop Poisson
arrivals at half and twice that capacity in turn (phases of 30 s, shorter on a short run so there are at
least four; probe and phases driven by the lean raw client, ``--client raw``), while a thread samples
the server process tree's resident memory and open descriptors every second. Checked, each against its target:

* every request is answered (never a reset or a client timeout; the client waits 60 s, twice the
  server's own request deadline), and only with 200, or 429/503 with ``Retry-After`` (a 504 is an
  answer, but one the server should have given at once, as a 503);
* the p99 of admitted requests (200s), in every phase, within ``--target-latency-ms``;
* resident memory at the end within 10% of its level after the first minute (half the run when
  shorter), and within 2% of its level a minute before the end: a leak, or an allocator that keeps
  what varying shapes leave behind (glibc's malloc: ``service/allocator.py``), shows as growth that
  overload on and off does not explain. The allocator the server runs on is read from its memory map;
* open descriptors back to their idle count (after the capacity probe, before the soak) once the
  load's connections have closed.

Not among the default sections: ten minutes is long. ``--soak-minutes 1`` smoke-runs it.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from coalesce.loadtests import servers
from coalesce.loadtests.bench_sections import _met, _run, _spec
from coalesce.loadtests.cli import run_async, write_outputs
from coalesce.loadtests.procs import tree
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.results import StepResult
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target
from coalesce.loadtests.workload import Mix

LOW, HIGH = 0.5, 2.0  # of capacity
PHASE_S = 30.0
RSS_GROWTH = 0.10  # end ÷ after the first minute
RSS_LAST_MINUTE = 0.02  # end ÷ a minute before the end
ANSWERED = {"200", "429", "503"}  # 429 and 503 only with Retry-After
CLIENT_TIMEOUT_S = 60.0
# The lean generator (``rawclient``), as the overload section's: latency runs from each request's scheduled
# send time, so a generator that falls behind (aiohttp's client, sharing these cores at twice capacity,
# reported a dispatch lag p99 of over half a second) adds its own lag to the server's p99.
CLIENT = "raw"


def usage(pid: int) -> tuple[int, int]:
    """Resident bytes and open descriptors of ``pid``'s process tree."""
    rss = fds = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue  # it exited between the listing and the read
    return rss, fds


class Sampler:
    """Samples :func:`usage` every ``every`` seconds on a thread: ``(seconds since start, rss, fds)``."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while True:
            self.samples.append((time.monotonic() - t0, *usage(self.pid)))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(10)

    def at(self, seconds: float) -> tuple[float, int, int]:
        """The first sample at or after ``seconds`` (the last one if the run was shorter)."""
        return next((s for s in self.samples if s[0] >= seconds), self.samples[-1])


@dataclass(frozen=True, slots=True)
class Memory:
    """Resident memory of a run's process tree: at the first sample, after ``reference_s``, ``window_s``
    before the end (a minute, or half the run when shorter), and at the end, in bytes."""

    reference_s: float
    window_s: float  # "a minute before the end": 60 s, or half the run when shorter
    start: int
    reference: int
    minute_before: int
    end: int

    @classmethod
    def of(cls, sampler: Sampler, reference_s: float = 60.0) -> Memory:
        last_s = sampler.samples[-1][0]
        window_s = min(60.0, last_s / 2)
        return cls(reference_s, window_s, sampler.samples[0][1], sampler.at(reference_s)[1],
                   sampler.at(max(0.0, last_s - window_s))[1], sampler.samples[-1][1])

    @property
    def growth(self) -> float:
        """End ÷ after ``reference_s``, less one."""
        return self.end / self.reference - 1 if self.reference else float("nan")

    @property
    def last_minute(self) -> float:
        """End ÷ a minute before the end, less one."""
        return self.end / self.minute_before - 1 if self.minute_before else float("nan")

    def checks(self) -> list[list[str]]:
        """The two memory rows of a figures table (``figure, target, measured, met``)."""
        mib = 2**20
        return [
            [f"resident memory, end ÷ after {self.reference_s:g} s", f"≤ +{RSS_GROWTH:.0%}",
             f"{self.end / mib:,.0f} ÷ {self.reference / mib:,.0f} MiB ({self.growth:+.1%}; "
             f"{self.start / mib:,.0f} MiB when the load began)", _met(self.growth <= RSS_GROWTH)],
            [f"resident memory, end ÷ {self.window_s:.0f} s before", f"≤ +{RSS_LAST_MINUTE:.0%}",
             f"{self.end / mib:,.0f} ÷ {self.minute_before / mib:,.0f} MiB ({self.last_minute:+.1%})",
             _met(self.last_minute <= RSS_LAST_MINUTE)],
        ]


def allocator_of(pid: int) -> str:
    """The allocator a server process runs on, from its memory map: jemalloc, tcmalloc or glibc."""
    from coalesce.service.allocator import mapped

    try:
        found = mapped(Path(f"/proc/{pid}/maps").read_text())
    except OSError:
        return "unknown"
    return found[0] if found else "glibc"


def settled_fds(pid: int, at_most: int | None = None, timeout: float = 30.0) -> int:
    """Open descriptors once they stop changing for 2 s (or fall to ``at_most``), within ``timeout``."""
    deadline = time.monotonic() + timeout
    last, since = usage(pid)[1], time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = usage(pid)[1]
        if at_most is not None and now <= at_most:
            return now
        if now != last:
            last, since = now, time.monotonic()
        elif at_most is None and time.monotonic() - since >= 2.0:
            return now
    return usage(pid)[1]


def _phase_row(st: StepResult) -> list[str]:
    lat, tail = st.latency, st.tail
    refused = ", ".join(f"{k}×{v}" for k, v in st.by_status.items() if k != "200") or "-"
    return [st.label, fmt(st.offered_rps), fmt(st.achieved_rps), fmt(lat.p50_ms if lat else None),
            fmt(lat.p99_ms if lat else None), fmt(tail.queue_ms if tail else None),
            fmt(tail.forward_ms if tail else None), f"{tail.first_s} of {tail.count}" if tail else "-",
            fmt(st.header_inference_ms),
            f"{st.ok:,} / {st.requests:,}", refused, fmt(st.send_lag.p99_ms if st.send_lag else None)]


def capacity_probe() -> Scenario:
    """Closed loop, 64 clients: the capacity the soak's rates are multiples of."""
    return Scenario(mode=Mode.CLOSED, concurrency=64, duration=15.0, warmup=3.0, mix=Mix.SHORT,
                    client=CLIENT)


def alternating(rates: tuple[float, float], phase_s: float, seconds: float) -> Scenario:
    """The soak itself: open-loop Poisson arrivals at ``rates`` in turn, latency from the scheduled send
    time. Another seed than the probe's: the same texts again would be answered by the result cache."""
    return Scenario(mode=Mode.ALTERNATE, rates=rates, step_duration=phase_s, duration=seconds, warmup=0.0,
                    mix=Mix.SHORT, timeout=CLIENT_TIMEOUT_S, max_inflight=4096, seed=1, client=CLIENT)


def soak(args: argparse.Namespace) -> tuple[str, str]:
    seconds = args.soak_minutes * 60.0
    phase_s = min(PHASE_S, seconds / 4)
    reference_s = min(60.0, seconds / 2)
    target = args.target_latency_ms
    out = args.out / "soak"
    flags = ["--target-latency-ms", f"{target:g}", "--log-level", "warning"]
    with servers.running(_spec(args, "soak", flags), out / "logs", args.ready_timeout) as srv:
        capacity = _run(srv.url, capacity_probe(), "capacity", out).achieved_rps
        idle_fds = settled_fds(srv.proc.pid)
        malloc = allocator_of(srv.proc.pid)
        rates = (round(LOW * capacity, 1), round(HIGH * capacity, 1))
        scenario = alternating(rates, phase_s, seconds)
        with Sampler(srv.proc.pid) as sampler:
            result = run_async(Runner(Target(srv.url), scenario).run("soak"))
        write_outputs(result, out / "alternate", plots=False)
        after_fds = settled_fds(srv.proc.pid, at_most=idle_fds)
        rss_idle = usage(srv.proc.pid)[0]
    steps = result.steps
    statuses: dict[str, int] = {}
    for st in steps:
        for k, v in st.by_status.items():
            statuses[k] = statuses.get(k, 0) + v
    total = sum(statuses.values())
    bare = sum(st.refusals_without_retry_after for st in steps)
    lost = sum(v for k, v in statuses.items() if not k.isdigit())  # reset, client timeout, bad body
    unwelcome = sum(v for k, v in statuses.items() if k.isdigit() and k not in ANSWERED) + bare
    worst = max((st.latency.p99_ms for st in steps if st.latency), default=float("nan"))
    memory = Memory.of(sampler, reference_s)
    peak_fds = max(s[2] for s in sampler.samples)
    by_status = ", ".join(f"{k}×{v:,}" for k, v in sorted(statuses.items()))
    checks = [
        ["requests without an HTTP answer (reset, client timeout, malformed)", "0", f"{lost:,} of {total:,}",
         _met(lost == 0)],
        ["answers other than 200, or 429/503 with Retry-After", "0",
         f"{unwelcome:,} ({by_status}; {bare} refusals without Retry-After)", _met(unwelcome == 0)],
        ["p99 of admitted requests, worst phase", f"≤ {target:g} ms", f"{worst:,.1f} ms",
         _met(worst <= target)],
        *memory.checks(),
        ["open descriptors after the load ÷ idle", "back to idle",
         f"{after_fds} ÷ {idle_fds} (peak {peak_fds})", _met(after_fds <= idle_fds)],
    ]
    body = (
        f"Capacity = closed-loop throughput at 64 clients: **{capacity:.1f} req/s**. Then "
        f"{args.soak_minutes:g} min of open-loop Poisson arrivals alternating {rates[0]:g} and {rates[1]:g} "
        f"req/s ({LOW:g}× and {HIGH:g}× capacity) every {phase_s:g} s, mix `short`, against "
        f"`--target-latency-ms {target:g}`; latency from scheduled send time (the generator's lag, how "
        "late it sent, is part of it); the server's memory and "
        f"descriptors sampled every second (`loadtests/bench_soak.py`); the server runs on {malloc} "
        f"(default flags; `--allocator`), and held {rss_idle / 2**20:,.0f} MiB idle after the load. "
        f"Generator: {result.generator.note}."
        "\n\n"
        + markdown_table(["figure", "target", "measured", ""], checks)
        + "\n\n"
        + markdown_table(["phase", "offered/s", "achieved/s", "p50 ms", "p99 ms", "slowest 1%: queue ms",
                          "slowest 1%: forward ms", "slowest 1%: due in the phase's first second",
                          "forward ms, all admitted", "admitted", "refused", "generator lag p99 ms"],
                         [_phase_row(st) for st in steps])
        + "\n"
    )
    return f"Soak: {args.soak_minutes:g} minutes alternating {LOW:g}× and {HIGH:g}× capacity (CPU)", body
