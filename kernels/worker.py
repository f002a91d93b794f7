"""The threads that run models. Exactly one thread per device touches the accelerator.

``DeviceThread`` is that thread (shared by every model on the device, so models take turns rather than
contend). ``ModelWorker`` adds, per model, a CPU thread that pads the next batch while the current one
runs. Callers on the event loop await coroutines; the threads never touch asyncio state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import cast

import numpy as np

from .protocol import OutputKind, Runner, TokenRunner


def _hand(pool: ThreadPoolExecutor, reply: Callable[[BatchOutput | Exception], None],
          fn: Callable[..., BatchOutput | None], *args: object) -> None:
    """Run ``fn(*args)`` on ``pool``'s thread; ``reply`` gets what it returns (unless None: it handed
    the batch on) or what it raised, including a pool that no longer takes work (shutdown)."""

    def call() -> None:
        try:
            out = fn(*args)
        except Exception as exc:
            reply(exc)
        else:
            if out is not None:
                reply(out)

    try:
        pool.submit(call)
    except RuntimeError as exc:
        reply(exc)


def _settle(fut: asyncio.Future[BatchOutput], outcome: BatchOutput | Exception) -> None:
    if fut.done():
        return  # the caller stopped waiting
    if isinstance(outcome, Exception):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


class DeviceThread:
    """The single thread that owns a device: every forward, finish and warm-up runs here.

    ``after_batch``, when given, is called on this thread after every batch's forward (it must be quick:
    the next batch waits for it); the engine passes the allocator's trimmer here."""

    def __init__(self, name: str = "device", after_batch: Callable[[], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"coalesce-{name}")
        self.after_batch = after_batch

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._pool

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


@dataclass(frozen=True, slots=True)
class BatchOutput:
    rows: np.ndarray  # float32, in batch order: a row per input (pooled) or per token (tokens)
    prepare_s: float
    forward_s: float  # forward + finish on the device thread


class ModelWorker:
    """Drives one runner: prepare on a CPU thread, forward and finish on the device thread.

    With ``overlap`` off (one batch in flight at a time, as on CPU), nothing can run beside a forward,
    so a batch is prepared on the device thread too: one thread hand-off per batch instead of two.
    """

    def __init__(self, runner: Runner, device: DeviceThread, *, overlap: bool = True) -> None:
        self.runner = runner
        self._device = device
        self._overlap = overlap
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"coalesce-prep-{runner.info.name}")

    async def run(self, batch: Sequence[Sequence[int]], kind: OutputKind = OutputKind.POOLED) -> BatchOutput:
        """Run one batch of complete id sequences, all of one output ``kind``. Raises whatever the
        runner raised (a runner without token output asked for tokens raises TypeError)."""
        fut: asyncio.Future[BatchOutput] = asyncio.get_running_loop().create_future()
        self.start(batch, kind, partial(_settle, fut))
        return await fut

    def start(self, batch: Sequence[Sequence[int]], kind: OutputKind,
              done: Callable[[BatchOutput | Exception], None]) -> None:
        """Run one batch as :meth:`run` does and call ``done`` with its output, or the exception it
        raised, on the calling event loop. No future: the batch goes from the preparing thread
        straight to the device thread, and comes back to the loop once (the batcher's hand-off)."""
        loop = asyncio.get_running_loop()

        def reply(outcome: BatchOutput | Exception) -> None:  # any thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
                loop.call_soon_threadsafe(done, outcome)

        if not self._overlap:
            _hand(self._device.executor, reply, self._prepare_and_forward, batch, kind)
        else:
            _hand(self._cpu, reply, self._prepare_then_forward, batch, kind, reply)

    def _prepare_then_forward(self, batch: Sequence[Sequence[int]], kind: OutputKind,
                              reply: Callable[[BatchOutput | Exception], None]) -> None:
        # The CPU thread: pad this batch while the device runs the previous one, then queue its forward.
        t0 = time.perf_counter()
        prepared = self.runner.prepare(batch)
        prepare_s = time.perf_counter() - t0
        _hand(self._device.executor, reply, self._forward_output, prepared, kind, prepare_s)

    def _forward_output(self, prepared: object, kind: OutputKind, prepare_s: float) -> BatchOutput:
        # Device thread only.
        rows, forward_s = self._forward(prepared, kind)
        return BatchOutput(rows=rows, prepare_s=prepare_s, forward_s=forward_s)

    def _forward(self, prepared: object, kind: OutputKind) -> tuple[np.ndarray, float]:
        # Device thread only.
        t0 = time.perf_counter()
        if kind is OutputKind.TOKENS:
            if not self.runner.info.token_embeddings:
                raise TypeError(f"model {self.runner.info.name} does not return token embeddings")
            runner = cast(TokenRunner, self.runner)
            rows = runner.finish_tokens(runner.forward_tokens(prepared), prepared)
        else:
            rows = self.runner.finish(self.runner.forward(prepared), prepared)
        if self._device.after_batch is not None:
            self._device.after_batch()
        return rows, time.perf_counter() - t0

    def _prepare_and_forward(self, batch: Sequence[Sequence[int]], kind: OutputKind) -> BatchOutput:
        # Device thread only.
        t0 = time.perf_counter()
        prepared = self.runner.prepare(batch)
        rows, forward_s = self._forward(prepared, kind)
        return BatchOutput(rows=rows, prepare_s=time.perf_counter() - t0 - forward_s, forward_s=forward_s)

    async def warmup(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._device.executor, self.runner.warmup)

    def close(self) -> None:
        self._cpu.shutdown(wait=True, cancel_futures=False)
