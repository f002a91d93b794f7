"""A scenario (mode, load, mix) run against one URL: steps, metric scrapes, and the figures of each step."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import msgspec
from coalesce.loadtests import engine, promtext, schedule
from coalesce.loadtests.planner import holds, sustained_step
from coalesce.loadtests.progress import Progress
from coalesce.loadtests.rawclient import RawClient
from coalesce.loadtests.results import BatchStats, GeneratorStats, RunResult, StepResult, Tail
from coalesce.loadtests.stats import cost, summarize, timeline
from coalesce.loadtests.workload import (
    Mix,
    Payload,
    PayloadFactory,
    PayloadStream,
    TextSource,
    TraceEntry,
    read_trace,
    write_trace,
)

# The generator counts as the bottleneck past these: its loop was this late, or its core this busy.
LAG_LIMIT_MS = 5.0
CPU_LIMIT = 0.9


class Mode(StrEnum):
    OPEN = "open"  # Poisson arrivals at --rate
    CLOSED = "closed"  # --concurrency clients back to back
    BURST = "burst"  # Poisson at --rate for --burst-on s, then --burst-base-rate for --burst-off s
    RAMP = "ramp"  # open-loop steps from --rate up by --ramp-step until the p99 target breaks
    REPLAY = "replay"  # arrivals and lengths from a JSONL trace
    ALTERNATE = "alternate"  # Poisson at each of --rates in turn, --step-duration s each, one step per phase


class Scenario(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything that decides what load a run offers; saved with its results."""

    mode: Mode = Mode.OPEN
    rate: float = 10.0
    concurrency: int = 32
    duration: float = 30.0
    warmup: float = 2.0
    burst_on: float = 5.0
    burst_off: float = 5.0
    burst_base_rate: float = 0.0
    ramp_step: float | None = None  # default: the starting rate
    max_rate: float = 10_000.0
    step_duration: float = 10.0
    rates: tuple[float, ...] = ()  # alternate: the phases' rates, cycled
    p99_ms: float | None = None
    max_error_rate: float = 0.01
    trace: str | None = None
    speed: float = 1.0
    mix: Mix = Mix.SHORT
    inputs_per_request: int | None = None
    text_file: str | None = None
    encoding_format: str = "base64"
    timeout: float = 60.0
    max_inflight: int = 1024
    # The HTTP client: "aiohttp", or "raw" (``rawclient``: a fraction of aiohttp's CPU per request, for
    # machines where the generator shares the server's cores).
    client: Literal["aiohttp", "raw"] = "aiohttp"
    repeat: float = 0.0  # share of requests that resend an earlier request's body (a cache's hits)
    seed: int = 0
    cost_per_hour: float | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """A server under test. ``metrics_url``: "" derives ``/metrics`` from ``url``; None skips scraping."""

    url: str
    model: str | None = None
    metrics_url: str | None = ""


def metrics_url_for(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


class _ModelEntry(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_ModelEntry]


async def discover_model(session: aiohttp.ClientSession, url: str) -> str | None:
    """The first model the server lists at ``/v1/models`` or ``/models``, if it has such a route."""
    parts = urlsplit(url)
    for path in ("/v1/models", "/models"):
        try:
            async with session.get(urlunsplit((parts.scheme, parts.netloc, path, "", ""))) as resp:
                if resp.status == 200:
                    listed = msgspec.json.decode(await resp.read(), type=_ModelList)
                    if listed.data:
                        return listed.data[0].id
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return None


def summarize_step(
    rec: engine.Recorder,
    *,
    label: str,
    mode: str,
    window: tuple[float, float],
    offered_rps: float | None,
    concurrency: int | None,
    batch: BatchStats | None = None,
    cost_per_hour: float | None = None,
) -> StepResult:
    """The figures of the requests due in ``window`` (offsets from the step's start, end exclusive).

    Latency runs from the scheduled send time to the response, so queueing anywhere shows. Achieved
    throughput is good responses over the window, or over the time from its start to the last response
    when that is longer: a backlog the server leaves behind counts as part of the time it took.
    """
    start, end = window
    idx = [i for i, t in enumerate(rec.sched) if start <= t < end]
    ok_idx = [i for i in idx if rec.status[i] == 200]
    bare_refusals = sum(1 for i in idx if rec.status[i] in (429, 503) and not rec.retry_after[i])
    by_status = Counter(engine.status_name(rec.status[i]) for i in idx)
    last_done = max((rec.done[i] for i in idx), default=end)
    span = max(last_done, end) - start
    inputs_ok = sum(rec.n_inputs[i] for i in ok_idx)
    achieved = len(ok_idx) / span if span > 0 else 0.0
    achieved_inputs = inputs_ok / span if span > 0 else 0.0

    def header_mean(values: list[float]) -> float | None:
        vals = [values[i] for i in ok_idx if not math.isnan(values[i])]
        return sum(vals) / len(vals) if vals else None

    latency = summarize(rec.done[i] - rec.sched[i] for i in ok_idx)

    return StepResult(
        label=label,
        mode=mode,
        offered_rps=offered_rps,
        concurrency=concurrency,
        duration_s=end - start,
        requests=len(idx),
        ok=len(ok_idx),
        by_status=dict(sorted(by_status.items())),
        error_rate=(len(idx) - len(ok_idx)) / len(idx) if idx else 0.0,
        achieved_rps=achieved,
        achieved_inputs_per_s=achieved_inputs,
        mean_inputs_per_request=sum(rec.n_inputs[i] for i in idx) / len(idx) if idx else 0.0,
        latency=latency,
        send_lag=summarize(max(0.0, rec.started[i] - rec.sched[i]) for i in idx)
        if offered_rps is not None
        else None,
        header_queue_ms=header_mean(rec.queue_ms),
        header_inference_ms=header_mean(rec.infer_ms),
        batch=batch,
        cost=cost(cost_per_hour, achieved, achieved_inputs) if cost_per_hour is not None else None,
        refusals_without_retry_after=bare_refusals,
        tail=tail(rec, ok_idx, latency.p99_ms, start) if latency is not None else None,
        timeline=timeline(
            [rec.sched[i] for i in idx],
            [rec.done[i] - rec.sched[i] for i in idx],
            [rec.status[i] == 200 for i in idx],
            start,
            end - start,
        ),
    )


def tail(rec: engine.Recorder, ok_idx: Sequence[int], p99_ms: float, start: float) -> Tail | None:
    """:class:`Tail` of the good responses ``ok_idx`` whose latency is at least ``p99_ms``, among those
    that carried the server's timings (None if none did); ``start``: the step's start (offset)."""
    rows = []
    first_s = 0
    for i in ok_idx:
        latency_ms = (rec.done[i] - rec.sched[i]) * 1e3
        queue_ms, forward_ms = rec.queue_ms[i], rec.infer_ms[i]
        if latency_ms >= p99_ms and not (math.isnan(queue_ms) or math.isnan(forward_ms)):
            rows.append((latency_ms, queue_ms, forward_ms))
            first_s += rec.sched[i] - start < 1.0
    if not rows:
        return None
    n = len(rows)
    latency_ms, queue_ms, forward_ms = (sum(column) / n for column in zip(*rows, strict=True))
    return Tail(n, latency_ms, queue_ms, forward_ms, latency_ms - queue_ms - forward_ms, first_s)


class Runner:
    """Runs one scenario against one target; owns the client sessions for the run."""

    def __init__(self, target: Target, scenario: Scenario, progress: Progress | None = None) -> None:
        self.target = target
        self.s = scenario
        self.progress = progress or Progress(enabled=False)
        self.rng = random.Random(scenario.seed)
        self.model = target.model or ""
        self._offered: list[tuple[float, Payload]] = []  # what was sent when, for --save-trace
        self._elapsed = 0.0  # start of the current step, from the start of the first
        self._trace: list[TraceEntry] = []  # replay only

    def save_trace(self, path: Path) -> None:
        """Write what this run offered as a JSONL trace that ``--mode replay`` plays back."""
        write_trace(
            path,
            [
                TraceEntry(t=round(t, 6), inputs=p.n_inputs, lengths=list(p.lengths))
                for t, p in sorted(self._offered, key=lambda x: x[0])
            ],
        )

    async def run(self, label: str = "") -> RunResult:
        s = self.s
        limit = s.concurrency if s.mode is Mode.CLOSED else s.max_inflight
        cpu0, wall0 = time.process_time(), time.perf_counter()
        side_timeout = aiohttp.ClientTimeout(total=10)  # model discovery and metric scrapes
        async with (
            engine.make_session(limit, s.timeout) as session,
            aiohttp.ClientSession(timeout=side_timeout) as side,
        ):
            if not self.model:
                self.model = await discover_model(side, self.target.url) or "default"
            payloads = self._payloads()
            client: engine.Sender
            if s.client == "raw":
                client = raw = RawClient(self.target.url, limit, s.timeout)
                try:
                    steps = await self._steps(client, side, payloads, label)
                finally:
                    await raw.close()
            else:
                client = engine.Client(session, self.target.url, limit)
                steps = await self._steps(client, side, payloads, label)
        cpu_util = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
        lag = max((st.send_lag.p99_ms for st in steps if st.send_lag), default=None)
        saturated = cpu_util >= CPU_LIMIT or (lag is not None and lag > LAG_LIMIT_MS)
        note = (
            f"generator busy (CPU {cpu_util:.0%} of a core, dispatch lag p99 {lag or 0:.1f} ms): "
            "the figures may understate the server"
            if saturated
            else f"generator not the bound (CPU {cpu_util:.0%} of a core, dispatch lag p99 {lag or 0:.1f} ms)"
        )
        sustained = sustained_step(steps, s.p99_ms, s.max_error_rate) if s.p99_ms is not None else None
        return RunResult(
            created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            command=list(sys.argv),
            url=self.target.url,
            model=self.model,
            mode=str(s.mode),
            scenario=msgspec.to_builtins(s),
            steps=steps,
            generator=GeneratorStats(cpu_util=cpu_util, send_lag_p99_ms=lag, saturated=saturated, note=note),
            slo_p99_ms=s.p99_ms,
            max_rps_within_slo=(sustained.offered_rps or sustained.achieved_rps) if sustained else None,
        )

    def _payloads(self) -> Callable[[int], Payload]:
        s = self.s
        source = TextSource.from_file(self.rng, Path(s.text_file)) if s.text_file else TextSource(self.rng)
        factory = PayloadFactory(source, self.model, s.encoding_format)
        if s.mode is Mode.REPLAY:
            assert s.trace is not None
            self._trace = read_trace(Path(s.trace))
            replay = [factory.for_lengths(e.lengths) for e in self._trace]
            return replay.__getitem__
        return PayloadStream(factory, s.mix, self.rng, s.inputs_per_request, s.repeat)

    async def _steps(
        self,
        client: engine.Sender,
        side: aiohttp.ClientSession,
        payloads: Callable[[int], Payload],
        label: str,
    ) -> list[StepResult]:
        s, rng = self.s, self.rng
        total = s.warmup + s.duration
        if s.mode is Mode.CLOSED:
            return [
                await self._step(client, side, payloads, label or f"closed c={s.concurrency}", None, total)
            ]
        if s.mode is Mode.OPEN:
            arrivals = self._poisson(s.rate, s.duration)
            return [await self._step(client, side, payloads, label or f"open {s.rate:g}/s", arrivals, total)]
        if s.mode is Mode.BURST:
            arrivals = schedule.burst_arrivals(s.rate, s.burst_on, s.burst_off, total, rng, s.burst_base_rate)
            return [await self._step(client, side, payloads, label or "burst", arrivals, total)]
        if s.mode is Mode.REPLAY:
            arrivals = schedule.trace_arrivals(self._trace, s.speed)
            end = (arrivals[-1] if arrivals else 0.0) + 1e-6
            return [await self._step(client, side, payloads, label or "replay", arrivals, max(end, s.warmup))]
        if s.mode is Mode.ALTERNATE:
            phases = schedule.alternating_windows(s.rates, s.step_duration, s.duration)
            arrivals = schedule.poisson_arrivals(s.rates[0], s.warmup, rng) + schedule.alternating_arrivals(
                s.rates, s.step_duration, s.duration, rng, start=s.warmup
            )
            windows = [
                (f"{label or 'phase'} {i + 1} {rate:g}/s", (s.warmup + a, s.warmup + b), rate)
                for i, (a, b, rate) in enumerate(phases)
            ]
            return await self._drive(client, side, payloads, label or "alternate", arrivals, total, windows)
        if s.p99_ms is None:
            raise ValueError("a ramp needs a p99 target (--p99-ms) to know when to stop")
        steps = []
        for rate in schedule.ramp_rates(s.rate, s.ramp_step or s.rate, s.max_rate):
            arrivals = self._poisson(rate, s.step_duration)
            name = f"{label} {rate:g}/s".strip()
            step = await self._step(client, side, payloads, name, arrivals, s.warmup + s.step_duration, rate)
            steps.append(step)
            if not holds(step, s.p99_ms, s.max_error_rate):
                break
        return steps

    def _poisson(self, rate: float, duration: float) -> list[float]:
        """Warm-up and measured window drawn apart, so the window holds exactly ``rate × duration``."""
        warm = schedule.poisson_arrivals(rate, self.s.warmup, self.rng)
        return warm + schedule.poisson_arrivals(rate, duration, self.rng, start=self.s.warmup)

    async def _step(
        self,
        client: engine.Sender,
        side: aiohttp.ClientSession,
        payloads: Callable[[int], Payload],
        label: str,
        arrivals: list[float] | None,
        total: float,
        rate: float | None = None,
    ) -> StepResult:
        """One measured step: ``arrivals`` (open loop) or closed-loop clients, for ``total`` seconds."""
        window = (self.s.warmup, total)
        if arrivals is not None and rate is None:
            if self.s.mode is Mode.OPEN:
                rate = self.s.rate
            else:  # bursts and traces: the mean offered rate over the window
                rate = sum(1 for t in arrivals if window[0] <= t < window[1]) / max(1e-9, total - window[0])
        return (await self._drive(client, side, payloads, label, arrivals, total, [(label, window, rate)]))[0]

    async def _drive(
        self,
        client: engine.Sender,
        side: aiohttp.ClientSession,
        payloads: Callable[[int], Payload],
        label: str,
        arrivals: list[float] | None,
        total: float,
        windows: list[tuple[str, tuple[float, float], float | None]],
    ) -> list[StepResult]:
        """Offer one continuous load for ``total`` seconds and summarise each of ``windows`` (label,
        (start, end) offsets, offered rate; consecutive), the server's metrics scraped at each start and
        once the load is over."""
        s = self.s
        loop = asyncio.get_running_loop()
        rec = engine.Recorder()
        if arrivals is not None:
            # Open loop: every body is made before the clock starts (the same ones, in the same order,
            # as made on the fly), so making them is not CPU the generator takes from the server.
            ready = [payloads(i) for i in range(len(arrivals))]
            payloads = ready.__getitem__
        murl = metrics_url_for(self.target.url) if self.target.metrics_url == "" else self.target.metrics_url
        async with engine.collector_aside():  # (before the clock: its first collection takes a while)
            t0 = loop.time() + 0.05
            scrapes = [asyncio.create_task(self._scrape_at(side, murl, t0 + w[1][0])) for w in windows]
            elapsed = self._elapsed

            def offered(i: int) -> Payload:
                p = payloads(i)
                self._offered.append((elapsed + loop.time() - t0, p))
                return p

            async with self.progress.show(label, rec, t0, total):
                if arrivals is None:
                    await engine.run_closed(client, s.concurrency, total, offered, rec, t0)
                else:
                    await engine.run_open(client, arrivals, offered, rec, t0)
        self._elapsed += loop.time() - t0
        snaps = [await task for task in scrapes]
        snaps.append(await promtext.scrape(side, murl) if murl else None)
        steps = []
        for (name, window, rate), before, after in zip(windows, snaps, snaps[1:], strict=False):
            batch = None
            if before is not None and after is not None:
                batch = promtext.batch_stats(promtext.delta(before, after), self.model)
            steps.append(summarize_step(
                rec,
                label=name,
                mode=str(s.mode),
                window=window,
                offered_rps=rate,
                concurrency=s.concurrency if arrivals is None else None,
                batch=batch,
                cost_per_hour=s.cost_per_hour,
            ))
        return steps

    @staticmethod
    async def _scrape_at(
        side: aiohttp.ClientSession, url: str | None, when: float
    ) -> promtext.Snapshot | None:
        if url is None:
            return None
        await asyncio.sleep(max(0.0, when - asyncio.get_running_loop().time()))
        return await promtext.scrape(side, url)
