"""The batcher: the asyncio shell around one model's :class:`Scheduler`.

Callers :meth:`Batcher.submit` a request and await the one future it returns, or — the engine process,
which answers gateways in bulk — :meth:`Batcher.enqueue` it with a reply to call. Either way the request
is a :class:`Ticket`. The scheduler decides (admission, order, batch size, shedding); the batcher's task
is the single owner of the scheduler, wakes on events (never polls), hands batches to the engine, and
answers every ticket once on every path: result, runner error (exactly the requests in that batch),
expiry, shedding, or shutdown; a ticket withdrawn (its caller left) is never answered, and its inputs
still waiting are dropped. A request is the scheduler's flow: its inputs are fairly interleaved with
other requests' rather than queued as one block.

Everything here runs on the event loop; the model runs on the worker's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, Protocol, cast

import msgspec
import numpy as np
from coalesce.kernels.protocol import OutputKind, is_raw, marks

from .. import tracing
from ..errors import CoalesceError, DeadlineExceeded, InferenceFailed, InvalidRequest, Overloaded, Unavailable
from ..logs import get_logger
from ..metrics import BatchTally, Metrics
from .cache import ResultCache
from .cost import CostModel
from .policy import padding_ratio
from .scheduler import DEFAULT_TENANT, PRIORITIES, Dispatch, Entry, Hold, Refusal, Scheduler, Wait

log = get_logger("coalesce.batcher")


class Output(Protocol):
    rows: np.ndarray
    prepare_s: float
    forward_s: float
    threads: int  # what its CPU forward ran on, where the engine sets that (else 0)


class Engine(Protocol):
    """What the batcher needs from a model worker (``coalesce.kernels.worker.ModelWorker`` fits)."""

    def start(self, batch: Sequence[Sequence[int]], kind: OutputKind,
              done: Callable[[Output | Exception], None]) -> None:
        """Run ``batch``; ``done`` gets its output or the exception it raised, on the event loop."""
        ...


class RequestResult(msgspec.Struct, eq=False):
    """What one request's caller gets: its rows (float32, C-contiguous), inputs in order, and the
    timings of its batches.

    Pooled: one row per input. Tokens: each input's ``len(ids)`` rows, one after the other (the caller
    knows its inputs' lengths, so it splits them). Read-only by convention. A msgspec Struct: one is built
    per request on the engine's loop, and a Struct is built in C where a dataclass runs a generated
    ``__init__`` of Python (a frozen one through ``object.__setattr__`` for every field);
    ``Submission`` and the fair queue's ``Entry`` likewise."""

    rows: np.ndarray  # (rows, width) float32
    queue_s: float  # the longest any of its inputs waited for a batch
    forward_s: float  # the longest forward among the batches its inputs rode in
    batches: tuple[bytes, ...] = ()  # with tracing on: the spans of those batches (``tracing.pack``)


Reply = Callable[[Hashable, "RequestResult | CoalesceError"], None]


class Submission(msgspec.Struct, eq=False):
    """One request of a message, for :meth:`Batcher.enqueue_many`: what :meth:`Batcher.enqueue` takes,
    ``tag`` what its reply is called with. (A msgspec Struct, as :class:`RequestResult`: the engine
    builds one per request.)"""

    seqs: Sequence[Sequence[int]]
    tag: Hashable
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    priority: int = 1
    deadline: float | None = None
    kind: OutputKind = OutputKind.POOLED
    arrived: float | None = None  # when its head arrived (time.monotonic()); None: now
    link: bytes | None = None
    # A plain query's one sequence as int32 bytes, when the sender has them at hand (the engine, from
    # the gateway's frame: ``messages.unpack_submit``), so its ``input_key`` is not packed again; b"": none.
    raw: bytes = b""
    held: Hold | None = None  # the hold its check before tokenising took (check_room), released on admission


class Ticket(msgspec.Struct, eq=False):
    """One request's inputs in flight: how it is answered, and the rows gathered so far.

    It is answered once, through ``reply(tag, outcome)`` on the event loop: with its rows when the last
    input's arrive, or with the first failure. ``submit`` makes ``reply`` resolve the caller's future;
    the engine process passes one that files the answer into its next message to the gateway, so a
    request costs no future and no callback. A ticket answered with a failure, or withdrawn, has its
    inputs still waiting swept from the queue, never computed. ``size`` inputs, ``left`` of them still to
    come (``size`` at first); ``total`` rows (``size`` for pooled output); ``starts`` (token output only)
    is where each input's rows begin in the request's rows; pooled inputs have one each. A Struct, as
    :class:`RequestResult`: one per request.
    """

    reply: Reply
    tag: Hashable
    size: int
    left: int
    total: int
    starts: list[int] | None = None
    link: bytes | None = None  # the request's sampled span (tracing on), which its batches' spans link
    done: bool = False  # answered, or withdrawn: nobody wants its rows any more
    batches: tuple[bytes, ...] = ()
    queue_s: float = 0.0
    forward_s: float = 0.0
    rows: np.ndarray | None = None

    def put(self, index: int, block: np.ndarray, queue_s: float, forward_s: float) -> None:
        """Input ``index`` of the request came out as ``block`` (its rows, a view of the batch's)."""
        if self.done:
            return
        if self.size == 1:
            self.rows = block  # the common one-input request: a view, no copy
        else:
            if self.rows is None:
                self.rows = np.empty((self.total, block.shape[1]), dtype=np.float32)
            start = index if self.starts is None else self.starts[index]
            self.rows[start : start + block.shape[0]] = block
        if queue_s > self.queue_s:
            self.queue_s = queue_s
        if forward_s > self.forward_s:
            self.forward_s = forward_s
        self.left -= 1
        if self.left == 0:
            self.done = True
            self.reply(self.tag, RequestResult(self.rows, self.queue_s, self.forward_s, self.batches))

    def fail(self, err: CoalesceError) -> bool:
        """Answer ``err`` unless answered already; True if inputs of it may still wait in the queue."""
        if self.done:
            return False
        self.done = True
        self.reply(self.tag, err)
        return self.left > 1


class _Work(Entry, kw_only=True, eq=False):
    """One distinct input waiting or running, and every (request, position) waiting for its row: the
    scheduler's queue entry itself (an :class:`Entry`, so an input costs one object here, not two; its
    ``deadline`` the latest of its waiters', its ``priority`` the first's).

    Identical inputs of requests that overlap in time are computed once: a later one joins the
    waiters of the work already queued (or running) instead of queueing again.
    """

    ids: Sequence[int]
    key: bytes
    waiters: list[tuple[Ticket, int]]

    def abandoned(self) -> bool:
        """Every request waiting for it has finished (failed, cancelled): nobody wants it now."""
        return all(job.done for job, _ in self.waiters)

    def put(self, block: np.ndarray, queue_s: float, forward_s: float) -> None:
        for job, index in self.waiters:
            job.put(index, block, queue_s, forward_s)

    def fail(self, err: CoalesceError) -> bool:
        """Answer every waiter ``err``; True if inputs of theirs may still wait in the queue."""
        rest = False
        for job, _ in self.waiters:
            rest |= job.fail(err)
        return rest


class _Wake:
    """The batcher's owner wakes: :meth:`set` runs ``step`` once on the loop soon, however often it is
    called before that run (a set during the run asks for another). It does what an ``asyncio.Event``
    awaited in a loop did, without the future, the task switch and the running-loop lookup (a system
    call on Python 3.11) of every wake: a batch's results, a new request, a timer each wake it.

    A step that raises ends :attr:`stopped` with its exception, and no step runs after that or after
    :meth:`stop`."""

    __slots__ = ("_due", "_loop", "_step", "stopped")

    def __init__(self, step: Callable[[], None]) -> None:
        self._step = step
        self._due = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Future[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.stopped = loop.create_future()
        if self._due:  # set before the start
            loop.call_soon(self._run)

    def set(self) -> None:
        if not self._due:
            self._due = True
            if self._loop is not None:
                self._loop.call_soon(self._run)

    def stop(self) -> None:
        """No step runs any more."""
        self._loop = None

    def _run(self) -> None:
        self._due = False
        if self._loop is None or self.stopped is None or self.stopped.done():
            return
        try:
            self._step()
        except BaseException as exc:  # a bug in a step stops the batcher (it refuses work from then)
            self.stopped.set_exception(exc)


_KINDS = {OutputKind.POOLED: 0, OutputKind.TOKENS: 1}
# The head of an unmarked sequence's key, by kind: (kind, b_start -1, pool_start 0, not raw).
_PLAIN_HEADS = {kind: array("i", (code, -1, 0, 0)).tobytes() for kind, code in _KINDS.items()}
_PLAIN_POOLED = _PLAIN_HEADS[OutputKind.POOLED]
_F32 = np.dtype(np.float32)


def input_key(ids: Sequence[int], kind: OutputKind = OutputKind.POOLED) -> bytes:
    """What decides an input's rows: the output asked for, its token ids, where a pair's segment B
    or pooling starts, and whether its row is normalised."""
    if type(ids) is list:  # unmarked (the common case): its head is a constant
        return _PLAIN_HEADS[kind] + array("i", ids).tobytes()
    return array("i", (_KINDS[kind], *marks(ids), is_raw(ids), *ids)).tobytes()


def _arrival(r: Submission, now: float) -> float:
    """When ``r``'s head arrived, as its wait is counted from (``now`` if unknown or later than ``now``):
    :meth:`Batcher.enqueue` and :meth:`Batcher.enqueue_many` alike."""
    return now if r.arrived is None or r.arrived > now else r.arrived


class Batcher:
    """Forms and dispatches batches for one model."""

    def __init__(
        self,
        engine: Engine,
        *,
        model: str,
        scheduler: Scheduler,
        metrics: Metrics,
        cache: ResultCache | None = None,
        device: str = "",
        shape: Callable[[int, int], tuple[int, int]] | None = None,
        on_forward: Callable[[CostModel, int, int, float], None] | None = None,
    ) -> None:
        self._engine = engine
        # Told of every batch that ran: (the cost model that observed it, the threads its CPU forward ran
        # on, its padded tokens, its seconds): the engine's thread chooser (engine/threads.py).
        self._on_forward = on_forward
        self.model = model
        # For the batch spans: where the model runs, and the (rows, cols) a batch of n sequences of at
        # most m tokens is padded to (a CUDA graph cell); n × m for runners that do not say.
        self.device = device
        self._shape = shape
        self.scheduler = scheduler
        self._metrics = metrics
        self._series = metrics.model_series(model)
        # The per-batch series and the queue's and cost model's gauges, written a few times a second.
        self._tally = BatchTally(metrics, self._series, publish=self._gauges)
        self._cache = cache if cache is not None and cache.capacity > 0 else None
        self._inflight: dict[bytes, _Work] = {}  # queued or running, by input key
        self._wake = _Wake(self._step)
        self._idle = asyncio.Event()
        self._idle.set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._sweep = False  # a job ended early (failed, cancelled): its waiting inputs must go
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._tenant_series: dict[str, int] = {}  # coalesce_tenant_queued_tokens as last set, by tenant
        self._queue_shown: tuple[int, int, bool] | None = None  # what the queue gauges last said
        self._coef_shown: object = None  # the cost coefficients the gauges last said

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._wake.start(loop)
        self._task = loop.create_task(self._run_loop(), name=f"batcher-{self.model}")
        self._task.add_done_callback(self._on_stopped)

    def _on_stopped(self, task: asyncio.Task[None]) -> None:
        # The owner task only ends by close(); if a bug ends it, refuse new work rather than queue it forever.
        self._closing = True
        if not task.cancelled() and task.exception() is not None:
            log.error("batcher_crashed", model=self.model, error=repr(task.exception()))

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; wait up to ``timeout`` s for admitted work to finish. True if it all did."""
        self._closing = True
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Stop the task; whatever is still waiting (after ``drain``) is answered 503."""
        self._closing = True
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # (a crash was logged when it ended)
            await self._task

    # -- admission -----------------------------------------------------------------------------------
    def check_room(
        self, tenant: str = DEFAULT_TENANT, *, weight: float = 1.0, priority: int = 1,
        arrived: float | None = None, first: int = 1, total: int = 1, inputs: int = 1, hold: bool = True,
    ) -> Hold:
        """Refuse at once, before any tokenising, a request of about ``total`` tokens in ``inputs``
        inputs (the first of about ``first``) that the queue bounds or the queue's regime would refuse,
        or any while the server is draining: a flood costs no CPU beyond this check. Estimates: err low.
        ``hold``: one that passes counts ahead of later ones until admitted (``Admitter.precheck``);
        the :class:`Hold` it returns goes with the request (``Submission.held``), whose admission ends
        it."""
        self._refuse_if_closing()
        now = time.monotonic()
        checked = self.scheduler.precheck(first, total, inputs, tenant, weight, priority,
                                          now if arrived is None else arrived, now, hold=hold)
        if isinstance(checked, Refusal):
            self._refused(checked.reason)
            raise refusal_error(checked, self.model)
        return checked

    def _refused(self, reason: str) -> None:
        """A request refused at admission: counted, and the queue's gauges written within the tally's
        period (admission observes the regime, and a refusal may be what turns it: with the forward busy
        and nothing joining the queue, no step would write ``coalesce_queue_standing`` until the batch
        ended)."""
        self._metrics.rejected.labels(self.model, reason).inc()
        self._tally.touch()

    def _refuse_if_closing(self) -> None:
        if self._closing:
            raise Unavailable(
                "The server is draining; retry on another replica.", retry_after=1, code="draining"
            )

    def submit(
        self,
        seqs: Sequence[Sequence[int]],
        *,
        tenant: str = DEFAULT_TENANT,
        weight: float = 1.0,
        priority: int = 1,
        deadline: float | None = None,
        kind: OutputKind = OutputKind.POOLED,
        arrived: float | None = None,
        link: bytes | None = None,
    ) -> asyncio.Future[RequestResult]:
        """Admit one request's inputs (complete id sequences), or raise why not before any work is done.

        The future resolves with every input's rows (of ``kind``), or with the first failure; cancelling
        it drops the inputs still waiting. Cached inputs are answered at once; an input identical to one
        already queued or running (of any request) waits for that one. ``deadline`` and ``arrived``
        (when the request's head arrived; its waits count from then) are on ``time.monotonic()``.
        ``link`` (tracing on): the request's span, which the spans of the batches computing it link.
        """
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        ticket = self.enqueue(seqs, partial(_resolve, future), None, tenant=tenant, weight=weight,
                              priority=priority, deadline=deadline, kind=kind, arrived=arrived, link=link)
        if not ticket.done:
            future.add_done_callback(partial(self.withdraw_if_cancelled, ticket))
        return future

    def withdraw_if_cancelled(self, ticket: Ticket, fut: asyncio.Future[RequestResult]) -> None:
        """A done callback for the future a ticket answers: a cancelled one withdraws the ticket."""
        if fut.cancelled():
            self.withdraw(ticket)

    def enqueue(
        self,
        seqs: Sequence[Sequence[int]],
        reply: Reply,
        tag: Hashable,
        *,
        tenant: str = DEFAULT_TENANT,
        weight: float = 1.0,
        priority: int = 1,
        deadline: float | None = None,
        kind: OutputKind = OutputKind.POOLED,
        arrived: float | None = None,
        link: bytes | None = None,
    ) -> Ticket:
        """:meth:`submit` without a future: the request is answered by ``reply(tag, outcome)`` (its
        :class:`RequestResult`, or the error that ended it), called once on the event loop — at once,
        before this returns, when every input is cached. :meth:`withdraw` the ticket to drop what has not
        run. Raises the refusal, as ``submit`` does. The engine process answers gateways this way, a
        message's requests at a time (:meth:`enqueue_many`)."""
        return self._enqueue(Submission(seqs, tag, tenant, weight, priority, deadline, kind, arrived, link),
                             reply)

    def _enqueue(self, r: Submission, reply: Reply) -> Ticket:
        """One request admitted on its own (:meth:`enqueue`); raises its refusal."""
        self._refuse_if_closing()
        now = time.monotonic()
        arrived = _arrival(r, now)
        seqs = r.seqs
        hits, shared, fresh = self._sort(r)
        if fresh:
            refusal = self.scheduler.admit([len(seqs[p[0]]) for p in fresh.values()], r.tenant, r.deadline,
                                           now, weight=r.weight, priority=r.priority, arrived=arrived,
                                           held=r.held)
            if refusal is not None:
                self._refused(refusal.reason)
                raise refusal_error(refusal, self.model)
        elif r.held:
            self.scheduler.admission.unhold(r.held)  # (every input cached or in flight: nothing queues)
        counts = [0, 0, 0]
        job, entries = self._join(r, arrived, reply, hits, shared, fresh, counts)
        self._count(counts)
        if entries:
            self.scheduler.add(entries, inputs=len(seqs))
            self._queued()
        return job

    def enqueue_many(
        self, requests: Sequence[Submission], reply: Reply | Sequence[Reply]
    ) -> list[Ticket | CoalesceError]:
        """:meth:`enqueue` for the requests of one message (a gateway's event-loop turn), or of every
        gateway's messages of the engine's turn, in order: each one's ticket, or the error that refused
        it. ``reply`` answers them all, or is a sequence with one per request (requests from several
        gateways). The same outcome as enqueueing them one after the
        other, paid once for the message where it can be: admission checks the message's worst case
        once (:meth:`.scheduler.Scheduler.admits_all`) and judges request by request only when that
        fails; the queue takes every admitted input in one call; the cache and deduplication counters
        and the owner's wake-up are set once. What stays per request is what must: the cache and
        in-flight lookups of its inputs, its ticket, and its inputs' entries."""
        replies = [reply] * len(requests) if callable(reply) else reply
        if len(requests) < 2 or self._closing:  # (one request: nothing to share between requests)
            return [self._enqueue_or_refusal(r, f) for r, f in zip(requests, replies, strict=True)]
        now = time.monotonic()
        total = inputs = longest = 0
        widest, shortest = 1, 1 << 30
        oldest, soonest = now, None
        tenants: dict[str, int] = {}
        for r in requests:
            seqs = r.seqs
            n = len(seqs)
            if n == 1:  # (the common query)
                tokens = low = high = len(seqs[0])
            else:
                lengths = [len(ids) for ids in seqs]
                tokens, low, high = sum(lengths), min(lengths), max(lengths)
                if n > widest:
                    widest = n
            inputs += n
            total += tokens
            if high > longest:
                longest = high
            if low < shortest:
                shortest = low
            if r.arrived is not None and r.arrived < oldest:
                oldest = r.arrived
            if r.deadline is not None and (soonest is None or r.deadline < soonest):
                soonest = r.deadline
            if r.tenant != DEFAULT_TENANT:
                tenants[r.tenant] = tenants.get(r.tenant, 0) + tokens
        sched = self.scheduler
        if not sched.admits_all(total, inputs, shortest, longest, widest, oldest, soonest, tenants, now):
            return [self._enqueue_or_refusal(r, f) for r, f in zip(requests, replies, strict=True)]
        out: list[Ticket | CoalesceError] = []
        added: list[tuple[list[Entry], int]] = []
        counts = [0, 0, 0]
        by_class = [0] * len(PRIORITIES)  # the admitted tokens of each class, of requests without a hold
        holds: list[Hold] = []  # the holds of those with one, and their tokens
        held_tokens = 0
        last = len(by_class) - 1
        pooled, join_one = OutputKind.POOLED, self._join_one
        for r, f in zip(requests, replies, strict=True):
            arrived = _arrival(r, now)
            if len(r.seqs) == 1 and r.kind is pooled:
                job, entries = join_one(r, arrived, f, counts)
            else:
                hits, shared, fresh = self._sort(r)
                job, entries = self._join(r, arrived, f, hits, shared, fresh, counts)
            if r.held is not None:
                holds.append(r.held)  # (ended whether or not anything of it queues)
            if entries:
                added.append((entries, len(r.seqs)))
                # (no generator for the common one-input request: the engine's lock under load, 2026-12-04)
                tokens = entries[0].n_tokens if len(entries) == 1 else sum(e.n_tokens for e in entries)
                if r.held is None:
                    p = r.priority
                    by_class[p if 0 <= p <= last else (0 if p < 0 else last)] += tokens
                else:
                    held_tokens += tokens
            out.append(job)
        self._count(counts)
        if added or holds:
            sched.admitted(by_class, now, holds, held_tokens)
        if added:
            sched.add_many(added)
            self._queued()
        return out

    def _queued(self) -> None:
        """Work joined the queue: the batcher is busy, and steps now if a batch can be dispatched (else
        the running batch's end steps: a step meanwhile would find nothing to run). Either way the
        queue's gauges are written within the tally's period: with no step until a running batch ends,
        an engine process of ``--workers N`` (whose series nobody renders in-process) showed the queue
        as its last step left it for as long as the batch ran — the depth an autoscaler reads."""
        self._idle.clear()
        if self.scheduler.can_dispatch:
            self._wake.set()
        else:
            self._tally.touch()

    def _enqueue_or_refusal(self, r: Submission, reply: Reply) -> Ticket | CoalesceError:
        try:
            return self._enqueue(r, reply)
        except CoalesceError as err:
            # Without its traceback: kept as a value (set on the caller's future), a refusal's traceback
            # held the frames down to here and through them the message's other requests and their
            # futures, which hold it: a cycle of about fifty objects for the collector, per refusal.
            return err.with_traceback(None)

    def _found(self, key: bytes, priority: int) -> np.ndarray | _Work | None:
        """Where an input's rows come from if not from new work: the cache's rows, or the work queued or
        running for the same input, which a request of ``priority`` joins when it is not more urgent
        than that work (a more urgent one must not wait behind it); None: new work."""
        if self._cache is not None:
            block = self._cache.get(self.model, key)
            if block is not None:
                return block
        work = self._inflight.get(key)
        return work if work is not None and priority >= work.priority else None

    def _sort(self, r: Submission) -> tuple[list[tuple[int, np.ndarray]], list[tuple[int, _Work]],
                                            dict[bytes, list[int]]]:
        """A request's inputs by where their rows come from (:meth:`_found`): the cache (position, rows),
        work already queued or running (position, that work), or new work (key → positions: identical
        inputs of one request are computed once)."""
        kind, priority = r.kind, r.priority
        hits: list[tuple[int, np.ndarray]] = []
        shared: list[tuple[int, _Work]] = []
        fresh: dict[bytes, list[int]] = {}
        for i, ids in enumerate(r.seqs):
            key = input_key(ids, kind)
            if key in fresh:  # a repeat of an input of this request that needed new work: so does this one
                fresh[key].append(i)
                continue
            found = self._found(key, priority)
            if found is None:
                fresh[key] = [i]
            elif isinstance(found, _Work):
                shared.append((i, found))
            else:
                hits.append((i, found))
        return hits, shared, fresh

    def _join(self, r: Submission, arrived: float, reply: Reply, hits: list[tuple[int, np.ndarray]],
              shared: list[tuple[int, _Work]], fresh: dict[bytes, list[int]], counts: list[int]
              ) -> tuple[Ticket, list[Entry]]:
        """An admitted request's ticket, and the entries of its new work (for the scheduler to queue):
        it waits for the work it shares, its cached rows are put at once. ``counts`` (cache hits,
        misses, deduplicated inputs) are added to."""
        seqs, deadline, kind = r.seqs, r.deadline, r.kind
        if kind is OutputKind.TOKENS:
            ends = np.cumsum([len(ids) for ids in seqs]).tolist()
            job = Ticket(reply, r.tag, len(seqs), len(seqs), ends[-1], starts=[0, *ends[:-1]], link=r.link)
        else:
            n = len(seqs)
            job = Ticket(reply, r.tag, n, n, n, link=r.link)
        if self._cache is not None:
            counts[0] += len(hits)
            counts[1] += len(seqs) - len(hits)
        counts[2] += len(seqs) - len(fresh) - len(hits)
        for i, work in shared:
            self._share(work, job, i, deadline)
        entries = [self._new_work(r, seqs[positions[0]], key, [(job, p) for p in positions], arrived, job)
                   for key, positions in fresh.items()]
        for i, block in hits:
            job.put(i, block, 0.0, 0.0)
        return job, entries

    def _join_one(self, r: Submission, arrived: float, reply: Reply, counts: list[int]
                  ) -> tuple[Ticket, list[Entry]]:
        """:meth:`_sort` then :meth:`_join` for an admitted request of one input of pooled output (the
        common query), in one call with no lists or dicts between them: the same ticket, entries and
        counts (``tests/unit/test_bulk_admission.py`` holds the two paths to one outcome)."""
        ids = r.seqs[0]
        key = _PLAIN_POOLED + r.raw if r.raw else input_key(ids)
        job = Ticket(reply, r.tag, 1, 1, 1, link=r.link)
        found = self._found(key, r.priority)
        if found is None or isinstance(found, _Work):
            if self._cache is not None:
                counts[1] += 1  # a cache miss
            if found is None:
                return job, [self._new_work(r, ids, key, [(job, 0)], arrived, job)]
            counts[2] += 1
            self._share(found, job, 0, r.deadline)
            return job, []
        counts[0] += 1
        job.put(0, found, 0.0, 0.0)
        return job, []

    def _share(self, work: _Work, job: Ticket, index: int, deadline: float | None) -> None:
        """Input ``index`` of ``job`` waits for ``work`` (queued or running), which now runs until the
        later of the two deadlines."""
        work.waiters.append((job, index))
        if deadline is None or (work.deadline is not None and deadline > work.deadline):
            self.scheduler.extend_deadline(work, deadline)

    def _new_work(self, r: Submission, ids: Sequence[int], key: bytes, waiters: list[tuple[Ticket, int]],
                  arrived: float, job: Ticket) -> Entry:
        """New work for input ``ids`` of request ``r`` (in flight from now): the entry to queue."""
        work = self._inflight[key] = _Work(len(ids), arrived, r.tenant, r.weight, r.priority, r.deadline,
                                           None, job, r.kind, ids=ids, key=key, waiters=waiters)
        return work

    def _count(self, counts: list[int]) -> None:
        hits, misses, deduplicated = counts
        series = self._series
        if hits:
            series.cache_hits.inc(hits)
        if misses:
            series.cache_misses.inc(misses)
        if deduplicated:
            series.deduplicated.inc(deduplicated)

    def withdraw(self, ticket: Ticket) -> None:
        """The caller no longer wants ``ticket``'s rows: its inputs still waiting are dropped, never
        computed, and it is not answered. A no-op once it has been answered."""
        if not ticket.done:
            ticket.done = True
            self._sweep = True
            self._wake.set()

    # -- the owner task ------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        stopped = self._wake.stopped
        assert stopped is not None  # (started)
        try:
            await stopped  # steps run as the wake schedules them; this ends on a failed one
        finally:
            self._wake.stop()
            # Stopped (shutdown): whatever still waits is answered, never left hanging.
            err = Unavailable(
                "The server is shutting down; retry on another replica.", retry_after=1, code="shutting_down"
            )
            self._answer(self.scheduler.drain_all(), err)
            self._tally.flush()

    def _step(self) -> None:
        sched = self.scheduler
        if self._sweep:
            self._sweep = False
            gone = cast("list[_Work]", sched.remove(lambda e: cast(_Work, e).abandoned()))
            for work in gone:
                self._inflight.pop(work.key, None)
            if gone:
                self._metrics.rejected.labels(self.model, "cancelled").inc(len(gone))
        while True:
            decision, expired, shed, late, retry_after = sched.next(time.monotonic())
            if late:
                self._metrics.rejected.labels(self.model, "late").inc(len(late))
                for e, after in zip(late, retry_after, strict=True):
                    self._answer([e], Overloaded(
                        f"Model '{self.model}': the queue stands and this request could no longer have "
                        "its first result within the latency bound; it was not computed.",
                        retry_after=after,
                        code="late",
                    ))
            if expired:
                self._metrics.rejected.labels(self.model, "expired").inc(len(expired))
                self._answer(
                    expired,
                    DeadlineExceeded("The request's deadline passed while it waited; it was not computed."),
                )
            if shed:
                self._metrics.rejected.labels(self.model, "deadline_unmeetable").inc(len(shed))
                self._answer(
                    shed,
                    Unavailable(
                        "The request cannot finish before its deadline; it was not computed.",
                        retry_after=sched.drain_s(time.monotonic()),
                        code="deadline_unmeetable",
                    ),
                )
            if isinstance(decision, Dispatch):
                self._run_batch(cast("list[_Work]", decision.batch), decision.padded_tokens)
                if sched.can_dispatch:  # (else asking again finds nothing: the batch's end steps)
                    continue
                break
            if isinstance(decision, Wait):
                self._wake_at(decision.until)
            break
        self._tally.touch()  # the queue's gauges
        if sched.queued_items == 0 and sched.inflight == 0:
            self._idle.set()

    def _wake_at(self, until: float) -> None:
        if self._timer is not None and self._timer_at <= until:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = until
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, until - time.monotonic()), self._on_timer
        )

    def _on_timer(self) -> None:
        self._timer = None
        self._wake.set()

    def _gauges(self) -> None:
        """The queue's and the cost model's gauges as they stand (when the tally is written)."""
        sched, m = self.scheduler, self._series
        queue = (sched.queued_items, sched.queued_tokens, sched.standing)
        if queue != self._queue_shown:  # a gauge write is a locked file write under --workers
            self._queue_shown = queue
            m.queue_depth.set(queue[0])
            m.queued_tokens.set(queue[1])
            m.queue_standing.set(queue[2])
        cost = sched.cost
        if cost.coef is not self._coef_shown:  # refitted (every few batches)
            self._coef_shown = cost.coef
            m.cost_overhead.set(cost.coef.overhead_s)
            m.cost_per_token.set(cost.coef.per_token_s)
            m.cost_spread.set(cost.spread)
            m.cost_run_spread.set(cost.run_spread)
        # Only tenants with work waiting are exported: tenant names come from clients. Under --workers
        # the shared series can never be removed, so none is exported there.
        if self._metrics.multiprocess_dir is not None:
            return
        waiting = sched.tenant_queued_tokens()
        shown = self._tenant_series
        if waiting == shown:
            return
        gauge = self._metrics.tenant_queued_tokens
        for tenant, tokens in waiting.items():
            if shown.get(tenant) != tokens:
                gauge.labels(self.model, tenant).set(tokens)
        for tenant in shown.keys() - waiting.keys():
            gauge.remove(self.model, tenant)
        self._tenant_series = waiting

    def _answer(self, entries: Sequence[Entry], err: CoalesceError) -> None:
        for e in cast("Sequence[_Work]", entries):  # (the batcher's entries are its work)
            self._inflight.pop(e.key, None)
            if e.fail(err):  # a request it failed has other inputs waiting: they go next step
                self._sweep = True
                self._wake.set()

    def _run_batch(self, batch: list[_Work], padded: int) -> None:
        start = time.monotonic()
        kind = cast(OutputKind, batch[0].kind)  # the batcher gives every entry one
        tracer = tracing.active
        span = self._batch_span(tracer, batch, padded, start) if tracer is not None else None
        self._engine.start([e.ids for e in batch], kind,
                           partial(self._batch_done, batch, padded, kind, start, tracer, span))

    def _batch_done(self, batch: list[_Work], padded: int, kind: OutputKind, start: float,
                    tracer: tracing.Tracer | None, span: Any, out: Output | Exception) -> None:
        m, model = self._series, self.model
        seconds: float | None = None
        threads = 0
        try:
            if isinstance(out, Exception):
                raise out
            # The rows each input gets: one (pooled), or one per token.
            sizes = [len(e.ids) for e in batch] if kind is OutputKind.TOKENS else [1] * len(batch)
            if out.rows.shape[0] != sum(sizes):
                raise RuntimeError(f"the runner returned {out.rows.shape[0]} rows for {sum(sizes)}")
        except Exception as exc:  # the runner's failure reaches exactly this batch
            if span is not None:
                tracer.failed(span, f"{type(exc).__name__}: {exc}")  # type: ignore[union-attr]
            m.batch_failures.inc()
            log.error("batch_failed", model=model, size=len(batch), error=f"{type(exc).__name__}: {exc}")
            self._answer(
                batch,
                InferenceFailed(
                    f"The model failed on the batch holding this input: {type(exc).__name__}: {exc}"
                ),
            )
        else:
            seconds, threads = out.forward_s, out.threads
            rows, cache, inflight = out.rows, self._cache, self._inflight
            if rows.dtype != _F32 or not rows.flags.c_contiguous:  # (once a batch, for every answer)
                rows = np.ascontiguousarray(rows, dtype=np.float32)
            at, model = 0, self.model
            for work, size in zip(batch, sizes, strict=True):
                block = rows[at : at + size]
                at += size
                inflight.pop(work.key, None)
                work.put(block, start - work.arrival, seconds)
                if cache is not None:
                    cache.put(model, work.key, block, len(work.key))
            if cache is not None:
                self._metrics.cache_bytes.set(cache.bytes)
            self._record(batch, padded, start, out)
        finally:
            if span is not None:
                if seconds is not None:
                    span.set_attribute("coalesce.forward_ms", round(seconds * 1e3, 3))
                span.end()
            sched = self.scheduler
            sched.done(padded, seconds, time.monotonic(), threads)
            if threads and seconds is not None and self._on_forward is not None:
                self._on_forward(sched.cost, threads, padded, seconds)
            self._wake.set()

    def _batch_span(self, tracer: tracing.Tracer, batch: list[_Work], padded: int, start: float) -> Any:
        """The span of a batch that computes inputs of sampled requests (None if it computes none),
        linked to each of those requests' spans; each such request learns the batch's span."""
        links: dict[bytes, int] = {}
        jobs: list[Ticket] = []
        for e in batch:
            for job, _ in e.waiters:
                if job.link is not None:
                    if job.link not in links:
                        links[job.link] = 0
                        jobs.append(job)
                    links[job.link] += 1
        if not links:
            return None
        span = tracer.batch(self.model, self.device, links, start)
        longest = max(e.n_tokens for e in batch)
        rows, cols = self._shape(len(batch), longest) if self._shape is not None else (len(batch), longest)
        span.set_attributes({
            "coalesce.batch.size": len(batch),
            "coalesce.batch.tokens": sum(e.n_tokens for e in batch),
            "coalesce.batch.padded_tokens": padded,
            "coalesce.batch.longest": longest,
            "coalesce.batch.cell": f"{rows}x{cols}",
            "coalesce.batch.requests": len(links),
        })
        packed = tracer.packed(span)
        for job in jobs:
            job.batches += (packed,)
        return span

    def _record(self, batch: Sequence[Entry], padded: int, start: float, out: Output) -> None:
        tally = self._tally
        tokens = sum(e.n_tokens for e in batch)
        # (padding_ratio reads only the lengths' sum)
        tally.batch(len(batch), tokens, padded, padding_ratio((tokens,), padded), out.forward_s)
        priority = batch[0].priority
        if all(e.priority == priority for e in batch):  # (the common case: one class)
            tally.waited(priority, [start - e.arrival for e in batch])
        else:
            for e in batch:
                tally.waited(e.priority, (start - e.arrival,))
        if not log.is_enabled_for(logging.DEBUG):
            return  # the fields below cost a pass over the batch each: only when someone reads them
        log.debug(
            "batch",
            model=self.model,
            size=len(batch),
            interactive=sum(not e.bulk for e in batch),  # inputs of requests of a few inputs (queries)
            interactive_queue_ms=round(max(((start - e.arrival) * 1e3 for e in batch if not e.bulk),
                                           default=0.0), 2),
            tokens=tokens,
            padded_tokens=padded,
            queue_ms=round((start - min(e.arrival for e in batch)) * 1e3, 2),
            prepare_ms=round(out.prepare_s * 1e3, 2),
            forward_ms=round(out.forward_s * 1e3, 2),
            total_ms=round((time.monotonic() - start) * 1e3, 2),
        )


def _resolve(future: asyncio.Future[RequestResult], _tag: Hashable, outcome: RequestResult | CoalesceError
             ) -> None:
    """A :class:`Ticket`'s answer into the future :meth:`Batcher.submit` returned (unless cancelled)."""
    if future.done():
        return
    if isinstance(outcome, RequestResult):
        future.set_result(outcome)
    else:
        future.set_exception(outcome)


def settle_tag(tag: Hashable, outcome: RequestResult | CoalesceError) -> None:
    """A reply for requests whose tag is their caller's future (one process's turn of requests,
    ``LocalModel``): the outcome into that future, unless it was cancelled."""
    _resolve(cast("asyncio.Future[RequestResult]", tag), tag, outcome)


def refusal_error(refusal: Refusal, model: str) -> CoalesceError:
    """The error a refusal is answered with (429, 503, or 400 for a request too large ever to fit)."""
    if refusal.reason == "too_large":
        return InvalidRequest(f"Model '{model}': {refusal.message}", param="input", code="request_too_large")
    if refusal.reason == "deadline_unmeetable":
        return Unavailable(
            f"Model '{model}': {refusal.message}", retry_after=refusal.retry_after, code="deadline_unmeetable"
        )
    return Overloaded(
        f"Model '{model}': {refusal.message}", retry_after=refusal.retry_after, code=refusal.reason
    )
