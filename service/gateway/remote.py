"""A gateway's connection to the engine process (``--workers N``): submit, cancel, and results back.

One Unix socket to the engine's socket for this gateway (``engine/channel.py``; ``engine/messages.py``
is the protocol). Requests and cancellations made in one event-loop turn travel in one message. Every
request owns a future here, and every exit path resolves it: the engine's rows or refusal, the caller
cancelling it (a ``Cancel`` goes to the engine, which drops what has not run), or the engine going
away — told at once by the socket's disconnect event, never by a timeout — which answers every waiting
request 503 and refuses new ones. Event loop only.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
from coalesce.kernels.protocol import OutputKind
from coalesce.kernels.tokens import TokenizerAdapter

from ..batching.batcher import RequestResult
from ..engine import messages as wire
from ..engine.channel import Link
from ..engine.core import scheduler_config
from ..errors import InferenceFailed, Unavailable
from ..logs import get_logger
from ..metrics import Metrics
from ..settings import Settings
from .admission import Admission
from .facade import RemoteModel
from .models import ModelRegistry
from .prompts import Prompts
from .state import Lifecycle, Phase

log = get_logger("coalesce.gateway.remote")

# The engine's queue report rides on its replies; older than this it says nothing about the queue now.
_QUEUE_REPORT_TTL_S = 0.25


class EngineClient:
    """Submit jobs to the engine and resolve their futures from its replies."""

    def __init__(self, endpoint: str, gateway: int, on_lost: Callable[[str], None]) -> None:
        self._link = Link("engine", self._on_message, on_down=self._on_down)
        self._endpoint = endpoint
        self._gateway = gateway
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[RequestResult]] = {}
        self._jobs: list[wire.Job] = []
        self._frames: list[bytes] = []
        self._cancels: list[int] = []
        self._flushing = False
        self._queues: list[wire.Queue] = []
        self._queues_at = 0.0
        self._lost: str | None = None
        self._closing = False
        self._welcome: asyncio.Future[wire.Welcome] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> wire.Welcome:
        """Connect, introduce this gateway, and wait for the engine's models (it may still be loading)."""
        loop = asyncio.get_running_loop()
        self._welcome = loop.create_future()
        self._link.connect(self._endpoint)  # (the engine binds it at once; until then, tries again)
        self._link.send([wire.encoder.encode(wire.Hello(self._gateway, os.getpid()))])  # sent once connected
        return await self._welcome

    # -- requests ------------------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise 503 when the engine is gone or this gateway is draining."""
        if self._lost is not None:
            raise Unavailable(
                f"The model engine is unavailable ({self._lost}); retry on another replica.",
                retry_after=5,
                code="engine_unavailable",
            )
        if self._closing:
            raise Unavailable(
                "The server is draining; retry on another replica.", retry_after=1, code="draining"
            )

    def report(self, model: int) -> tuple[wire.Queue, float] | None:
        """``model``'s queue as the engine last reported it and that report's age in seconds, or None
        when it is too old to tell."""
        age = time.monotonic() - self._queues_at
        if age > _QUEUE_REPORT_TTL_S or model >= len(self._queues):
            return None
        return self._queues[model], age

    def submit(
        self, model: int, seqs: Sequence[Sequence[int]], adm: Admission, kind: OutputKind = OutputKind.POOLED,
        link: bytes | None = None,
    ) -> asyncio.Future[RequestResult]:
        """Send one request; the future resolves with its rows (of ``kind``), or raises the engine's
        refusal. ``link``: the request's span, which the engine's batch spans link (tracing on)."""
        self.check_open()
        job_id = next(self._ids)
        marked, frame = wire.pack_job(seqs)
        fut: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: self._on_settled(job_id, f))
        self._waiting[job_id] = fut
        self._idle.clear()
        self._jobs.append(
            wire.Job(job_id, model, len(seqs), marked, adm.tenant, adm.weight, adm.priority, adm.deadline,
                     kind is OutputKind.TOKENS, adm.arrived, link or b"")
        )
        self._frames.append(frame)
        self._schedule_flush()
        return fut

    def _on_settled(self, job_id: int, fut: asyncio.Future[RequestResult]) -> None:
        if self._waiting.pop(job_id, None) is not None and fut.cancelled() and self._lost is None:
            self._cancels.append(job_id)  # the caller left: the engine drops what has not run
            self._schedule_flush()
        if not self._waiting:
            self._idle.set()

    def _schedule_flush(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._lost is not None:
            return
        if self._jobs:
            sizes = [len(frame) >> 2 for frame in self._frames]
            parts = [wire.encoder.encode(wire.Submit(self._jobs, sizes)), b"".join(self._frames)]
            self._jobs, self._frames = [], []
            self._send(parts)
        if self._cancels:
            self._send([wire.encoder.encode(wire.Cancel(self._cancels))])
            self._cancels = []

    def _send(self, parts: list[bytes]) -> None:
        self._link.send(parts)

    # -- replies -------------------------------------------------------------------------------------
    def _on_message(self, parts: list[memoryview]) -> None:
        try:
            msg = wire.gateway_decoder.decode(parts[0])
        except Exception as exc:  # the engine and this gateway disagree: loud, not fatal
            log.error("engine_message_refused", error=str(exc))
            return
        if isinstance(msg, wire.Results):
            self._results(msg, parts[1:])
        elif isinstance(msg, wire.Welcome):
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(msg)
        else:
            log.error("engine_refused_a_message", reason=msg.reason)

    def _results(self, msg: wire.Results, frames: Sequence[memoryview]) -> None:
        self._queues, self._queues_at = msg.queues, time.monotonic()
        waiting = self._waiting
        sizes = [d.n * d.dim for d in msg.done]
        rows = np.frombuffer(frames[0] if frames else b"", dtype=np.float32)
        if any(size < 0 for size in sizes) or sum(sizes) != rows.size:  # loud, not fatal
            exc = wire.ProtocolError(f"{len(sizes)} pieces of {sum(sizes)} items in a frame of {rows.nbytes} "
                                     "bytes")
            log.error("engine_message_refused", error=str(exc))
            err = InferenceFailed(f"The model engine sent rows this gateway cannot read: {exc}")
            lost = [wire.Failed(d.id, wire.failure(err)) for d in msg.done]
            msg = wire.Results([], [*msg.failed, *lost], msg.queues)
        at = 0
        for done, size in zip(msg.done, sizes, strict=False):  # (none when the rows could not be read)
            fut = waiting.get(done.id)
            if fut is not None and not fut.done():
                block = rows[at : at + size].reshape(done.n, done.dim)  # a view of the message's frame
                fut.set_result(RequestResult(block, done.queue_s, done.forward_s, done.batches))
            at += size
        for failed in msg.failed:
            fut = waiting.get(failed.id)
            if fut is not None and not fut.done():
                fut.set_exception(wire.error_from(failed.error))

    def _on_down(self) -> None:
        """The engine's socket closed under this gateway (the link says so only of a connection that
        was up): the engine is gone."""
        if not self._closing and self._lost is None:
            self._lose("the engine process went away")

    def _lose(self, reason: str) -> None:
        self._lost = reason
        log.error("engine_lost", reason=reason, waiting=len(self._waiting))
        err = Unavailable(
            f"The model engine is unavailable ({reason}); retry on another replica.",
            retry_after=5,
            code="engine_unavailable",
        )
        for fut in list(self._waiting.values()):
            if not fut.done():
                fut.set_exception(err)
        if self._welcome is not None and not self._welcome.done():
            self._welcome.set_exception(err)
        self._on_lost(reason)

    # -- lifecycle -----------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> bool:
        """Refuse new requests; wait up to ``timeout`` s for those in flight. True if all finished."""
        self._closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Answer what still waits (503) and close the socket. Idempotent."""
        if self._link.closed:
            return
        self._closing = True
        err = Unavailable("The server is shutting down; retry on another replica.", retry_after=1,
                          code="shutting_down")
        for fut in list(self._waiting.values()):
            if not fut.done():
                fut.set_exception(err)
        self._link.close()


class RemoteBackend:
    """``--workers N``: this gateway's models are the engine process's, each a ``RemoteModel``.

    A gateway loads no weights and never imports torch: the engine's ``Welcome`` carries each model's
    facts and its tokenizer. Losing the engine turns this gateway FAILED (``/ready`` 503; model routes
    503 ``engine_unavailable``) until the supervisor stops it.
    """

    def __init__(
        self, settings: Settings, metrics: Metrics, registry: ModelRegistry, life: Lifecycle
    ) -> None:
        if not settings.engine_dir:
            raise SystemExit("a gateway needs --engine-dir (the supervisor of --workers sets it)")
        self._settings = settings
        self._metrics = metrics
        self._registry = registry
        self._life = life
        address = wire.endpoint(settings.engine_dir, settings.worker_id)
        self._client = EngineClient(address, settings.worker_id, self._lost)

    def _lost(self, reason: str) -> None:
        self._life.set(Phase.FAILED, reason, code="engine_unavailable")

    async def start(self) -> None:
        welcome = await self._client.start()
        if welcome.error is not None:
            raise RuntimeError(f"the engine could not load the models: {welcome.error}")
        for index, offer in enumerate(welcome.models):
            tokens = TokenizerAdapter.from_spec(offer.tokenizer)
            self._registry.add(RemoteModel(
                self._client, index, offer.info, tokens, device=offer.device,
                max_queued_tokens=offer.max_queued_tokens, metrics=self._metrics,
                prompts=Prompts.of(offer.info, self._settings),
                calibration=_rows(offer.calibration, offer.info.dim),
                admission=scheduler_config(self._settings, offer.info.max_tokens, 1).admission(),
                gateways=self._settings.workers,
            ))

    async def drain(self, timeout: float) -> bool:
        return await self._client.drain(timeout)

    async def close(self) -> None:
        await self._client.close()

    def record(self) -> None:
        return None  # the engine process keeps the runner gauges


def _rows(raw: bytes, dim: int) -> np.ndarray | None:
    """Float32 rows of ``dim`` from raw bytes; None for none."""
    return np.frombuffer(raw, dtype=np.float32).reshape(-1, dim) if raw else None
