"""The threads that run models. Exactly one thread per device touches the accelerator.

``DeviceThread`` is that thread (shared by every model on the device, so models take turns rather than
contend). ``ModelWorker`` adds, per model, a CPU thread for tokenising and padding, so the next batch is
prepared while the current one runs. Callers on the event loop await coroutines; the threads never touch
asyncio state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from .protocol import Runner


class DeviceThread:
    """The single thread that owns a device: every forward, finish and warm-up runs here."""

    def __init__(self, name: str = "device") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"coalesce-{name}")

    @property
    def executor(self) -> ThreadPoolExecutor:
        return self._pool

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


@dataclass(frozen=True, slots=True)
class BatchOutput:
    rows: np.ndarray  # one float32 row per input, in batch order
    prepare_s: float
    forward_s: float  # forward + finish on the device thread


_Pending = tuple[Sequence[str], "asyncio.Future[list[list[int]]]"]


class ModelWorker:
    """Drives one runner: tokenise and prepare on a CPU thread, forward on the device thread.

    Requests that ask for tokenisation in the same event-loop turn share one hand-off to the CPU thread
    (one wake-up each way and one ``encode_batch`` over all their texts) instead of one each; a lone
    request waits for nobody. If the shared call raises, each
    request is tokenised alone, so a failure reaches only the request that caused it.
    """

    def __init__(self, runner: Runner, device: DeviceThread) -> None:
        self.runner = runner
        self._device = device
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"coalesce-cpu-{runner.info.name}")
        self._pending: list[_Pending] = []

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[list[int]]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush_tokenize)
        self._pending.append((texts, fut))
        return await fut

    def _flush_tokenize(self) -> None:
        group = [(texts, fut) for texts, fut in self._pending if not fut.done()]
        self._pending = []
        if not group:
            return
        flat = [text for texts, _ in group for text in texts]
        shared = asyncio.wrap_future(self._cpu.submit(self.runner.tokenize, flat))
        shared.add_done_callback(partial(self._fan_out, group))

    def _fan_out(self, group: list[_Pending], done: asyncio.Future[list[list[int]]]) -> None:
        if done.cancelled() or done.exception() is not None:
            if len(group) == 1:
                _settle(group[0][1], done)
                return
            loop = asyncio.get_running_loop()
            for texts, fut in group:  # alone, so the failure reaches only its own request
                alone = asyncio.wrap_future(self._cpu.submit(self.runner.tokenize, texts), loop=loop)
                alone.add_done_callback(partial(_settle, fut))
            return
        ids = done.result()
        start = 0
        for texts, fut in group:
            if not fut.done():
                fut.set_result(ids[start : start + len(texts)])
            start += len(texts)

    async def run(self, batch: Sequence[Sequence[int]]) -> BatchOutput:
        """Run one batch of complete id sequences. Raises whatever the runner raised."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        prepared = await loop.run_in_executor(self._cpu, self.runner.prepare, batch)
        t1 = time.perf_counter()
        rows, forward_s = await loop.run_in_executor(self._device.executor, self._forward, prepared)
        return BatchOutput(rows=rows, prepare_s=t1 - t0, forward_s=forward_s)

    def _forward(self, prepared: object) -> tuple[np.ndarray, float]:
        # Device thread only.
        t0 = time.perf_counter()
        rows = self.runner.finish(self.runner.forward(prepared), prepared)
        return rows, time.perf_counter() - t0

    async def warmup(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._device.executor, self.runner.warmup)

    def close(self) -> None:
        self._cpu.shutdown(wait=True, cancel_futures=False)


def _settle(fut: asyncio.Future[list[list[int]]], done: asyncio.Future[list[list[int]]]) -> None:
    """Copy ``done``'s outcome into ``fut`` unless the caller has gone."""
    if fut.done():
        return
    if done.cancelled():
        fut.cancel()
    elif (exc := done.exception()) is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(done.result())
