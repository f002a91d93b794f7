"""A lean HTTP/1.1 client for load generation: keep-alive connections as asyncio protocols, pre-encoded
request bytes, and just enough response parsing to record what the aiohttp client records.

Why not aiohttp's client here: on a small machine the load generator shares the cores with the server
it measures, and aiohttp's client costs several times what this one does per request (its request
and response objects, header multidicts, connector bookkeeping). Under overload that difference is
CPU taken from the server's model, so the measured goodput said more about the generator than about
the server. Neither ``httpx`` nor ``aiohttp`` offers a cheaper mode, and ``wrk`` (C) cannot schedule
Poisson arrivals or record per-request outcomes against their scheduled send time; so this module
speaks the small subset of HTTP/1.1 a load test needs (``Content-Length`` and chunked bodies,
keep-alive, ``Connection: close``) and nothing else. It is a measuring tool, not a general client:
``coalesce loadtest --client raw``.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from coalesce.loadtests.engine import (
    STATUS_BAD_RESPONSE,
    STATUS_CONNECTION,
    STATUS_TIMEOUT,
    Recorder,
    response_holds,
)
from coalesce.loadtests.workload import Payload

Outcome = tuple[int, float, float, bool]  # status, x-queue-time ms, x-inference-time ms, Retry-After


class ResponseParser:
    """Feeds on a connection's bytes; yields each complete response as (status, headers, body).

    Headers come back lower-cased, last value wins. ``broken`` is set on bytes that are not an
    HTTP/1.1 response (the connection is then closed)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._head: tuple[int, dict[str, str]] | None = None
        self._need = -1  # body bytes still expected after the head; -2 chunked
        self.broken = False

    def feed(self, data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
        self._buf += data
        out = []
        while not self.broken:
            done = self._step()
            if done is None:
                break
            out.append(done)
        return out

    def _step(self) -> tuple[int, dict[str, str], bytes] | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[: end + 4]
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                self.broken = True
                return None
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self._head = (int(parts[1]), headers)
            if headers.get("transfer-encoding", "").lower() == "chunked":
                self._need = -2
            else:
                try:
                    self._need = int(headers.get("content-length", "0"))
                except ValueError:
                    self.broken = True
                    return None
        status, headers = self._head
        if self._need == -2:
            body = self._chunked()
            if body is None:
                return None
        else:
            if len(buf) < self._need:
                return None
            body = bytes(buf[: self._need])
            del buf[: self._need]
        self._head = None
        return status, headers, body

    def _chunked(self) -> bytes | None:
        """The whole chunked body once its last chunk (and trailer) is in, consumed; else None."""
        buf, pos = self._buf, 0
        parts: list[bytes] = []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            try:
                size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            except ValueError:
                self.broken = True
                return None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)  # an empty trailer: the size line's CRLF then one more
                if end < 0:
                    return None
                del buf[: end + 4]
                return b"".join(parts)
            if len(buf) < eol + 2 + size + 2:
                return None
            parts.append(bytes(buf[eol + 2 : eol + 2 + size]))
            pos = eol + 2 + size + 2


Done = Callable[[Outcome], None]


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, client: RawClient) -> None:
        self._client = client
        self._parser = ResponseParser()
        self.transport: asyncio.Transport | None = None
        self.done: Done | None = None  # the request in flight's callback
        self.n_inputs = 0
        self.since = 0.0  # when the request in flight was sent
        self.reusable = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._client._connected(self)

    def send(self, request: bytes, n_inputs: int, done: Done, now: float) -> None:
        assert self.transport is not None
        self.done, self.n_inputs, self.since = done, n_inputs, now
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        for status, headers, body in self._parser.feed(data):
            if headers.get("connection", "").lower() == "close":
                self.reusable = False
            self._finish(_outcome(status, headers, body, self.n_inputs))
        if self._parser.broken:
            self.reusable = False
            self._finish((STATUS_BAD_RESPONSE, math.nan, math.nan, False))

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.transport = None
        self._finish((STATUS_CONNECTION, math.nan, math.nan, False))
        self._client._lost(self)

    def _finish(self, outcome: Outcome) -> None:
        done, self.done = self.done, None
        if done is not None:
            done(outcome)
            self._client._free(self)

    def expire(self) -> None:
        """The request in flight timed out: record it so, and drop the connection (an answer may still
        come on it, which nobody would read)."""
        self.reusable = False
        self._finish((STATUS_TIMEOUT, math.nan, math.nan, False))

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


def _ms(headers: dict[str, str], name: str) -> float:
    try:
        return float(headers.get(name, "nan"))
    except ValueError:
        return math.nan


def _outcome(status: int, headers: dict[str, str], body: bytes, n_inputs: int) -> Outcome:
    if status == 200 and not response_holds(body, n_inputs):
        status = STATUS_BAD_RESPONSE
    return status, _ms(headers, "x-queue-time"), _ms(headers, "x-inference-time"), "retry-after" in headers


class RawClient:
    """Sends payloads to one ``http://`` embeddings URL over at most ``max_inflight`` keep-alive
    connections; :meth:`timed` has the contract of :class:`.engine.Client`'s, and :meth:`fire` sends
    without a task or a future per request (what ``engine.run_open`` uses).

    A request waits in this client's queue while ``max_inflight`` are in flight, or while its
    connection opens; that wait counts as latency, as any client-side queue's would."""

    SWEEP_S = 0.25  # how often requests are checked against the timeout

    def __init__(self, url: str, max_inflight: int, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the raw client speaks plain http:// only, not {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                      "Content-Length: ").encode()
        self._timeout_s = timeout_s
        self._max = max_inflight
        self._connections = 0  # open or opening
        self._idle: deque[_Connection] = deque()
        self._busy: set[_Connection] = set()
        self._queue: deque[tuple[bytes, int, Done, float]] = deque()  # (request, inputs, done, queued at)
        self._sweeper: asyncio.TimerHandle | None = None
        self._opening: set[asyncio.Task[None]] = set()

    def request_bytes(self, payload: Payload) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self._head, len(payload.body), payload.body)

    def fire(self, payload: Payload, due: float, t0: float, rec: Recorder) -> None:
        """Send ``payload`` now (or once a connection is free) and record it against ``due`` when
        answered."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        n = payload.n_inputs

        def done(outcome: Outcome) -> None:
            status, queue_ms, infer_ms, retry_after = outcome
            rec.add(due - t0, started - t0, loop.time() - t0, status, n, queue_ms, infer_ms, retry_after)

        self._queue.append((self.request_bytes(payload), n, done, started))
        self._pump()

    async def timed(self, payload: Payload, due: float, t0: float, rec: Recorder) -> None:
        """As :meth:`.engine.Client.timed`: send, wait for the answer, record it against ``due``."""
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[None] = loop.create_future()
        started = loop.time()
        n = payload.n_inputs

        def done(outcome: Outcome) -> None:
            status, queue_ms, infer_ms, retry_after = outcome
            rec.add(due - t0, started - t0, loop.time() - t0, status, n, queue_ms, infer_ms, retry_after)
            if not answered.done():
                answered.set_result(None)

        self._queue.append((self.request_bytes(payload), n, done, started))
        self._pump()
        await answered

    async def drain(self) -> None:
        """Until every request sent has been answered (or has timed out)."""
        while self._queue or self._busy:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
        await asyncio.sleep(0)  # let the transports close

    def _pump(self) -> None:
        """Hand queued requests to idle connections; open more while under the cap."""
        queue, idle = self._queue, self._idle
        loop = asyncio.get_running_loop()
        while queue and idle:
            conn = idle.pop()
            if conn.transport is None or not conn.reusable:
                continue
            request, n, done, _ = queue.popleft()
            self._busy.add(conn)
            conn.send(request, n, done, loop.time())
        opening = self._connections - len(self._busy) - len(idle)
        want = min(len(queue) - opening, self._max - self._connections)
        for _ in range(max(0, want)):
            self._connections += 1
            task = loop.create_task(self._open())
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
        if self._sweeper is None and (queue or self._busy):
            self._sweeper = loop.call_later(self.SWEEP_S, self._sweep)

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self._host, self._port), self._timeout_s
            )
        except (OSError, TimeoutError):
            self._connections -= 1
            if self._queue:  # this request cannot be sent: say so rather than retry forever
                _, _, done, _ = self._queue.popleft()
                done((STATUS_CONNECTION, math.nan, math.nan, False))
            self._pump()

    def _connected(self, conn: _Connection) -> None:
        self._idle.append(conn)
        self._pump()

    def _free(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if conn.reusable and conn.transport is not None:
            self._idle.append(conn)
        else:
            conn.close()
        self._pump()

    def _lost(self, conn: _Connection) -> None:
        self._connections -= 1
        self._busy.discard(conn)
        self._pump()

    def _sweep(self) -> None:
        """Time out requests in flight (or still queued) for longer than the timeout."""
        self._sweeper = None
        loop = asyncio.get_running_loop()
        limit = loop.time() - self._timeout_s
        for conn in [c for c in self._busy if c.since < limit]:
            conn.expire()
            conn.close()
        while self._queue and self._queue[0][3] < limit:
            _, _, done, _ = self._queue.popleft()
            done((STATUS_TIMEOUT, math.nan, math.nan, False))
        if self._queue or self._busy:
            self._sweeper = loop.call_later(self.SWEEP_S, self._sweep)
