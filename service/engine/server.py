"""The engine process of ``--workers N``: every model's queue and runner, behind one socket per gateway.

Gateways send jobs (``engine/messages.py``); each goes to its model's batcher exactly as an in-process
request would, so inputs from every gateway coalesce into the same batches. The jobs of every gateway's
messages read in one event-loop turn are admitted together, and results and refusals go back in one
message per gateway per turn, with each model's queue attached (a gateway refuses a flood before
tokenising it on that report), sent together (``Turn``): per-turn work, not per-message work.

Each gateway has its own socket, so its disconnect (a socket event, not a timeout) says which gateway
died: its queued work is dropped at once, never computed. A message that cannot be decoded, or a job
that breaks the protocol, is logged and refused; it never takes the engine down.

Lifetime: the engine binds at once and welcomes each gateway (the models' facts and tokenizer) once the
models are loaded; a load failure is sent instead, then the process exits 1. SIGTERM — which the
supervisor sends only after every gateway has drained and exited — finishes admitted work and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Hashable
from typing import Any

from coalesce.kernels.protocol import ModelInfo, OutputKind

from .. import tracing
from ..allocator import freeze_startup_heap
from ..batching.batcher import Batcher, Reply, RequestResult, Submission, Ticket
from ..batching.scheduler import Scheduler
from ..errors import CoalesceError, Unavailable
from ..logs import get_logger
from ..metrics import Metrics
from ..settings import Settings
from . import messages as wire
from .channel import Link
from .core import Engine, EngineModel, RunnerFactory, default_factory

log = get_logger("coalesce.engine")

# Capture statistics are copied into the shared metrics at most this often, after results (an idle
# engine never wakes for them).
_CAPTURE_EVERY_S = 1.0
_POOLED, _TOKENS = OutputKind.POOLED, OutputKind.TOKENS


class Turn:
    """What the engine does once per event-loop turn for every gateway at once.

    **Admission.** The requests of every gateway's messages that arrived in one turn are admitted
    together: each model's batcher takes them in one :meth:`Batcher.enqueue_many` call, so admission,
    the queue's insertion and the owner's wake-up are paid once per turn rather than once per message.
    Many gateways each sending a message of one or two requests (what a loaded GPU replica sees) cost
    the engine about what one message of all of them would. The outcome is the one the messages would
    have had admitted one after the other (``enqueue_many``'s promise); the turn's requests wait for
    the end of the turn's reads, microseconds. A message that acts on earlier jobs — a cancellation, a
    gateway's loss — first admits what is waiting (:meth:`admit`), so it finds every job it names.

    **Replies.** Each gateway still gets one ``Results`` message per turn with all its rows, but the
    queue report they carry is computed once for all of them, and one scheduled call sends them all."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # Per model: the turn's requests, the link each came from and its reply (a bound method made once
        # per message, not per request).
        self._pending: dict[int, tuple[list[Submission], list[GatewayLink], list[Reply]]] = {}
        self._admitting = False
        self._replying: list[GatewayLink] = []
        self._captured_at = 0.0

    def add(self, model: int, requests: list[Submission], link: GatewayLink) -> None:
        """``link``'s requests for model ``model``, in order, to admit at the end of the turn."""
        n = len(requests)
        if model in self._pending:
            waiting, links, replies = self._pending[model]
            waiting += requests
            links += [link] * n
            replies += [link.reply] * n
        else:
            self._pending[model] = (requests, [link] * n, [link.reply] * n)
        if not self._admitting:
            self._admitting = True
            asyncio.get_running_loop().call_soon(self.admit)

    def admit(self) -> None:
        """Admit everything waiting, now (the call scheduled for the end of the turn then finds nothing)."""
        self._admitting = False
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        models = self._engine.models
        for index, (requests, links, replies) in pending.items():
            batcher = models[index].batcher
            try:
                outcomes: list[Ticket | CoalesceError] = batcher.enqueue_many(requests, replies)
            except Exception as exc:  # a bug: the turn's callers hear of it rather than wait forever
                log.exception("admission_failed", model=models[index].info.name)
                outcomes = [CoalesceError(f"Admission failed: {type(exc).__name__}", code="internal_error")
                            ] * len(requests)
            for request, link, outcome in zip(requests, links, outcomes, strict=True):
                link.admitted(request.tag, batcher, outcome)

    def reply_later(self, link: GatewayLink) -> None:
        """``link`` has answers to send: at the end of this turn, with every other gateway's."""
        if not self._replying:
            asyncio.get_running_loop().call_soon(self._send_replies)
        self._replying.append(link)

    def _send_replies(self) -> None:
        links, self._replying = self._replying, []
        now = time.monotonic()
        queues = [_queue(m.batcher.scheduler, now) for m in self._engine.models]
        for link in links:
            link.flush(queues)
        if now - self._captured_at >= _CAPTURE_EVERY_S:
            self._captured_at = now
            self._engine.record_capture()


class GatewayLink:
    """The engine's end of one gateway's socket: its jobs in flight and its outgoing replies."""

    def __init__(self, index: int, address: str, engine: Engine, metrics: Metrics, turn: Turn) -> None:
        self.index = index
        self._engine = engine
        self._metrics = metrics
        self._turn = turn  # shared by every gateway's link in the engine process
        self._address = address
        self._link = Link(f"gateway-{index}", self._on_message, on_down=self._on_lost)
        self._jobs: dict[int, tuple[Batcher, Ticket]] = {}  # admitted, not answered yet
        self._offers: list[wire.ModelOffer] | None = None
        self._infos: list[ModelInfo] = []
        self._error: str | None = None
        self._greeted = False  # the gateway said Hello
        self._done: list[wire.Done] = []
        self._frames: list[Any] = []
        self._failed: list[wire.Failed] = []
        self._flushing = False

    async def start(self) -> None:
        """Bind this gateway's socket (at once, before the models load: the gateway connects meanwhile)."""
        await self._link.listen(self._address)

    def welcome(self, offers: list[wire.ModelOffer] | None, error: str | None = None) -> None:
        """The models are loaded (``offers``), or failed to (``error``): tell the gateway once it is here."""
        self._offers, self._error = offers, error
        self._infos = [o.info for o in offers or []]  # (what each Submit is checked against)
        if self._greeted:
            self._send_welcome()

    def _send_welcome(self) -> None:
        self._send([wire.encoder.encode(wire.Welcome(self._offers or [], self._error))])

    # -- incoming ------------------------------------------------------------------------------------
    def _on_message(self, parts: list[memoryview]) -> None:
        try:
            msg = wire.engine_decoder.decode(parts[0])
        except Exception as exc:
            self._refuse(f"undecodable message: {exc}")
            return
        if isinstance(msg, wire.Submit):
            self._submit(msg, parts[1:])
        elif isinstance(msg, wire.Cancel):
            self._turn.admit()  # (a job cancelled in the turn it arrived in is admitted, then withdrawn)
            jobs = self._jobs
            for job_id in msg.ids:
                held = jobs.pop(job_id, None)
                if held is not None:
                    held[0].withdraw(held[1])  # its batcher drops the inputs still waiting
        else:
            self._greeted = True
            log.info("gateway_connected", gateway=msg.gateway, pid=msg.pid)
            if self._offers is not None or self._error is not None:
                self._send_welcome()

    def _refuse(self, reason: str) -> None:
        log.warning("gateway_message_refused", gateway=self.index, reason=reason)
        self._send([wire.encoder.encode(wire.Refused(reason))])

    def _submit(self, msg: wire.Submit, frames: list[memoryview]) -> None:
        if len(frames) != 1:
            self._refuse(f"{len(msg.jobs)} jobs with {len(frames)} frames (one frame holds them all)")
            return
        if self._offers is None:
            for job in msg.jobs:
                self._fail(job.id, Unavailable("The models are still loading; retry shortly.", retry_after=2,
                                               code="loading"))
            return
        raws: list[bytes] = []
        try:
            unpacked = wire.unpack_submit(msg, frames[0], self._infos, raws)
        except wire.ProtocolError as exc:
            self._refuse(str(exc))
            return
        # Each model's batcher takes its requests of this turn's messages at once, every gateway's
        # together (admission judges them together where it can: Turn, Batcher.enqueue_many).
        by_model: dict[int, list[Submission]] = {}
        for job, seqs, raw in zip(msg.jobs, unpacked, raws, strict=True):
            if isinstance(seqs, wire.ProtocolError):
                self._malformed(job.id, seqs)
                continue
            link = None
            if job.trace:  # (tracing on and the request sampled: a call only then)
                try:
                    link = _link(job.trace)
                except wire.ProtocolError as exc:  # a span context of the wrong size
                    self._malformed(job.id, exc)
                    continue
            request = Submission(seqs, job.id, job.tenant, job.weight, job.priority, job.deadline,
                                 _TOKENS if job.tokens else _POOLED, job.arrived or None, link, raw)
            requests = by_model.get(job.model)
            if requests is None:
                by_model[job.model] = [request]
            else:
                requests.append(request)
        turn = self._turn
        for index, requests in by_model.items():
            turn.add(index, requests, self)

    def admitted(self, job_id: Hashable, batcher: Batcher, outcome: Ticket | CoalesceError) -> None:
        """What the turn's admission made of one of this gateway's jobs (``job_id``: its tag)."""
        job: int = job_id  # type: ignore[assignment]  # (the engine's tags are job ids; no cast() call)
        if isinstance(outcome, CoalesceError):
            self._fail(job, outcome)
        elif not outcome.done:  # (every input cached: answered already)
            self._jobs[job] = (batcher, outcome)

    def _malformed(self, job_id: int, exc: wire.ProtocolError) -> None:
        log.warning("gateway_job_refused", gateway=self.index, reason=str(exc))
        self._fail(job_id, CoalesceError(f"The gateway sent a malformed job: {exc}", code="protocol_error"))

    # -- outgoing ------------------------------------------------------------------------------------
    def reply(self, job_id: Hashable, outcome: RequestResult | CoalesceError) -> None:
        """A batcher's answer to one job (never to one withdrawn): into this turn's message. Its rows
        are float32 and C-contiguous (``RequestResult``'s promise: the batcher makes a batch's so)."""
        job: int = job_id  # type: ignore[assignment]  # (its tags are job ids; no cast() call per answer)
        self._jobs.pop(job, None)
        if not isinstance(outcome, RequestResult):
            self._fail(job, outcome)
            return
        rows = outcome.rows
        n, dim = rows.shape
        self._done.append(wire.Done(job, n, dim, outcome.queue_s, outcome.forward_s, outcome.batches))
        self._frames.append(rows)
        self._schedule_flush()

    def _fail(self, job_id: int, err: CoalesceError) -> None:
        self._failed.append(wire.Failed(job_id, wire.failure(err)))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flushing:
            self._flushing = True
            self._turn.reply_later(self)

    def flush(self, queues: list[wire.Queue]) -> None:
        """This turn's answers in one message, with each model's queue (the same for every gateway)."""
        self._flushing = False
        msg = wire.Results(self._done, self._failed, queues)
        rows = b"".join(self._frames)
        self._done, self._failed, self._frames = [], [], []
        self._send([wire.encoder.encode(msg), rows])

    def _send(self, parts: list[Any]) -> None:
        self._link.send(parts)

    # -- the gateway's life --------------------------------------------------------------------------
    def _on_lost(self) -> None:
        """This socket's peer went away: its gateway died, so its queued work is dropped now."""
        self._turn.admit()  # (its jobs of this turn too)
        if self._jobs:
            log.warning("gateway_lost", gateway=self.index, dropped_requests=len(self._jobs))
        jobs, self._jobs = self._jobs, {}
        for batcher, ticket in jobs.values():
            batcher.withdraw(ticket)

    def close(self) -> None:
        self._link.close()


async def serve_engine(settings: Settings, factory: RunnerFactory | None = None) -> int:
    """Load the models and serve the gateways until SIGTERM (0), or exit 1 if loading fails."""
    if not settings.engine_dir:
        raise SystemExit("the engine needs --engine-dir (the supervisor of --workers sets it)")
    tracing.start(settings, "engine")
    try:
        return await _serve_engine(settings, factory)
    finally:
        tracing.stop()  # the last batches' spans go out before the process does


async def _serve_engine(settings: Settings, factory: RunnerFactory | None) -> int:
    assert settings.engine_dir is not None
    metrics = Metrics()
    engine = Engine(settings, metrics, factory or default_factory(settings))
    turn = Turn(engine)
    links = [GatewayLink(i, wire.endpoint(settings.engine_dir, i), engine, metrics, turn)
             for i in range(settings.workers)]
    for link in links:
        await link.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    loading = loop.create_task(engine.load())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if not loading.done():
        loading.cancel()
        log.info("stopped", before="ready")
    elif loading.exception() is not None:
        exc = loading.exception()
        log.error("model_load_failed", error=f"{type(exc).__name__}: {exc}")
        for link in links:
            link.welcome(None, f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(0.2)  # let the gateways read why before this process goes
        code = 1
    else:
        offers = [_offer(m, settings) for m in engine.models]
        for link in links:
            link.welcome(offers)
        metrics.ready.set(1)
        metrics.startup_seconds.labels("engine_ready").set(time.monotonic() - started)
        log.info("engine_ready", models=[o.info.name for o in offers], gateways=len(links))
        log.info("heap_frozen", **freeze_startup_heap())  # (see allocator.freeze_startup_heap)
        await stopping
        metrics.ready.set(0)
        finished = await engine.drain(settings.drain_timeout_s)
        log.info("drained", complete=finished)
    stopping.cancel()
    await engine.close()
    for link in links:
        link.close()
    return code


def _link(raw: bytes) -> bytes | None:
    """A job's span context, when tracing is on here and the gateway sent a well-formed one."""
    if not raw or tracing.active is None:
        return None
    if len(raw) != tracing.PACKED:
        raise wire.ProtocolError(f"a span context of {len(raw)} bytes")
    return raw


def _queue(sched: Scheduler, now: float) -> wire.Queue:
    coef = sched.cost.coef
    return wire.Queue(sched.queued_tokens, sched.drain_s(now), sched.standing, sched.waits(now),
                      coef.overhead_s, coef.per_token_s, sched.regime.capacity)


def _offer(model: EngineModel, settings: Settings) -> wire.ModelOffer:
    runner = model.runner
    calibration = model.calibration.tobytes() if model.calibration is not None else b""
    return wire.ModelOffer(runner.info, runner.tokens.spec(), str(runner.device), settings.max_queued_tokens,
                           calibration)
