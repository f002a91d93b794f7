"""Hostile and broken clients: the limits aiohttp's server does not set by itself, in one place.

aiohttp's own limits, only configured here (:func:`handler_kwargs`; ``client_max_size`` in ``create_app``):

* ``keepalive_timeout`` (``--keepalive-timeout-s``) closes a connection idle between requests. Its timer
  runs from the accept or the last response and bytes do not reset it, so it also bounds a connection
  that never completes a request head;
* ``max_line_size``, ``max_field_size`` (``--max-header-bytes``) and ``max_headers`` (``--max-headers``):
  the parser refuses a head past them instead of buffering it;
* ``client_max_size`` (``--max-body-bytes``): ``request.read()`` stops at the limit (413), so a body is
  never held past it, and a body nobody reads pauses the socket after ``read_bufsize`` (64 KiB);
* ``lingering_time``: after answering a request whose body was left unread, read and drop the rest for
  :data:`LINGER_S` before closing, so the client reads the answer rather than a reset.

What aiohttp lacks, added here:

* **a head deadline**, from a request's first byte (``--header-timeout-s``): the keep-alive timer is the
  only bound on a trickled head, and it must be long for proxies (75 s), for all that time a slowloris
  client holds a connection and a parser buffer. Such a client is answered 408 and closed.
* **a body deadline** (``--body-timeout-s``, :func:`read_body`, a step of the app's middleware): aiohttp
  waits for body bytes forever. Answered 408. A Content-Length over ``--max-body-bytes`` is answered 413
  at once.
* **431 with a body, and no reset**: aiohttp answers a head over its limits with a text/plain 400, logs
  a traceback per request (a hostile client could fill the log) and closes at once, so a client still
  sending its head gets a reset instead of the answer. Here: 431 (400 for other malformed heads) in
  OpenAI's error shape, logged at debug, then a *lingering close*: half-close, drop what the client
  still sends until it closes or :data:`LINGER_S` passes, then close.
* **a connection cap** (``--max-connections``): aiohttp accepts whatever the kernel hands it until the
  process runs out of file descriptors; then uvloop (libuv) accepts and closes each new connection at
  once, a reset with no answer, until descriptors free up. Past the cap a connection is answered at
  its first bytes with 503 and ``Retry-After`` (``GET /health`` alone gets 200: a full process is busy,
  not dead, and a restart would not help), then closed gently. An answer rather than not accepting: a
  connection left in the kernel's backlog looks like a hang to its client and to a load balancer, while
  503 with Retry-After is what the ``openai`` client and balancers retry elsewhere.
* **a greedy accept** (:mod:`.listener`): uvloop's listener accepts one connection an event-loop turn,
  so behind a loop busy with an overload a flood of new connections waited in the kernel's queue for
  seconds, and past it had its handshakes dropped; here every waiting connection is taken when the
  listening socket is ready.
* **when a request arrived**: aiohttp keeps no time of a request's arrival, and under load the wait
  before a handler runs (the event loop, then the body) is where latency hides. Each connection stamps
  the first bytes of a request head with the event loop's time of that turn (:func:`arrived`), so
  admission counts every wait from then (``coalesce.service.batching.admit``).
* **answers from the connection** (:data:`HEAD_ANSWER`): for each request aiohttp makes a request object,
  a task, a writer and a response, and runs the middlewares, which is most of what a request refused
  from its head costs (``shed``). While the connection has nothing else in progress, a request whose
  head and body have arrived whole is offered to the app's answer first, on the parsed message; what
  it answers is written at once and never reaches aiohttp, keep-alive kept. A plain request of a route
  the app answers itself (:data:`OWN_ANSWER`, ``plain.py``: the model routes) is then taken whole by
  the app, answered when its result is in, with nothing of aiohttp's request path in between;
  what arrives on the connection meanwhile waits until that answer is written, so answers go out in
  the order their requests came.
* **the descriptor limit**: :class:`GuardedSite` raises the soft ``RLIMIT_NOFILE`` to the hard one when
  it starts, and :func:`connection_cap` lowers the cap to keep a reserve for the process's own files and
  sockets and for refusals in flight.

Everything here runs on the event loop's thread; nothing is shared with another.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from ..batching.admit import Hold
from ..dialects import Dialect, render
from ..errors import (
    CoalesceError,
    HeadersTooLarge,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    Unavailable,
)
from ..logs import get_logger
from ..metrics import Metrics
from ..schemas import encoder
from ..settings import Settings
from . import listener
from .answers import raw_response
from .state import METRICS, SETTINGS

log = get_logger("coalesce.guard")

# A connection's own answer to a request from its parsed head and complete body (an HTTP response in
# bytes), or None to hand the request to aiohttp as usual; set by ``create_app`` (``shed.head_refusal``).
HeadAnswer = Callable[[RawRequestMessage, StreamReader, "_GuardedHandler"], bytes | None]
HEAD_ANSWER: web.AppKey[HeadAnswer] = web.AppKey("head_answer")
# The app taking a request that arrived whole to answer it itself (``plain.plain_answer``): what answers it
# (the response in bytes, and whether the connection ends after it), or None to hand it to aiohttp.
OwnAnswer = Callable[[RawRequestMessage, StreamReader, "_GuardedHandler"],
                     Coroutine[Any, Any, tuple[bytes, bool]] | None]
OWN_ANSWER: web.AppKey[OwnAnswer] = web.AppKey("own_answer")
# What arrives on a connection while the app answers a request it took, kept until the answer is written;
# past this the socket is paused.
HELD_INPUT_BYTES = 1 << 16

# After an answer that ends a connection: how long to drop what the client still sends before closing.
LINGER_S = 2.0
# Descriptors kept out of the connection cap: the process's own files and sockets, and refusals in flight.
FD_RESERVE = 1024
_LIVENESS = b"GET /health "


def handler_kwargs(settings: Settings) -> dict[str, Any]:
    """aiohttp's per-connection limits for ``settings``: for ``AppRunner(**...)`` and each connection."""
    return {
        "access_log": None,
        "keepalive_timeout": settings.keepalive_timeout_s,
        "max_line_size": settings.max_header_bytes,
        "max_field_size": settings.max_header_bytes,
        "max_headers": settings.max_headers,
        "lingering_time": LINGER_S,
    }


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open: keep what we have
            log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(wanted: int, fd_limit: int) -> int:
    """``wanted`` lowered to fit ``fd_limit``, keeping a quarter of it (at most ``FD_RESERVE``) spare."""
    reserve = min(FD_RESERVE, fd_limit // 4)
    return max(1, min(wanted, fd_limit - reserve))


def _raw_response(err: CoalesceError | None, ok_body: object = None) -> bytes:
    """A whole HTTP/1.1 response that ends its connection: ``err`` in OpenAI's shape, or 200 ``ok_body``."""
    status, headers, body = 200, {}, ok_body
    if err is not None:
        rendered = render(err, Dialect.OPENAI)
        status, headers, body = rendered.status, rendered.headers, rendered.body
    return raw_response(status, encoder.encode(body), headers, close=True)


def _linger(transport: asyncio.Transport) -> asyncio.TimerHandle:
    """Half-close ``transport`` once what was written has gone, and close it when the client closes its
    side (the protocol's ``eof_received`` returns None) or ``LINGER_S`` passes. Until then the protocol
    drops what arrives: a client still sending reads its answer instead of a reset."""
    if transport.can_write_eof():
        transport.write_eof()
    return asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class Connections:
    """One process's open connections against its cap, and the count of what was cut off and why."""

    def __init__(self, cap: int, metrics: Metrics) -> None:
        self.cap = cap
        self.open = 0
        self._metrics = metrics
        self._at_cap = False

    @property
    def full(self) -> bool:
        return self.open >= self.cap

    def opened(self) -> None:
        self.open += 1
        self._metrics.open_connections.inc()

    def closed(self) -> None:
        self.open -= 1
        self._metrics.open_connections.dec()
        if self._at_cap and self.open < 0.9 * self.cap:
            self._at_cap = False
            log.info("connection_cap_cleared", open=self.open, cap=self.cap)

    def refused(self, reason: str) -> None:
        self._metrics.connections_refused.labels(reason).inc()
        if reason == "over_capacity" and not self._at_cap:
            self._at_cap = True  # logged once per episode, not once per connection
            log.warning("connection_cap_reached", cap=self.cap)


def _slots(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())}


# What the connection's own answers rely on in aiohttp's handler (3.10 on): without it, aiohttp answers all.
_CAN_ANSWER = {"_parser", "_messages", "_request_count", "_keepalive", "_next_keepalive_close_time",
               "_keepalive_timeout", "_keepalive_handle"} <= _slots(RequestHandler)


def _nothing() -> None:
    pass


class _AnsweringParser:
    """aiohttp's request parser, with the requests the connection answered itself taken out of what it
    hands aiohttp (:meth:`_GuardedHandler._answer_heads`); everything else is the parser's own."""

    def __init__(self, parser: Any, handler: _GuardedHandler) -> None:
        self.parser = parser
        self._handler = handler
        # A message the connection answered is one aiohttp will not take from the parser's queue (3.14's
        # parser counts them, and stops at a bound; earlier ones do not).
        self.consumed: Callable[[], object] = getattr(parser, "message_consumed", None) or _nothing

    def feed_data(self, data: bytes) -> tuple[Sequence[Any], bool, bytes]:
        messages, upgraded, tail = self.parser.feed_data(data)
        if messages:
            messages = self._handler._answer_heads(messages)
        return messages, upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


class _GuardedHandler(RequestHandler):
    """aiohttp's connection handler with a head deadline, 431 for oversized heads, a lingering close
    after a refused head, the app's own answers from a parsed head (``answer``: :data:`HEAD_ANSWER`) and
    the requests the app takes to answer itself (``own``: :data:`OWN_ANSWER`)."""

    def __init__(
        self, manager: web.Server, *, connections: Connections, header_timeout: float, timed_out: bytes,
        answer: HeadAnswer | None = None, own: OwnAnswer | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=asyncio.get_running_loop(), **kwargs)
        self._answer = answer if _CAN_ANSWER else None
        self._own = own if _CAN_ANSWER else None
        self._answered = 0  # requests answered here in this data_received
        self._finished = 0  # requests aiohttp has answered (of ``_request_count`` handed to it)
        # The app's answer passed the request aiohttp handles next, and holds its room (``shed``).
        self.head_held: Hold | None = None
        # The request the app took (OWN_ANSWER) while it answers it, and what arrived meanwhile.
        self._taken: asyncio.Task[tuple[bytes, bool]] | None = None
        self._held_input: list[bytes] = []
        self._held_bytes = 0
        self._held_paused = False
        # A resume of reading asked for while a request is taken (:meth:`resume_reading`), and whether
        # it has anything to resume once the request is answered.
        self._taking = False
        self._resume_later = False
        if self._answer is not None or self._own is not None:
            self._parser = _AnsweringParser(self._parser, self)  # type: ignore[assignment]  # (its interface)
        self._connections = connections
        self._header_timeout = header_timeout
        self._timed_out = timed_out  # the 408 answer, rendered once per site
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaiting_head = True  # the next bytes start a request head
        self._refused_head = False  # a bad head was answered: close gently after the answer
        self._linger_timer: asyncio.TimerHandle | None = None  # set once closing: input is dropped
        self._counted = False
        # When this turn of the loop began, as the first bytes of the request head now being read
        # arrived; None between requests and for a head pipelined behind a running request.
        self.head_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connections.opened()
        self._counted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        if self._taken is not None:  # the client left: its request is withdrawn (aiohttp cancels a handler)
            self._taken.cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._counted:
            self._counted = False
            self._connections.closed()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return
        if self._taken is not None:  # (the app answers a request it took: what follows waits for that)
            self._held_input.append(data)
            self._held_bytes += len(data)
            if self._held_bytes > HELD_INPUT_BYTES and not self._held_paused and self.transport is not None:
                self._held_paused = True
                self.transport.pause_reading()
            return
        if self._awaiting_head and self.head_at is None:
            self.head_at = self._loop.time()  # the loop's time of this turn: earlier callbacks' waits count
        parsed = self._request_count
        self._answered = 0
        super().data_received(data)
        if self._request_count != parsed:  # a head is complete (or refused): its deadline is met
            self._awaiting_head = False
            self._stop_head_timer()
        elif self._answered:
            # Every complete request in it was answered here: the connection waits for the next head, as
            # after a response. (The first bytes of a head behind them, if any, start its deadline when
            # more of it comes.)
            self.head_at = None
            self._stop_head_timer()
        elif self._awaiting_head and self._head_timer is None:
            # The first bytes of a head. (The rest of a head pipelined behind a running request is left
            # to the keep-alive timer, which counts from that request's response.)
            self._head_timer = self._loop.call_later(self._header_timeout, self._head_timed_out)

    def _answer_heads(self, messages: Sequence[Any]) -> Sequence[Any]:
        """What aiohttp is to handle of the requests just parsed: those from the first that the app's
        answer leaves to it. Only while nothing else is in progress on the connection (every request
        handed to aiohttp has been answered), so answers go out in the order their requests came."""
        transport = cast(asyncio.Transport | None, self.transport)
        if self._finished != self._request_count or self._messages or self._taken is not None \
                or transport is None or transport.is_closing():
            return messages
        consumed = cast(_AnsweringParser, self._parser).consumed
        last = len(messages) - 1
        for i, (message, payload) in enumerate(messages):
            if not isinstance(message, RawRequestMessage) or not payload.is_eof():
                return messages[i:]
            answer = self._answer(message, payload, self) if self._answer is not None else None
            if answer is None:
                # Taken by the app only when nothing is pipelined behind it (that goes to aiohttp as it is).
                job = None
                if self._own is not None and i == last:
                    self._taking = True  # (it reads the body: see resume_reading)
                    try:
                        job = self._own(message, payload, self)
                    finally:
                        self._taking = False
                if job is None:
                    self._resume_later = False
                    return messages[i:]
                # Something to resume after its answer only if reading was paused for a body (and its read
                # asked to resume), or the parser stopped at its bound of messages in flight (those parsed
                # now, as nothing was in progress), keeping the rest unparsed — whether or not anything
                # asked: else nothing was paused, nothing is kept.
                bound = getattr(self, "_max_msg_queue_size", 0)  # (3.14's parser's bound; none before)
                self._resume_later = (self._resume_later and self._reading_paused) or (
                    bool(bound) and len(messages) >= bound)
                consumed()
                self._answered += 1
                self._keepalive = False  # (no keep-alive close while it is answered: see _taken_done)
                self._taken = self._loop.create_task(job)
                self._taken.add_done_callback(self._taken_done)
                return ()
            consumed()
            transport.write(answer)
            self._answered += 1
            self._kept_alive()
        return ()

    def _kept_alive(self) -> None:
        """Kept alive, as after any response: the keep-alive timer counts from this one (aiohttp's)."""
        self._keepalive = True
        close_time = self._loop.time() + self._keepalive_timeout
        self._next_keepalive_close_time = close_time
        if self._keepalive_handle is None and self._keepalive_timeout > 0:
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)

    def _taken_done(self, task: asyncio.Task[tuple[bytes, bool]]) -> None:
        """A request the app took is answered: its answer is written, then what arrived meanwhile is
        read as if it had just arrived. (Cancelled: the client left; nothing to write to.)"""
        self._taken = None
        if task.cancelled():
            return
        transport = cast(asyncio.Transport | None, self.transport)
        exc = task.exception()
        if exc is not None:  # (the app's answer answers its failures: this is a bug, not the client's)
            log.error("own_answer_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            if transport is not None:
                transport.close()
            return
        answer, close = task.result()
        if transport is None or transport.is_closing():
            return
        transport.write(answer)
        if close:
            transport.close()
            return
        self._kept_alive()
        if self._resume_later:  # (first: what the parser kept came before what was held)
            self._resume_later = False
            super().resume_reading()
        if self._held_paused:
            self._held_paused = False
            transport.resume_reading()
        if self._held_input:
            held, self._held_input, self._held_bytes = b"".join(self._held_input), [], 0
            self.data_received(held)

    def resume_reading(self, resume_parser: bool = True) -> None:
        """aiohttp's, except while a request is taken: reading its whole body (every read that leaves a
        payload under its low-water mark asks to resume, paused or not) resumed the parser at once,
        re-entering :meth:`data_received` in the middle of taking it, before its task was set: a pass
        through the connection's and aiohttp's parsing per taken request for nothing, and, had the
        parser kept requests unparsed, them parsed and answered or handed to aiohttp ahead of it. So it
        waits for the answer (:meth:`_taken_done`), as what arrives meanwhile does, and is skipped
        where nothing was paused."""
        if self._taking or self._taken is not None:
            self._resume_later = True
            return
        super().resume_reading(resume_parser)

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        # A request the app took is answered before the connection goes, as aiohttp waits for its own.
        if self._taken is not None:
            await asyncio.wait({self._taken}, timeout=timeout)
        await super().shutdown(timeout)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # Idle waiting for a message = the head is still incomplete (aiohttp's keep-alive check, too).
        if self._waiter is None or self._waiter.done() or self.transport is None:
            return
        self._connections.refused("header_timeout")
        log.debug("head_timed_out", peer=str(self.peername), seconds=self._header_timeout)
        self._close_gently(self._timed_out)

    def _close_gently(self, answer: bytes) -> None:
        transport = cast(asyncio.Transport | None, self.transport)
        if transport is None or transport.is_closing():
            return
        transport.write(answer)
        self.transport = None  # aiohttp's loop no longer closes it at once: the linger timer does
        self._linger_timer = _linger(transport)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, BadHttpMessage):
            return super().handle_error(request, status, exc, message)
        err: CoalesceError
        if isinstance(exc, LineTooLong) or "Too many headers" in exc.message:
            reason = "headers_too_large"
            err = HeadersTooLarge(
                f"The request line or a header field is longer than {self.max_field_size} bytes, or the "
                f"request has more than {self.max_headers} header fields."
            )
        else:
            reason = "malformed"
            what = exc.message.splitlines()[0].rstrip(": ")[:100]  # not the client's bytes it quotes
            err = InvalidRequest(f"Malformed HTTP request: {what}.", code="malformed_request")
        self._connections.refused(reason)
        log.debug("head_refused", reason=reason, peer=str(self.peername), error=exc.message[:200])
        self._refused_head = True
        rendered = render(err, Dialect.OPENAI)
        resp = web.Response(
            body=encoder.encode(rendered.body), status=rendered.status, content_type="application/json",
            headers=rendered.headers,
        )
        resp.force_close()
        return resp

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        result = await super().finish_response(request, resp, start_time)
        self._finished += 1
        self._awaiting_head = True
        self.head_at = None
        self._stop_head_timer()
        if self._refused_head:
            self._close_gently(b"")
        return result


class _Refusal(asyncio.Protocol):
    """A connection past the cap: answered at its first bytes (or after ``LINGER_S`` of silence), then
    closed gently. ``GET /health`` gets 200, anything else 503 with Retry-After."""

    def __init__(self, busy: bytes, alive: bytes) -> None:
        self._busy, self._alive = busy, alive
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, self._answer, b"")

    def data_received(self, data: bytes) -> None:
        if not self._answered:
            self._answer(data)

    def eof_received(self) -> None:
        if not self._answered:
            self._answer(b"")

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None

    def _answer(self, head: bytes) -> None:
        self._answered = True
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is None or self._transport.is_closing():
            return
        self._transport.write(self._alive if head.startswith(_LIVENESS) else self._busy)
        self._timer = _linger(self._transport)


class GuardedSite(web.BaseSite):
    """A TCP listener for an ``AppRunner`` whose connections get the guarded handler, or, past the cap,
    a refusal. Used by ``serve`` in one process and in each ``--workers`` gateway alike."""

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, *, backlog: int = 2048, reuse_port: bool = False
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._app = runner.app
        self._host, self._port, self._reuse_port = host, port, reuse_port
        settings = self._app[SETTINGS]
        self._header_timeout = settings.header_timeout_s
        self._kwargs = handler_kwargs(settings)
        self._timed_out = _raw_response(
            RequestTimeout(f"The request head did not arrive within {settings.header_timeout_s:g} s.")
        )
        self._busy = _raw_response(
            Unavailable("This server has as many connections as it takes; retry shortly.", retry_after=1,
                        code="too_many_connections")
        )
        self._alive = _raw_response(None, {"status": "ok"})
        self.connections = Connections(settings.max_connections, self._app[METRICS])

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        wanted = self._app[SETTINGS].max_connections
        fd_limit = raise_fd_limit()
        self.connections.cap = connection_cap(wanted, fd_limit)
        if self.connections.cap < wanted:
            log.warning("max_connections_lowered", wanted=wanted, cap=self.connections.cap, fd_limit=fd_limit)
        # Not loop.create_server: uvloop's listener accepts one connection a turn (listener.py).
        socks = listener.bind(self._host, self._port, self._backlog, self._reuse_port)
        self._server = cast(asyncio.AbstractServer, listener.Listener(socks, self._accept))

    def _accept(self) -> asyncio.Protocol:
        if self.connections.full:
            self.connections.refused("over_capacity")
            return _Refusal(self._busy, self._alive)
        server = self._runner.server
        assert server is not None  # BaseSite refuses a runner that is not set up
        return _GuardedHandler(
            server, connections=self.connections, header_timeout=self._header_timeout,
            timed_out=self._timed_out, answer=self._app.get(HEAD_ANSWER), own=self._app.get(OWN_ANSWER),
            **self._kwargs,
        )


class Taken:
    """What a request the app took (:data:`OWN_ANSWER`) keeps of its connection as it was when taken, as
    its ``protocol``: when its head began to arrive, and the hold the head's check took for it."""

    __slots__ = ("head_at", "head_held")

    def __init__(self, protocol: _GuardedHandler) -> None:
        self.head_at = protocol.head_at
        self.head_held, protocol.head_held = protocol.head_held, None


def arrived(request: web.BaseRequest) -> float:
    """When ``request``'s head began to arrive, on ``time.monotonic()``'s clock (now if unknown)."""
    now = time.monotonic()
    protocol = request.protocol
    head_at = protocol.head_at if isinstance(protocol, (_GuardedHandler, Taken)) else None
    return now if head_at is None or head_at > now else head_at


def held_at_head(request: web.BaseRequest) -> Hold | None:
    """The hold of ``request``'s room if the app's answer on the connection (:data:`HEAD_ANSWER`)
    passed it (read once: it is this request's, and cleared); None if it did not judge it."""
    protocol = request.protocol
    if isinstance(protocol, (_GuardedHandler, Taken)) and protocol.head_held is not None:
        held, protocol.head_held = protocol.head_held, None
        return held
    return None


def body_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body exceeds this server's limit of {limit} bytes.")


async def read_body(request: web.Request, app: web.Application) -> None:
    """Read a request's body before its route does, within ``--body-timeout-s``; a declared length over
    ``--max-body-bytes`` is refused unread. A route's own ``request.read()`` then returns the buffer. A
    step of the app's one middleware (``app.front``)."""
    if request.body_exists:
        settings = app[SETTINGS]
        if (request.content_length or 0) > settings.max_body_bytes:
            raise body_too_large(settings.max_body_bytes)
        if request.content.is_eof():  # it came whole with the head (a small one): nothing to wait for
            await request.read()
            return
        try:
            async with asyncio.timeout(settings.body_timeout_s):
                await request.read()
        except TimeoutError:
            app[METRICS].connections_refused.labels("body_timeout").inc()
            raise RequestTimeout(
                f"The request body did not arrive within {settings.body_timeout_s:g} s."
            ) from None
