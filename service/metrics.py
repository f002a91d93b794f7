"""Prometheus metrics. One registry per app (so tests can run several), names under ``coalesce_``.

Per-model series carry the served name as ``model``. The gauges an autoscaler scales on are
``coalesce_queue_depth``, ``coalesce_queued_tokens`` and ``coalesce_inflight_requests``.

Under ``--workers`` (``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client is imported) every
process writes its series to that directory and ``render`` aggregates all of them, so one scrape of
any worker describes the replica: counters and histograms add up, and each gauge says how its workers'
values combine (``multiprocess_mode``; ignored in a single process).

Written in bulk, at most every :data:`FLUSH_S`: the answered requests and those in flight, a batcher's
per-batch series and gauges (:class:`BatchTally`); ``render`` writes what is pending first, so a scrape
of one process reads every request and batch so far, and under ``--workers`` each process's series reach
the shared files at most :data:`FLUSH_S` late.

Resident memory: one process exports prometheus_client's ``process_*`` series
(``process_resident_memory_bytes`` among them); under ``--workers`` the scrape reads each process's
from /proc, ``process_resident_memory_bytes{process="supervisor"|"engine"|"gateway-N"}``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import values as _values
from prometheus_client.core import GaugeMetricFamily, Metric

# X-Priority's classes by their index in the scheduler (0 is served first).
PRIORITY_NAMES = ("high", "normal", "low")
# In the multiprocess directory: the replica's processes, "PID NAME" a line (written by the supervisor).
PROCESSES_FILE = "processes"

# The *_created series double the exposition for no use of ours.
disable_created_metrics()

# Under --workers every write to a series first asks the kernel for this process's id (a fork would
# need new files): prometheus_client's default identifier is os.getpid, a system call per counter
# increment, histogram bucket and gauge set, a dozen per batch in the engine. The id is asked once here
# and again in a forked child, the one event that changes it (``process_identifier`` is
# prometheus_client's own hook for this).
_pid = os.getpid()


def _process_id() -> int:
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
if isinstance(_values.ValueClass, type) and getattr(_values.ValueClass, "_multiprocess", False):
    _values.ValueClass = _values.MultiProcessValue(process_identifier=_process_id)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """One model's labelled series, resolved once: ``labels()`` takes a lock and builds a key on every
    call, which the batcher would otherwise pay a dozen times per batch."""

    queue_depth: Gauge
    queued_tokens: Gauge
    queue_standing: Gauge
    queue_wait: tuple[Histogram, ...]  # indexed by priority class: high, normal, low
    cost_overhead: Gauge
    cost_per_token: Gauge
    cost_spread: Gauge
    cost_run_spread: Gauge
    batch_size: Histogram
    batch_tokens: Histogram
    padding_ratio: Histogram
    forward_seconds: Histogram
    batches: Counter
    batch_failures: Counter
    inputs: Counter
    tokens: Counter
    cache_hits: Counter
    cache_misses: Counter
    deduplicated: Counter


# How long a batcher's per-batch series may wait to be written (BatchTally). A scrape of one process
# writes them first; under --workers a scrape reads the engine's files, at most this much behind.
FLUSH_S = 0.05


class _Bins:
    """One histogram's observations not yet written: a count per bucket, how many, and their sum."""

    __slots__ = ("bounds", "counts", "hist", "n", "total")

    def __init__(self, hist: Histogram) -> None:
        self.hist = hist
        self.bounds: list[float] = hist._upper_bounds  # observe()'s own bounds (+Inf last)
        self.counts = [0] * len(self.bounds)
        self.n = 0
        self.total = 0.0

    def add(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # the first bound >= amount, as observe()
        self.n += 1
        self.total += amount

    def write(self) -> None:
        if not self.n:
            return
        hist, counts = self.hist, self.counts
        hist._sum.inc(self.total)
        for i, n in enumerate(counts):
            if n:
                hist._buckets[i].inc(n)
                counts[i] = 0
        self.n, self.total = 0, 0.0


def observe_all(hist: Histogram, amounts: Iterable[float]) -> None:
    """``hist.observe(a)`` for every one of ``amounts``, in one write per bucket they fall in and one for
    their sum. Under ``--workers`` a write is a locked write to a shared file (and a ``getpid``), so a
    turn's requests cost a write or two, not two each. (prometheus_client has no bulk observe: this reads
    the histogram's own bounds and values, as its ``observe`` does.)"""
    bins = _Bins(hist)
    for amount in amounts:
        bins.add(amount)
    bins.write()


class BatchTally:
    """A model's per-batch series (batches, inputs, tokens; batch size, padded tokens, padding, forward
    time; each input's queue wait by priority) counted in plain Python and written to prometheus_client,
    with the owner's gauges (``publish``), at most every :data:`FLUSH_S` and whenever the registry is
    rendered. Under ``--workers`` every write is a locked write to a shared file, a dozen and more a
    batch; counted here a batch costs a few list increments, and the files are written 20 times a second
    at most. A histogram's scrape reads the same as if each value had been observed when it happened."""

    def __init__(self, metrics: Metrics, series: ModelSeries, publish: Callable[[], None] | None = None
                 ) -> None:
        self._series = series
        self._publish = publish  # the owner's gauges, set as they stand whenever the tally is written
        self._size, self._padded, self._padding, self._forward = (
            _Bins(h) for h in (series.batch_size, series.batch_tokens, series.padding_ratio,
                               series.forward_seconds)
        )
        self._waits = tuple(_Bins(h) for h in series.queue_wait)  # by priority class
        self._batches = self._inputs = self._tokens = 0
        self._timer: asyncio.TimerHandle | None = None
        metrics._tallies.add(self)

    def batch(self, size: int, tokens: int, padded: int, padding: float, forward_s: float) -> None:
        """One batch of ``size`` inputs, ``tokens`` real tokens padded to ``padded`` (``padding`` of them
        padding, a share), run in ``forward_s``."""
        self._batches += 1
        self._inputs += size
        self._tokens += tokens
        self._size.add(size)
        self._padded.add(padded)
        self._padding.add(padding)
        self._forward.add(forward_s)
        if self._timer is None:
            self.touch()

    def touch(self) -> None:
        """Something to write (the owner's gauges may have moved): written within :data:`FLUSH_S`."""
        if self._timer is None:
            with contextlib.suppress(RuntimeError):  # no loop to wait on: written when rendered
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def waited(self, priority: int, seconds: Iterable[float]) -> None:
        """Inputs of priority class ``priority`` that waited ``seconds`` each (counted with :meth:`batch`)."""
        add = self._waits[priority].add
        for s in seconds:
            add(s)

    def flush(self) -> None:
        """Write what was counted since the last write."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._batches:
            m = self._series
            m.batches.inc(self._batches)
            m.inputs.inc(self._inputs)
            m.tokens.inc(self._tokens)
            self._batches = self._inputs = self._tokens = 0
        for bins in (self._size, self._padded, self._padding, self._forward, *self._waits):
            bins.write()
        if self._publish is not None:
            self._publish()


class Metrics:
    """Every series the service exports, on its own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # The directory ``--workers`` share their series through (prometheus_client chose its value
        # storage from it at import); None in a single process.
        self.multiprocess_dir: str | None = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        if self.multiprocess_dir is None:
            # process_resident_memory_bytes, CPU seconds, descriptors, start time: this process is the
            # replica. Under --workers, render() reports each process's resident memory instead.
            ProcessCollector(registry=r)
        # Admission and queue.
        self.queue_depth = Gauge(
            "coalesce_queue_depth", "Inputs waiting to be batched.", ["model"],
            multiprocess_mode="livesum", registry=r
        )
        self.queued_tokens = Gauge(
            "coalesce_queued_tokens", "Tokens waiting to be batched.", ["model"],
            multiprocess_mode="livesum", registry=r
        )
        self.queue_standing = Gauge(
            "coalesce_queue_standing",
            "1 while the queue stands (its oldest input older than the queue target for a whole interval: "
            "only what finishes within the latency target is admitted), 0 while it keeps emptying (bursts "
            "admitted).",
            ["model"], multiprocess_mode="livemax", registry=r
        )
        self.inflight = Gauge(
            "coalesce_inflight_requests", "Requests being handled right now.",
            multiprocess_mode="livesum", registry=r,
        )
        self.queue_wait = Histogram(
            "coalesce_queue_wait_seconds",
            "Time from a request's head arriving to its input's batch starting (the wait before admission "
            "included), by priority class (X-Priority).",
            ["model", "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "coalesce_rejected_total",
            "Requests refused or shed before compute, by reason (queue_full, overloaded, late, "
            "tenant_queue_full, deadline_unmeetable, expired, cancelled, too_large).",
            ["model", "reason"],
            registry=r,
        )
        self.tenant_queued_tokens = Gauge(
            "coalesce_tenant_queued_tokens", "Tokens waiting, per tenant.", ["model", "tenant"],
            multiprocess_mode="livesum", registry=r
        )
        # The cost model the batcher sizes batches with: seconds = overhead + per_token × padded tokens.
        self.cost_overhead = Gauge(
            "coalesce_cost_overhead_seconds",
            "Fixed cost of one forward: the fit, at the pace forwards run now.", ["model"],
            multiprocess_mode="livemax", registry=r
        )
        self.cost_per_token = Gauge(
            "coalesce_cost_per_token_seconds",
            "Cost of one padded token: the fit, at the pace forwards run now.", ["model"],
            multiprocess_mode="livemax", registry=r
        )
        self.cost_spread = Gauge(
            "coalesce_cost_spread",
            "How far the slow forwards run past the typical one (95th percentile over median of measured "
            "over fitted seconds, >= 1): a standing queue promises by a forward this much slower.", ["model"],
            multiprocess_mode="livemax", registry=r
        )
        self.cost_run_spread = Gauge(
            "coalesce_cost_run_spread",
            "The same, of three forwards in a row (1 to the spread): a standing queue promises its wait, the "
            "batches ahead, by a run this much slower.", ["model"],
            multiprocess_mode="livemax", registry=r
        )
        # Batches.
        self.batch_size = Histogram(
            "coalesce_batch_size", "Inputs per batch.", ["model"], buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "coalesce_batch_tokens",
            "Padded tokens per batch (what the forward costs).",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.padding_ratio = Histogram(
            "coalesce_batch_padding_ratio",
            "Share of a batch's padded tokens that are padding.",
            ["model"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "coalesce_forward_seconds",
            "Model time per batch (prepare excluded).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batches = Counter("coalesce_batches_total", "Batches run.", ["model"], registry=r)
        self.batch_failures = Counter(
            "coalesce_batch_failures_total", "Batches whose forward raised.", ["model"], registry=r
        )
        self.inputs = Counter("coalesce_inputs_total", "Inputs computed.", ["model"], registry=r)
        self.tokens = Counter(
            "coalesce_tokens_total", "Real (unpadded) tokens computed.", ["model"], registry=r
        )
        # The result cache in front of the queue, and identical inputs computed once.
        self.cache_hits = Counter(
            "coalesce_cache_hits_total", "Inputs answered from the result cache.", ["model"], registry=r
        )
        self.cache_misses = Counter(
            "coalesce_cache_misses_total", "Inputs looked up in the result cache and not found.", ["model"],
            registry=r,
        )
        self.cache_bytes = Gauge(
            "coalesce_cache_bytes", "Bytes held by the result cache (all models).",
            multiprocess_mode="livesum", registry=r,
        )
        self.deduplicated = Counter(
            "coalesce_deduplicated_inputs_total",
            "Inputs identical to one already queued or running, computed once for every caller.",
            ["model"], registry=r,
        )
        # Requests.
        self.requests = Counter(
            "coalesce_requests_total", "HTTP requests by route and status.", ["route", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "coalesce_request_duration_seconds",
            "Time from request received to response ready.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._request_series: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self._answered: list[tuple[str, int, float]] = []  # this event-loop turn's, not yet counted
        self._in_flight = 0  # this turn's requests started less those ended, not yet written
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # the loop that will count them
        self._tallies: weakref.WeakSet[BatchTally] = weakref.WeakSet()  # written first by render()
        # Connections (gateway/guard.py): what hostile or broken clients cost, and what they were told.
        self.open_connections = Gauge(
            "coalesce_open_connections", "Client connections open now (those refused over the cap excluded).",
            multiprocess_mode="livesum", registry=r,
        )
        self.connections_refused = Counter(
            "coalesce_connections_refused_total",
            "Connections and requests cut off before reaching a route, by reason: over_capacity, "
            "header_timeout, body_timeout, headers_too_large, malformed.",
            ["reason"], registry=r,
        )
        # CUDA graphs (graph runner only): a snapshot of the runner's capture statistics at each scrape.
        self.graph_capture_seconds = Gauge(
            "coalesce_graph_capture_seconds", "Time spent capturing CUDA graphs (start-up and lazy).",
            ["model"], multiprocess_mode="livemax", registry=r,
        )
        self.graph_bytes = Gauge(
            "coalesce_graph_memory_bytes", "Device memory held by captured graphs.", ["model"],
            multiprocess_mode="livesum", registry=r
        )
        self.graph_cells = Gauge(
            "coalesce_graph_cells", "Cells of the graph grid, by state.", ["model", "state"],
            multiprocess_mode="livemax", registry=r
        )
        self.graph_batches = Gauge(
            "coalesce_graph_batches", "Batches served so far, by path (graph replay or eager).",
            ["model", "path"], multiprocess_mode="livesum", registry=r,
        )
        self.forward_threads = Gauge(
            "coalesce_forward_threads",
            "Threads the CPU forward runs on: one fewer than it may while the event loop is busy more "
            "than --loop-core-share of the time, as of the last batch (absent on a GPU and the torch-free "
            "backends).",
            multiprocess_mode="livemax", registry=r,
        )
        # Lifecycle.
        self.ready = Gauge(
            "coalesce_ready", "1 once models are loaded and warmed, 0 while starting or draining.",
            multiprocess_mode="livemin", registry=r
        )
        self.startup_seconds = Gauge(
            "coalesce_startup_seconds",
            "Seconds from process start to ready, by phase.",
            ["phase"],
            multiprocess_mode="livemax", registry=r,
        )

    def model_series(self, model: str) -> ModelSeries:
        """The per-model series of ``model``, resolved for the batcher's hot path."""
        fields: dict[str, object] = {
            name: getattr(self, name).labels(model)
            for name in ModelSeries.__dataclass_fields__
            if name != "queue_wait"
        }
        waits = tuple(self.queue_wait.labels(model, cls) for cls in PRIORITY_NAMES)
        return ModelSeries(queue_wait=waits, **fields)  # type: ignore[arg-type]

    def request_started(self) -> None:
        """Count one request in flight (``coalesce_inflight_requests``) until :meth:`request_done` with
        ``started``. On an event loop the starts and ends are written together with the answered requests
        (:meth:`request_done`), as their net change: one locked write or none a flush, not two a request
        (under ``--workers``, each a write to the gauge's shared file)."""
        if self._deferred():
            self._in_flight += 1
        else:
            self.inflight.inc()

    def request_done(self, route: str, status: int, seconds: float, *, started: bool = False) -> None:
        """Count one answered request (``route`` is a canonical route, so the key set stays small);
        ``started``: one :meth:`request_started` counted, no longer in flight.

        On an event loop the requests answered within :data:`FLUSH_S` are counted together (a scrape
        of this process sees them all: ``render`` counts what is left first; under ``--workers`` one
        reading another process's files reads them at most that much behind, as the batchers' series):
        one locked write per series and bucket per flush instead of three or four per request. (Written
        at each turn's end, as they were, the histogram's buckets were still a write each per turn: a
        request's most costly metric on a saturated gateway, of a few requests a turn.)"""
        if not self._deferred():
            if started:
                self.inflight.dec()
            self._count_answered([(route, status, seconds)])
            return
        if started:
            self._in_flight -= 1
        self._answered.append((route, status, seconds))

    def _deferred(self) -> bool:
        """Whether what is counted now is written later, on the running event loop, within
        :data:`FLUSH_S` (False: no loop runs; write it at once)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: at once
            loop = None
        if loop is not self._flush_loop or loop is None:
            if self._answered or self._in_flight:  # left by a loop that ended before its turn did
                self._flush_answered()
            if loop is None:
                return False
            self._flush_loop = loop
            loop.call_later(FLUSH_S, self._flush_answered)
        return True

    def _flush_answered(self) -> None:
        answered, self._answered = self._answered, []
        in_flight, self._in_flight = self._in_flight, 0
        self._flush_loop = None
        if in_flight:
            self.inflight.inc(in_flight)
        if answered:
            self._count_answered(answered)

    def _count_answered(self, answered: list[tuple[str, int, float]]) -> None:
        if len(answered) == 1:
            route, status, seconds = answered[0]
            series = self._series_of(route, status)
            series[0].inc()
            series[1].observe(seconds)
            return
        by_key: dict[tuple[str, int], list[float]] = {}
        for route, status, seconds in answered:
            got = by_key.get((route, status))
            if got is None:
                by_key[route, status] = [seconds]
            else:
                got.append(seconds)
        for (route, status), times in by_key.items():
            series = self._series_of(route, status)
            series[0].inc(len(times))
            observe_all(series[1], times)

    def _series_of(self, route: str, status: int) -> tuple[Counter, Histogram]:
        key = (route, status)
        series = self._request_series.get(key)
        if series is None:
            series = self._request_series[key] = (
                self.requests.labels(route, str(status)),
                self.request_seconds.labels(route),
            )
        return series

    def record_capture(self, model: str, stats: object) -> None:
        """Copy a graph runner's ``CaptureStats`` (plain attributes) into the gauges."""
        get = lambda name: float(getattr(stats, name, 0) or 0)  # noqa: E731
        self.graph_capture_seconds.labels(model).set(get("seconds"))
        self.graph_bytes.labels(model).set(get("bytes"))
        for state, attr in (("planned", "cells_planned"), ("captured", "cells_captured"),
                            ("over_memory", "cells_over_memory"), ("failed", "capture_failures")):
            self.graph_cells.labels(model, state).set(get(attr))
        self.graph_batches.labels(model, "graph").set(get("graph_replays"))
        self.graph_batches.labels(model, "eager").set(get("eager_runs"))

    def flush(self) -> None:
        """Write every series counted but not yet written (the turn's answered requests, the batchers'
        tallies): what a scrape of this process reads first."""
        if self._answered or self._in_flight:
            self._flush_answered()
        for tally in list(self._tallies):
            tally.flush()

    def render(self) -> bytes:
        self.flush()
        path = self.multiprocess_dir
        if path is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        merged.register(_ReplicaSeries(path))
        merged.register(_ReplicaMemory(path))
        return generate_latest(merged)


def write_processes(directory: str, processes: Mapping[int, str]) -> None:
    """Name the replica's processes (pid → supervisor, engine, gateway-N) for :class:`_ReplicaMemory`."""
    tmp = Path(directory, PROCESSES_FILE + ".tmp")
    tmp.write_text("".join(f"{pid} {name}\n" for pid, name in processes.items()))
    tmp.replace(Path(directory, PROCESSES_FILE))  # a scrape reads the whole list or none of it


def resident_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (``/proc/PID/statm``), or None once it has exited."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


class _ReplicaSeries:
    """Every process's series of a ``--workers`` replica, read from their files in ``directory`` and added
    up as prometheus_client's ``MultiProcessCollector`` does, except that a file with nothing in it yet
    is skipped. prometheus_client (0.26) creates a process's series file empty and sizes it a moment
    later; its collector read such a file as corrupt and failed the whole scrape (a 500 from /metrics,
    seen while a replica's processes start and make their first series), and every scrape after it
    when the process died in between, its empty file left behind (prometheus/client_python#1199, open).
    An empty file holds no samples: skipping it loses none."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = []
        for entry in os.scandir(self._directory):
            if not entry.name.endswith(".db"):
                continue
            try:
                if entry.stat().st_size > 0:
                    files.append(entry.path)
            except FileNotFoundError:  # (a live gauge's file, removed as its process was marked dead)
                continue
        return MultiProcessCollector.merge(files, accumulate=True)


class _ReplicaMemory:
    """``process_resident_memory_bytes{process}`` of every live process of a ``--workers`` replica, read at
    scrape time from /proc (a value each process wrote itself would be stale in an idle engine)."""

    def __init__(self, directory: str) -> None:
        self._file = Path(directory, PROCESSES_FILE)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory of each process of the replica, bytes.",
            labels=["process"],
        )
        try:
            lines = self._file.read_text().splitlines()
        except OSError:
            lines = []  # the supervisor has not named them yet
        for line in lines:
            pid, _, name = line.partition(" ")
            rss = resident_bytes(int(pid))
            if rss is not None:
                family.add_metric([name], rss)
        yield family
