"""The batcher: the asyncio shell around one model's :class:`Scheduler`.

Handlers call :meth:`Batcher.submit` and await the futures it returns. The scheduler decides (admission,
order, batch size, shedding); the batcher's task is the single owner of the scheduler, wakes on events
(never polls), hands batches to the engine, and resolves every future on every path: result, runner
error (exactly that batch's items), expiry, shedding, cancellation by the caller, or shutdown.

Everything here runs on the event loop; the model runs on the worker's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import CoalesceError, DeadlineExceeded, InferenceFailed, InvalidRequest, Overloaded, Unavailable
from ..logs import get_logger
from ..metrics import Metrics
from .policy import padding_ratio
from .scheduler import DEFAULT_TENANT, Dispatch, Entry, Refusal, Scheduler, Wait

log = get_logger("coalesce.batcher")


class Output(Protocol):
    rows: np.ndarray
    prepare_s: float
    forward_s: float


class Engine(Protocol):
    """What the batcher needs from a model worker (``coalesce.kernels.worker.ModelWorker`` fits)."""

    async def run(self, batch: Sequence[Sequence[int]]) -> Output: ...


@dataclass(frozen=True, slots=True)
class ItemResult:
    """What one input's caller gets: its row and the timings of the batch it rode in."""

    row: np.ndarray
    queue_s: float
    forward_s: float


@dataclass(frozen=True, slots=True)
class _Payload:
    ids: Sequence[int]
    future: asyncio.Future[ItemResult]


class Batcher:
    """Forms and dispatches batches for one model."""

    def __init__(
        self, engine: Engine, *, model: str, scheduler: Scheduler, metrics: Metrics
    ) -> None:
        self._engine = engine
        self.model = model
        self.scheduler = scheduler
        self._metrics = metrics
        self._series = metrics.model_series(model)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._cancelled = 0  # futures cancelled by their callers since the last sweep
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._tenant_series: set[str] = set()  # tenants with a coalesce_tenant_queued_tokens series

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_loop(), name=f"batcher-{self.model}")
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
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # -- admission -----------------------------------------------------------------------------------
    def _refuse_if_closing(self) -> None:
        if self._closing:
            raise Unavailable(
                "The server is draining; retry on another replica.", retry_after=1, code="draining"
            )

    def ensure_room(self) -> None:
        """Refuse at once, before tokenising, when the queue is already at its bound (a flood)."""
        self._refuse_if_closing()
        sched = self.scheduler
        if sched.queued_tokens >= sched.config.max_queued_tokens:
            self._metrics.rejected.labels(self.model, "queue_full").inc()
            raise Overloaded(
                f"Model '{self.model}': {sched.queued_tokens} tokens are waiting (bound "
                f"{sched.config.max_queued_tokens}); retry later.",
                retry_after=sched.drain_s(time.monotonic()),
                code="queue_full",
            )

    def submit(
        self,
        seqs: Sequence[Sequence[int]],
        *,
        tenant: str = DEFAULT_TENANT,
        weight: float = 1.0,
        priority: int = 1,
        deadline: float | None = None,
    ) -> list[asyncio.Future[ItemResult]]:
        """Admit one request's inputs (complete id sequences) or raise why not, before any work is done.

        ``deadline`` is on the ``time.monotonic()`` clock.
        """
        self._refuse_if_closing()
        now = time.monotonic()
        refusal = self.scheduler.admit((len(s) for s in seqs), tenant, deadline, now)
        if refusal is not None:
            self._metrics.rejected.labels(self.model, refusal.reason).inc()
            raise _refusal_error(refusal, self.model)
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[ItemResult]] = []
        entries = []
        for ids in seqs:
            fut: asyncio.Future[ItemResult] = loop.create_future()
            fut.add_done_callback(self._on_future_done)
            futures.append(fut)
            entries.append(
                Entry(len(ids), now, tenant, weight, priority, deadline, payload=_Payload(ids, fut))
            )
        self.scheduler.add(entries)
        self._idle.clear()
        self._wake.set()
        return futures

    def _on_future_done(self, fut: asyncio.Future[ItemResult]) -> None:
        if fut.cancelled():
            self._cancelled += 1
            self._wake.set()

    # -- the owner task ------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._step()
        finally:
            # Stopped (shutdown): whatever still waits is answered, never left hanging.
            err = Unavailable(
                "The server is shutting down; retry on another replica.", retry_after=1, code="shutting_down"
            )
            self._answer(self.scheduler.drain_all(), err)
            self._gauges()

    def _step(self) -> None:
        sched = self.scheduler
        if self._cancelled:
            self._cancelled = 0
            gone = sched.remove(lambda e: e.payload.future.done())
            if gone:
                self._metrics.rejected.labels(self.model, "cancelled").inc(len(gone))
        while True:
            decision, expired, shed = sched.next(time.monotonic())
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
                batch_run = self._run_batch(decision.batch, decision.padded_tokens)
                asyncio.get_running_loop().create_task(batch_run)
                continue
            if isinstance(decision, Wait):
                self._wake_at(decision.until)
            break
        self._gauges()
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
        sched = self.scheduler
        self._series.queue_depth.set(sched.queued_items)
        self._series.queued_tokens.set(sched.queued_tokens)
        # Only tenants with work waiting are exported: tenant names come from clients. Under --workers
        # the shared series can never be removed, so none is exported there.
        if self._metrics.multiprocess_dir is not None:
            return
        waiting = sched.tenant_queued_tokens()
        gauge = self._metrics.tenant_queued_tokens
        for tenant, tokens in waiting.items():
            gauge.labels(self.model, tenant).set(tokens)
        for tenant in self._tenant_series - waiting.keys():
            gauge.remove(self.model, tenant)
        self._tenant_series = set(waiting)

    @staticmethod
    def _answer(entries: Sequence[Entry], err: CoalesceError) -> None:
        for e in entries:
            if not e.payload.future.done():
                e.payload.future.set_exception(err)

    async def _run_batch(self, batch: list[Entry], padded: int) -> None:
        m, model = self._series, self.model
        start = time.monotonic()
        lengths = [e.n_tokens for e in batch]
        seconds: float | None = None
        try:
            out = await self._engine.run([e.payload.ids for e in batch])
        except Exception as exc:  # the runner's failure reaches exactly this batch
            m.batch_failures.inc()
            log.error("batch_failed", model=model, size=len(batch), error=f"{type(exc).__name__}: {exc}")
            self._answer(
                batch,
                InferenceFailed(
                    f"The model failed on the batch holding this input: {type(exc).__name__}: {exc}"
                ),
            )
        else:
            seconds = out.forward_s
            for e, row in zip(batch, out.rows, strict=True):
                if not e.payload.future.done():
                    e.payload.future.set_result(ItemResult(row, start - e.arrival, out.forward_s))
            self._record(batch, lengths, padded, start, out)
        finally:
            self.scheduler.done(padded, seconds, time.monotonic())
            coef = self.scheduler.cost.coef
            m.cost_overhead.set(coef.overhead_s)
            m.cost_per_token.set(coef.per_token_s)
            self._wake.set()

    def _record(self, batch: list[Entry], lengths: list[int], padded: int, start: float, out: Output) -> None:
        m, model = self._series, self.model
        ratio = padding_ratio(lengths, padded)
        m.batches.inc()
        m.inputs.inc(len(batch))
        m.tokens.inc(sum(lengths))
        m.batch_size.observe(len(batch))
        m.batch_tokens.observe(padded)
        m.padding_ratio.observe(ratio)
        m.forward_seconds.observe(out.forward_s)
        for e in batch:
            m.queue_wait.observe(start - e.arrival)
        log.debug(
            "batch",
            model=model,
            size=len(batch),
            tokens=sum(lengths),
            padded_tokens=padded,
            padding=round(ratio, 3),
            queue_ms=round((start - min(e.arrival for e in batch)) * 1e3, 2),
            prepare_ms=round(out.prepare_s * 1e3, 2),
            forward_ms=round(out.forward_s * 1e3, 2),
            total_ms=round((time.monotonic() - start) * 1e3, 2),
        )


def _refusal_error(refusal: Refusal, model: str) -> CoalesceError:
    if refusal.reason == "too_large":
        return InvalidRequest(f"Model '{model}': {refusal.message}", param="input", code="request_too_large")
    if refusal.reason == "deadline_unmeetable":
        return Unavailable(
            f"Model '{model}': {refusal.message}", retry_after=refusal.retry_after, code="deadline_unmeetable"
        )
    return Overloaded(
        f"Model '{model}': {refusal.message}", retry_after=refusal.retry_after, code=refusal.reason
    )
