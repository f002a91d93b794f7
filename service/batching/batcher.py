"""The batcher: the single owner of one model's waiting work.

Handlers call :meth:`Batcher.submit` and await the futures it returns. Admission happens in ``submit``
(a bounded queue: over the bound is a 429 now, not a timeout later). The batcher's task moves admitted
items into its own pending list — no one else touches it — and dispatches as soon as the model has room:
a lone request at low load waits for nobody, and while the model is busy, arrivals accumulate into the
next batch. Every item's future is resolved on every path: result, runner error (exactly that batch's
items), cancellation by the caller, or shutdown.

Everything here runs on the event loop; the model runs on the worker's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import InferenceFailed, Overloaded, Unavailable
from ..logs import get_logger
from ..metrics import Metrics
from .cost import CostModel
from .policy import Limits, PaddedCost, form_batch, padding_ratio, window_size

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


@dataclass(slots=True, eq=False)
class _Item:
    ids: Sequence[int]
    arrival: float
    future: asyncio.Future[ItemResult]
    n_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_tokens = len(self.ids)


class Batcher:
    """Forms and dispatches batches for one model."""

    def __init__(
        self,
        engine: Engine,
        *,
        model: str,
        limits: Limits,
        padded_cost: PaddedCost,
        metrics: Metrics,
        cost: CostModel | None = None,
        max_queued_tokens: int = 1 << 20,
        pipeline_depth: int = 1,
    ) -> None:
        self._engine = engine
        self.model = model
        self.limits = limits
        self._padded_cost = padded_cost
        self.cost = cost or CostModel()
        self.max_queued_tokens = max_queued_tokens
        self._depth = max(1, pipeline_depth)
        self._metrics = metrics
        self._m_depth = metrics.queue_depth.labels(model)
        self._m_tokens = metrics.queued_tokens.labels(model)
        # Shared with submit() on the same event loop: the inbox only. Pending work is _run_loop's own.
        self._inbox: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.queued_items = 0
        self.queued_tokens = 0
        self._inflight = 0
        self._closing = False
        self._task: asyncio.Task[None] | None = None

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
    def submit(self, seqs: Sequence[Sequence[int]]) -> list[asyncio.Future[ItemResult]]:
        """Admit one request's inputs (complete id sequences) or raise Overloaded/Unavailable."""
        if self._closing:
            raise Unavailable(
                "The server is draining; retry on another replica.", retry_after=1, code="draining"
            )
        tokens = sum(len(s) for s in seqs)
        if self.queued_tokens + tokens > self.max_queued_tokens:
            self._metrics.rejected.labels(self.model, "queue_full").inc()
            raise Overloaded(
                f"Too much work queued for model '{self.model}' ({self.queued_tokens} tokens waiting, "
                f"bound {self.max_queued_tokens}); retry later.",
                retry_after=self.predicted_drain_s(),
            )
        loop = asyncio.get_running_loop()
        now = time.monotonic()  # not loop.time(): uvloop's clock ticks in whole milliseconds
        futures = []
        for ids in seqs:
            fut: asyncio.Future[ItemResult] = loop.create_future()
            self._inbox.append(_Item(ids, now, fut))
            futures.append(fut)
        self.queued_items += len(seqs)
        self.queued_tokens += tokens
        self._m_depth.set(self.queued_items)
        self._m_tokens.set(self.queued_tokens)
        self._idle.clear()
        self._wake.set()
        return futures

    def predicted_drain_s(self) -> float:
        """Seconds the model needs to clear what is queued, by the cost model."""
        batches = -(-self.queued_items // self.limits.max_batch_size)
        return batches * self.cost.coef.overhead_s + self.queued_tokens * self.cost.coef.per_token_s

    # -- the owner task ------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        pending: list[_Item] = []  # oldest first; only this task touches it
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._inbox:
                    pending.append(self._inbox.popleft())
                pending = self._drop_cancelled(pending)
                while pending and self._inflight < self._depth:
                    batch, pending = self._next_batch(pending)
                    self._release(batch)
                    self._inflight += 1
                    asyncio.get_running_loop().create_task(self._run_batch(batch))
                if not pending and self._inflight == 0 and not self._inbox:
                    self._idle.set()
        finally:
            # Stopped (shutdown): whatever still waits is answered, never left hanging.
            leftovers = [*pending, *self._inbox]
            self._inbox.clear()
            self._release(leftovers)
            err = Unavailable(
                "The server is shutting down; retry on another replica.", retry_after=1, code="shutting_down"
            )
            for item in leftovers:
                if not item.future.done():
                    item.future.set_exception(err)

    def _drop_cancelled(self, pending: list[_Item]) -> list[_Item]:
        live = [it for it in pending if not it.future.done()]
        if len(live) != len(pending):
            gone = [it for it in pending if it.future.done()]
            self._metrics.rejected.labels(self.model, "cancelled").inc(len(gone))
            self._release(gone)
        return live

    def _release(self, items: Sequence[_Item]) -> None:
        self.queued_items -= len(items)
        self.queued_tokens -= sum(it.n_tokens for it in items)
        self._m_depth.set(self.queued_items)
        self._m_tokens.set(self.queued_tokens)

    def _next_batch(self, pending: list[_Item]) -> tuple[list[_Item], list[_Item]]:
        window = pending[: window_size(self.limits)]
        picked = form_batch(
            [it.n_tokens for it in window],
            0,
            self.limits,
            self._padded_cost,
            self.cost.predict,
        )
        chosen = set(picked)
        batch = [window[i] for i in picked]
        rest = [it for i, it in enumerate(window) if i not in chosen]
        rest.extend(pending[len(window) :])
        return batch, rest

    async def _run_batch(self, batch: list[_Item]) -> None:
        m, model = self._metrics, self.model
        start = time.monotonic()
        lengths = [it.n_tokens for it in batch]
        padded = self._padded_cost(len(batch), max(lengths))
        try:
            out = await self._engine.run([it.ids for it in batch])
        except Exception as exc:  # the runner's failure reaches exactly this batch
            m.batch_failures.labels(model).inc()
            log.error("batch_failed", model=model, size=len(batch), error=f"{type(exc).__name__}: {exc}")
            err = InferenceFailed(
                f"The model failed on the batch holding this input: {type(exc).__name__}: {exc}"
            )
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(err)
        else:
            self.cost.observe(padded, out.forward_s)
            for it, row in zip(batch, out.rows, strict=True):
                if not it.future.done():
                    it.future.set_result(ItemResult(row, start - it.arrival, out.forward_s))
            ratio = padding_ratio(lengths, padded)
            m.batches.labels(model).inc()
            m.inputs.labels(model).inc(len(batch))
            m.tokens.labels(model).inc(sum(lengths))
            m.batch_size.labels(model).observe(len(batch))
            m.batch_tokens.labels(model).observe(padded)
            m.padding_ratio.labels(model).observe(ratio)
            m.forward_seconds.labels(model).observe(out.forward_s)
            wait = m.queue_wait.labels(model)
            for it in batch:
                wait.observe(start - it.arrival)
            log.debug(
                "batch",
                model=model,
                size=len(batch),
                tokens=sum(lengths),
                padded_tokens=padded,
                padding=round(ratio, 3),
                queue_ms=round((start - batch[0].arrival) * 1e3, 2),
                prepare_ms=round(out.prepare_s * 1e3, 2),
                forward_ms=round(out.forward_s * 1e3, 2),
                total_ms=round((time.monotonic() - start) * 1e3, 2),
            )
        finally:
            self._inflight -= 1
            self._wake.set()
