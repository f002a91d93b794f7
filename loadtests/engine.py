"""The request engine: open-loop dispatch on a schedule and closed-loop clients, recording every request.

Open loop measures latency from each request's *scheduled* send time, so a server (or a generator) that
falls behind shows up as latency instead of quietly lowering the offered rate (coordinated omission).
Only the event loop's thread touches a :class:`Recorder`; everything here runs on one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
from coalesce.loadtests.workload import Payload

# Outcomes that are not HTTP statuses.
STATUS_TIMEOUT = -1
STATUS_CONNECTION = -2
STATUS_BAD_RESPONSE = -3  # a 200 whose body does not hold one embedding per input
STATUS_NAMES = {
    STATUS_TIMEOUT: "timeout",
    STATUS_CONNECTION: "connection",
    STATUS_BAD_RESPONSE: "bad_response",
}

_JSON = {"Content-Type": "application/json"}

# How often a run moves what the generator holds into the collector's permanent generation (see
# :func:`collector_aside`).
FREEZE_EVERY_S = 1.0


def status_name(status: int) -> str:
    return STATUS_NAMES.get(status, str(status))


class _Item(msgspec.Struct):
    index: int = 0


class _Embeddings(msgspec.Struct):
    data: list[_Item]


_response_decoder = msgspec.json.Decoder(_Embeddings)


def response_holds(body: bytes, n_inputs: int) -> bool:
    """Whether a 200's body holds one embedding per input (else the request counts as a bad response)."""
    try:
        return len(_response_decoder.decode(body).data) == n_inputs
    except msgspec.DecodeError:
        return False


@dataclass
class Recorder:
    """Every finished request of a run, as parallel lists of offsets (seconds from the run's start)."""

    sched: list[float] = field(default_factory=list)  # when the request was due
    started: list[float] = field(default_factory=list)  # when the generator got to it (before a free slot)
    done: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    n_inputs: list[int] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)  # x-queue-time header, NaN if absent
    infer_ms: list[float] = field(default_factory=list)
    retry_after: list[bool] = field(default_factory=list)  # the answer carried Retry-After
    dispatched: int = 0
    failed: int = 0

    def add(
        self,
        sched: float,
        started: float,
        done: float,
        status: int,
        n_inputs: int,
        queue_ms: float,
        infer_ms: float,
        retry_after: bool = False,
    ) -> None:
        self.sched.append(sched)
        self.started.append(started)
        self.done.append(done)
        self.status.append(status)
        self.n_inputs.append(n_inputs)
        self.queue_ms.append(queue_ms)
        self.infer_ms.append(infer_ms)
        self.retry_after.append(retry_after)
        if status != 200:
            self.failed += 1

    @property
    def finished(self) -> int:
        return len(self.done)


def _header_ms(headers: Mapping[str, str], name: str) -> float:
    try:
        return float(headers.get(name, "nan"))
    except ValueError:
        return math.nan


class Sender(Protocol):
    """What the schedules below drive: :class:`Client` (aiohttp) or :class:`.rawclient.RawClient`."""

    async def timed(self, payload: Payload, due: float, t0: float, rec: Recorder) -> None: ...


class Client:
    """Sends payloads to one embeddings URL over a shared keep-alive connection pool."""

    def __init__(self, session: aiohttp.ClientSession, url: str, max_inflight: int) -> None:
        self._session = session
        self._url = url
        self._slots = asyncio.Semaphore(max_inflight)

    async def send(self, payload: Payload) -> tuple[int, float, float, bool]:
        """Status, queue and inference milliseconds (NaN when the server does not say), and whether the
        answer carried ``Retry-After``."""
        try:
            async with self._session.post(self._url, data=payload.body, headers=_JSON) as resp:
                body = await resp.read()
                status = resp.status
                queue_ms = _header_ms(resp.headers, "x-queue-time")
                infer_ms = _header_ms(resp.headers, "x-inference-time")
                retry_after = "Retry-After" in resp.headers
        except TimeoutError:
            return STATUS_TIMEOUT, math.nan, math.nan, False
        except aiohttp.ClientError:
            return STATUS_CONNECTION, math.nan, math.nan, False
        if status == 200 and not response_holds(body, payload.n_inputs):
            status = STATUS_BAD_RESPONSE
        return status, queue_ms, infer_ms, retry_after

    async def timed(self, payload: Payload, due: float, t0: float, rec: Recorder) -> None:
        """Send once a pool slot is free and record it against ``due`` (an absolute loop time).

        ``started`` - ``due`` is the generator's own lag: how late the event loop got to the request.
        Waiting for a free slot comes after it and counts as latency, as any client-side queue would.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._slots:
            status, queue_ms, infer_ms, retry_after = await self.send(payload)
        rec.add(due - t0, started - t0, loop.time() - t0, status, payload.n_inputs, queue_ms, infer_ms,
                retry_after)


@contextlib.asynccontextmanager
async def alongside(work: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run ``work`` as a task while the block runs; it is cancelled, and awaited, when the block ends."""
    task = asyncio.create_task(work)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def collector_aside(every_s: float = FREEZE_EVERY_S) -> AsyncIterator[None]:
    """Keep the garbage collector's full passes off a run's clock.

    A run holds every request's body, made before the clock starts (half a million for the ten-minute
    soak), and adds a record per request. Each full collection walks all of it with the event loop
    stopped, longer the longer the run, so the sends due meanwhile go out late and the answers are read
    late, and latency measured from the scheduled send time charged the generator's pauses to the
    server (the soak of 2026-12-05 17:46 in BENCHMARKS.md: a dispatch lag p99 of 240 ms, in the phase
    of its worst p99). What is alive when the run starts, and every ``every_s`` while it runs, goes to the
    permanent generation (``gc.freeze``, as the server does once ready); the young generations are still
    collected, so a short-lived cycle is freed as before. Everything is handed back afterwards, unless
    something was frozen before (a server in the same process: ``gc.unfreeze`` would hand back its heap
    too), when the run's objects stay frozen."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()

    async def keep() -> None:
        while True:
            await asyncio.sleep(every_s)
            gc.freeze()

    try:
        async with alongside(keep()):
            yield
    finally:
        if frozen_before == 0:
            gc.unfreeze()


async def run_open(
    client: Sender,
    arrivals: Sequence[float],
    payload_for: Callable[[int], Payload],
    rec: Recorder,
    t0: float,
) -> None:
    """Send request ``i`` at ``t0 + arrivals[i]`` whatever happened to the earlier ones, then wait for all.

    A client with ``fire`` (``rawclient.RawClient``) is handed each request without a task of its own."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    fire = getattr(client, "fire", None)
    burst = 0
    for i, offset in enumerate(arrivals):
        due = t0 + offset
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
            burst = 0
        else:
            burst += 1
            if burst % 64 == 0:  # behind schedule: still let responses in now and then
                await asyncio.sleep(0)
        if fire is not None:
            fire(payload_for(i), due, t0, rec)
        else:
            task = asyncio.create_task(client.timed(payload_for(i), due, t0, rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        rec.dispatched += 1
    if fire is not None:
        await client.drain()  # type: ignore[attr-defined]
    if tasks:
        await asyncio.gather(*tasks)


async def run_closed(
    client: Sender,
    concurrency: int,
    duration: float,
    payload_for: Callable[[int], Payload],
    rec: Recorder,
    t0: float,
) -> None:
    """``concurrency`` clients, each sending its next request as soon as the previous one answers."""
    loop = asyncio.get_running_loop()
    end = t0 + duration
    counter = 0

    async def worker() -> None:
        nonlocal counter
        while (now := loop.time()) < end:
            i = counter
            counter += 1
            rec.dispatched += 1
            await client.timed(payload_for(i), now, t0, rec)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def make_session(max_connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """A client session sized for a run: one keep-alive connection per in-flight request."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        skip_auto_headers=("User-Agent",),
    )
