"""One object per served model: the only thing a route calls to run inputs through a model.

A route tokenises through :meth:`ServedModel.tokenize`, fits the ids (``inputs``), and awaits
:meth:`ServedModel.infer` — admission, submit and await in one call, answered by the request's deadline.
Where the model runs is this module's business alone:

* :class:`LocalModel` — ``--workers 1``: the engine's batcher in this process, called directly;
* :class:`RemoteModel` — ``--workers N``: the engine process, through the gateway's ``EngineClient``.

Both tokenise here, on a thread per model: requests asking in the same event-loop turn share one hand-off
and one ``encode_batch`` (a lone request waits for nobody), and a shared call that raises is retried per
request, so a bad text fails only its own request. A turn of a few short texts is tokenised on the loop
itself, which costs less than the hand-off. A future that resolves a request is cancelled when
its caller leaves or its deadline passes; the model behind it then drops the inputs still waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
from aiohttp import web
from coalesce.kernels.calibration import int8_scale
from coalesce.kernels.protocol import ModelInfo, OutputKind, Tokens
from coalesce.kernels.tokens import TokenizerAdapter, TokenSpan
from coalesce.kernels.worker import Lane

from .. import tracing
from ..batching.admit import AdmissionConfig, Hold, Refusal, judge_wait
from ..batching.batcher import Batcher, RequestResult, Submission, refusal_error, settle_tag
from ..batching.fair import DEFAULT_TENANT
from ..batching.overload import RetryPacer
from ..engine.core import Engine, RunnerFactory
from ..errors import CoalesceError, DeadlineExceeded, InvalidRequest
from ..metrics import Metrics
from ..settings import Settings
from .admission import Admission
from .prompts import Prompts

if TYPE_CHECKING:
    from .models import ModelRegistry
    from .remote import EngineClient

_BULK_TEXTS = 32  # a request of more texts than this tokenises apart from the others
# A turn's texts of at most this many characters in all are tokenised on the event loop itself: the
# hand-off to the tokenizer thread and back (a thread wake-up each way; engine_ops measures a bare round
# trip) costs more CPU than tokenising a few short texts, and the loop is held about as long as those
# wake-ups would have taken.
INLINE_TOKENIZE_CHARS = 256
_CHARS_PER_TOKEN = 5  # for estimates before tokenising, on the low side (English word pieces: ~4)
TOKENIZER_THREADS = 2  # per model per gateway process: one for queries, one for bulk requests
_Pending = tuple[Sequence[str], "asyncio.Future[list[list[int]]]"]


class ServedModel:
    """A served model as routes see it: its facts, its tokenizer, and ``infer``."""

    def __init__(self, info: ModelInfo, tokens: Tokens, *, device: str, metrics: Metrics,
                 prompts: Prompts | None = None, calibration: np.ndarray | None = None) -> None:
        self.info = info
        self.tokens = tokens
        self.device = device  # where the engine runs it ("cpu", "cuda:0", ...)
        self.specials = tokens.specials  # special tokens added to every single text
        self.prompts = prompts or Prompts()
        self.calibration = calibration  # the engine's calibration-corpus embeddings (int8/uint8 scale)
        self._scales: dict[int, float] = {}
        self._prompt_lengths: dict[str, int] = {}
        self._metrics = metrics
        self._cpu = Lane(f"coalesce-tok-{info.name}")
        # A request of many texts tokenises on a thread of its own, so a query never waits behind it.
        self._bulk_cpu = Lane(f"coalesce-bulk-{info.name}")
        self._pending: list[_Pending] = []

    # -- tokenising ----------------------------------------------------------------------------------
    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Raw ids of ``texts`` (no special tokens, untruncated), off the event loop."""
        trace = tracing.current()
        if trace is not None:
            with trace.child("coalesce.tokenize", **{"coalesce.texts": len(texts)}):
                return await self._tokenize(texts)
        return await self._tokenize(texts)

    async def _tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        if len(texts) > _BULK_TEXTS:
            return await loop.run_in_executor(self._bulk_cpu, self.tokens.tokenize, texts)
        fut: asyncio.Future[list[list[int]]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush_tokenize)
        self._pending.append((texts, fut))
        return await fut

    def _flush_tokenize(self) -> None:
        group = [(texts, fut) for texts, fut in self._pending if not fut.done()]
        self._pending = []
        if group:
            self._hand_over(group, [text for texts, _ in group for text in texts])

    def _hand_over(self, group: list[_Pending], texts: list[str]) -> None:
        """Tokenise ``texts`` (the group's, one after the other) on the tokenizer thread, or here when
        they are short (:data:`INLINE_TOKENIZE_CHARS`); the outcome comes back to the loop once, for the
        whole group (no future per hand-off)."""
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            self._fan_out(group, self._tokenized(texts))
            return
        loop = asyncio.get_running_loop()
        try:
            self._cpu.call(self._tokenize_on_thread, loop, group, texts,
                           dropped=partial(loop.call_soon_threadsafe, _cancel_all, group))
        except RuntimeError as exc:  # closed (shutdown)
            self._fan_out(group, exc)

    def _tokenize_on_thread(self, loop: asyncio.AbstractEventLoop, group: list[_Pending],
                            texts: list[str]) -> None:
        # The tokenizer thread.
        outcome = self._tokenized(texts)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
            loop.call_soon_threadsafe(self._fan_out, group, outcome)

    def _tokenized(self, texts: list[str]) -> list[list[int]] | Exception:
        """``texts``' ids, or what the tokenizer raised (any thread)."""
        try:
            return self.tokens.tokenize(texts)
        except Exception as exc:
            return exc

    def _fan_out(self, group: list[_Pending], outcome: list[list[int]] | Exception) -> None:
        if isinstance(outcome, Exception):
            if len(group) == 1:
                if not group[0][1].done():
                    group[0][1].set_exception(outcome)
                return
            for texts, fut in group:  # alone, so the failure reaches only its own request
                if not fut.done():
                    self._hand_over([(texts, fut)], list(texts))
            return
        start = 0
        for texts, fut in group:
            if not fut.done():
                fut.set_result(outcome[start : start + len(texts)])
            start += len(texts)

    def adapter(self) -> TokenizerAdapter:
        """The model's full tokenizer (offsets, decoding); a 400 for a model without one."""
        if not isinstance(self.tokens, TokenizerAdapter):
            raise InvalidRequest(
                f"Model '{self.info.name}' has no tokenizer that shows offsets or decodes.",
                param="model",
                code="unsupported",
            )
        return self.tokens

    async def spans(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[TokenSpan]]:
        """Each text's tokens with their character offsets (TEI's ``/tokenize``), on this model's
        tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu, self.adapter().spans, texts, add_special_tokens)

    async def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """Texts of token id sequences (TEI's ``/decode``), on this model's tokenizer thread. The ids
        must be in the vocabulary (the route checks)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu, self.adapter().decode, ids, skip_special_tokens)

    def quantization_scale(self, dim: int) -> float | None:
        """int8/uint8 output's step at width ``dim``: ``int8_scale`` of the calibration corpus's
        embeddings truncated and re-normalised as responses are; None without a corpus."""
        if self.calibration is None:
            return None
        known = self._scales.get(dim)
        if known is None:
            rows = self.calibration[:, :dim]
            if dim < self.calibration.shape[1]:
                norms = np.linalg.norm(rows, axis=1, keepdims=True)
                rows = rows / np.where(norms > 0, norms, 1.0)
            known = self._scales[dim] = int8_scale(rows)
        return known

    def prompt_length(self, prompt: str) -> int:
        """Tokens of ``prompt`` alone (no special tokens), as sentence-transformers counts a prompt."""
        known = self._prompt_lengths.get(prompt)
        if known is None:
            known = self._prompt_lengths[prompt] = len(self.tokens.tokenize([prompt])[0])
        return known

    # -- running -------------------------------------------------------------------------------------
    def check_room(self, adm: Admission, first: int = 1, total: int = 1, inputs: int = 1, *,
                   hold: bool = True) -> Hold:
        """Raise (429, 503) when the model cannot take a request of about ``total`` tokens in
        ``inputs`` inputs (the first of about ``first``) now, before any tokenising (estimates: err
        low; the model decides again on the real counts). ``hold``: one that passes is counted ahead
        of the next ones until it is admitted (``Admitter.precheck``); returns its :class:`Hold`
        (empty: nothing held), which goes with ``adm`` to its admission. A request with ``adm.held``
        passed a check already (from its head, ``shed``, or a route's), which holds its room until it
        is admitted: it is not checked again."""
        raise NotImplementedError

    @property
    def standing(self) -> bool:
        """Whether the model's queue stands (:mod:`..batching.overload`), as last known here."""
        return False

    def estimate(self, texts: Sequence[str], prompt: str | None = None) -> tuple[int, int]:
        """(tokens of the first text, tokens of all) as :meth:`check_room` takes them, from their
        lengths in characters: an estimate on the low side (a word piece is rarely under 4 characters),
        for a decision before tokenising."""
        extra = self.specials + (len(prompt) // _CHARS_PER_TOKEN if prompt else 0)
        most = self.info.max_tokens
        first = min(most, len(texts[0]) // _CHARS_PER_TOKEN + extra) if texts else 0
        total = sum(min(most, len(t) // _CHARS_PER_TOKEN + extra) for t in texts)
        return first, total

    def submit(
        self, seqs: Sequence[Sequence[int]], adm: Admission, kind: OutputKind, link: bytes | None = None
    ) -> asyncio.Future[RequestResult]:
        """Hand complete id sequences to the model (raising its refusal at once); cancelling the
        future withdraws what has not run. ``link``: the request's span (``tracing.pack``), for the
        spans of the batches that compute it."""
        raise NotImplementedError

    async def infer(
        self, seqs: Sequence[Sequence[int]], adm: Admission, kind: OutputKind = OutputKind.POOLED
    ) -> RequestResult:
        """Run one request's inputs under its admission, answered by its deadline (504 past it).

        ``kind`` TOKENS asks for every token's vector (``info.token_embeddings`` models only): the
        result then holds each input's ``len(seq)`` rows, one input after the other."""
        trace = tracing.current()
        submitted = time.monotonic()
        fut = self.submit(seqs, adm, kind, None if trace is None else trace.link)
        # The deadline is one timer that cancels what is still awaited (cheaper on this path than
        # asyncio.timeout); `expired` tells its cancellation from the task's own.
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            fut.cancel()

        timer = asyncio.get_running_loop().call_later(max(0.0, adm.deadline - time.monotonic()), expire)
        try:
            result = await fut
            if trace is not None:  # its last batch started when its longest wait ended
                trace.inferred(self.info.name, seqs, submitted, adm.arrived + result.queue_s, result.batches)
            return result
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not expired or (task is not None and task.cancelling()):
                raise  # the request itself was cancelled (its client left, or shutdown)
            self._metrics.rejected.labels(self.info.name, "expired").inc()
            raise DeadlineExceeded(
                f"No result within the request's deadline of {adm.timeout_s * 1e3:.0f} ms; "
                "what had not run was dropped."
            ) from None
        finally:
            timer.cancel()
            fut.cancel()  # a no-op once done

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)
        self._bulk_cpu.shutdown(wait=False, cancel_futures=True)


class LocalModel(ServedModel):
    """The model's batcher in this process (``--workers 1``): no copies, no IPC."""

    def __init__(self, batcher: Batcher, info: ModelInfo, tokens: Tokens, *, device: str,
                 metrics: Metrics, prompts: Prompts, calibration: np.ndarray | None) -> None:
        super().__init__(info, tokens, device=device, metrics=metrics, prompts=prompts,
                         calibration=calibration)
        self._batcher = batcher
        self._turn: list[Submission] = []  # this event-loop turn's requests, handed over at its end

    @property
    def standing(self) -> bool:
        return self._batcher.scheduler.standing

    def check_room(self, adm: Admission, first: int = 1, total: int = 1, inputs: int = 1, *,
                   hold: bool = True) -> Hold:
        if adm.held is not None:
            return adm.held  # (checked already, its room held: admission decides on the real counts)
        held = self._batcher.check_room(adm.tenant, weight=adm.weight, priority=adm.priority,
                                        arrived=adm.arrived, first=first, total=total, inputs=inputs,
                                        hold=hold)
        if hold:
            # The hold goes with the request to its admission, which ends it whole. Released by count
            # instead (the oldest of its class, by the real tokens), an estimate above the real count
            # left its excess held for HOLD_S, counted ahead of every later request, and the one
            # released was another request's hold, not necessarily its own.
            adm.held = held
        return held

    def submit(
        self, seqs: Sequence[Sequence[int]], adm: Admission, kind: OutputKind, link: bytes | None = None
    ) -> asyncio.Future[RequestResult]:
        """The requests submitted in one event-loop turn (those its tokenising turn released) reach the
        batcher together at the turn's end, as a gateway's message reaches the engine under
        ``--workers N`` (:meth:`Batcher.enqueue_many`: admitted as one where the queue allows): one
        code path for both. A refusal comes through the future."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RequestResult] = loop.create_future()
        if not self._turn:
            loop.call_soon(self._hand_over_turn)
        self._turn.append(Submission(seqs, fut, adm.tenant, adm.weight, adm.priority, adm.deadline, kind,
                                     adm.arrived, link, held=adm.held))
        return fut

    def _hand_over_turn(self) -> None:
        turn, self._turn = self._turn, []
        live = [r for r in turn if not cast(asyncio.Future, r.tag).done()]  # (not cancelled meanwhile)
        if not live:
            return
        batcher = self._batcher
        for r, outcome in zip(live, batcher.enqueue_many(live, settle_tag), strict=True):
            fut = cast("asyncio.Future[RequestResult]", r.tag)
            if isinstance(outcome, CoalesceError):
                fut.set_exception(outcome)
            elif not outcome.done:  # (every input cached: answered already)
                fut.add_done_callback(partial(batcher.withdraw_if_cancelled, outcome))


class RemoteModel(ServedModel):
    """The model in the engine process, reached through this gateway's ``EngineClient``.

    Admission is the engine's to decide, with every gateway's requests in view; ``check_room`` refuses
    early, before tokenising, only on the engine's last reported queue, when that report is fresh (the
    engine attaches it to every reply): the queue bound, and for the default tenant the regime's wait
    bound (``judge_wait``; a named tenant's share depends on what it has queued, which only the engine
    knows, so its requests are tokenised and decided there).
    """

    def __init__(self, client: EngineClient, index: int, info: ModelInfo, tokens: Tokens, *,
                 device: str, max_queued_tokens: int, metrics: Metrics, prompts: Prompts,
                 calibration: np.ndarray | None, admission: AdmissionConfig, gateways: int) -> None:
        super().__init__(info, tokens, device=device, metrics=metrics, prompts=prompts,
                         calibration=calibration)
        self._client = client
        self._index = index
        self._bound = max_queued_tokens
        self._admission = admission
        self._gateways = gateways
        self._pacer = RetryPacer()

    @property
    def standing(self) -> bool:
        report = self._client.report(self._index)
        return report is not None and report[0].standing

    def check_room(self, adm: Admission, first: int = 1, total: int = 1, inputs: int = 1, *,
                   hold: bool = True) -> Hold:
        self._client.check_open()
        if adm.held is None:  # (else checked from its head: the engine decides on the real counts)
            self._check(adm, first, total)
        return Hold()  # (a gateway holds nothing: the engine's admission judges the turn's requests)

    def _check(self, adm: Admission, first: int, total: int) -> None:
        report = self._client.report(self._index)
        if report is None:
            return
        queue, age = report
        if queue.tokens >= self._bound:
            self._refuse(Refusal("queue_full", f"{queue.tokens} tokens are waiting (bound {self._bound}); "
                                 "retry later.", queue.drain_s))
        cfg = self._admission
        if adm.tenant != DEFAULT_TENANT or cfg.max_queue_wait_s <= 0 or not queue.waits:
            return
        now = time.monotonic()
        wait = queue.waits[min(max(adm.priority, 0), 2)]
        if not queue.standing:
            # A queue that keeps emptying has drained by the report's age since (a burst's backlog).
            # A standing one has not: arrivals refill it as fast as the model drains it, and the
            # engine admits up to its bound meanwhile, so the wait it reported is the wait now.
            # (Taking the age off there passed nearly every head at the gateway, each a request whose
            # body was read and tokenised for the engine to refuse.)
            wait = max(0.0, wait - age)
        if wait <= 0:
            return
        own = queue.overhead_s + queue.per_token_s * first
        verdict = judge_wait(queue.standing, max(0.0, now - adm.arrived), wait, own, cfg)
        if verdict is not None:
            reason, allowed, what = verdict
            # Each gateway paces its own refusals: one in N of the returning callers is its own.
            cost = total / max(queue.capacity, 1e-9) * self._gateways
            retry = self._pacer.after(now, wait - max(allowed, 0.0) / 2, cost)
            self._refuse(Refusal(reason, f"{what}; retry in {retry:.3f} s.", retry))

    def _refuse(self, refusal: Refusal) -> None:
        self._metrics.rejected.labels(self.info.name, refusal.reason).inc()
        raise refusal_error(refusal, self.info.name)

    def submit(
        self, seqs: Sequence[Sequence[int]], adm: Admission, kind: OutputKind, link: bytes | None = None
    ) -> asyncio.Future[RequestResult]:
        return self._client.submit(self._index, seqs, adm, kind, link)


class Backend(Protocol):
    """Where the served models come from, and how they are brought up and down (app lifetime)."""

    async def start(self) -> None:
        """Bring every model up and register its facade; raises if they cannot be served."""
        ...

    async def drain(self, timeout: float) -> bool:
        """Stop taking work; wait up to ``timeout`` s for admitted work. True if all of it finished."""
        ...

    async def close(self) -> None:
        """Answer whatever is left (503) and release everything."""
        ...

    def record(self) -> None:
        """Refresh gauges that are read from the runners (at each scrape)."""
        ...


BACKEND = web.AppKey("backend", Backend)


class LocalBackend:
    """``--workers 1``: the engine lives in this process; each model is a ``LocalModel``."""

    def __init__(self, settings: Settings, metrics: Metrics, registry: ModelRegistry,
                 factory: RunnerFactory) -> None:
        self._engine = Engine(settings, metrics, factory)
        self._settings = settings
        self._metrics = metrics
        self._registry = registry

    async def start(self) -> None:
        await self._engine.load()
        for m in self._engine.models:
            model = LocalModel(
                m.batcher, m.info, m.runner.tokens, device=str(m.runner.device), metrics=self._metrics,
                prompts=Prompts.of(m.info, self._settings), calibration=m.calibration,
            )
            self._registry.add(model)

    async def drain(self, timeout: float) -> bool:
        return await self._engine.drain(timeout)

    async def close(self) -> None:
        await self._engine.close()

    def record(self) -> None:
        self._engine.record_capture()


def _cancel_all(group: list[_Pending]) -> None:
    """The group's tokenising was dropped unrun (shutdown): its callers' futures are cancelled."""
    for _, fut in group:
        fut.cancel()
