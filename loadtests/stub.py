"""A stub embeddings server with a known service time, for testing the generator and measuring its ceiling.

It speaks the OpenAI embeddings shape (zero vectors), exports Coalesce-named batch metrics (each request
is one "batch"), and can serve requests one at a time (``serial``: a single-server queue, so latency
under load is predictable) or all at once. Run it alone with ``python -m coalesce.loadtests.stub``.

``--raw``: the same answers to ``POST /v1/embeddings`` (and ``GET /ready``) from an ``asyncio.Protocol``
that frames HTTP/1.1 itself — keep-alive, ``Content-Length`` bodies only, no service time — instead of
aiohttp's request and response objects: the CPU a Python server must pay per request whatever its
framework (the socket's reads and writes, the event loop, the body's decode and encode, the same
metrics), so ``python -m coalesce.loadtests.stub_floor`` can say how much of a request's cost is
aiohttp's, and so what answering below it could save at most. A measuring tool only: it parses what the
load generator sends and nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from email.utils import formatdate

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class StubConfig:
    service_ms: float = 0.0  # time each request takes to "compute"
    serial: bool = False  # one request at a time (a queue forms under load) instead of all at once
    dim: int = 4
    reject_every: int = 0  # answer every n-th request with 429 (0: never)
    pause_on: int = 0  # the n-th request stalls the server for ``pause_s`` more (0: never)
    pause_s: float = 0.0
    model: str = "stub-model"


class _Request(msgspec.Struct):
    input: str | list[str]
    model: str = ""
    encoding_format: str = "float"


class _Metrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("coalesce_requests", "Requests.", ["route", "status"], registry=r)
        self.batches = Counter("coalesce_batches", "Batches run.", ["model"], registry=r).labels(model)
        self.inputs = Counter("coalesce_inputs", "Inputs embedded.", ["model"], registry=r).labels(model)
        self.size = Histogram(
            "coalesce_batch_size", "Inputs per batch.", ["model"], buckets=_BATCH_BUCKETS, registry=r
        ).labels(model)
        self.queue = Histogram("coalesce_queue_wait_seconds", "Queue wait.", ["model"], registry=r).labels(
            model
        )
        self.forward = Histogram("coalesce_forward_seconds", "Forward time.", ["model"], registry=r).labels(
            model
        )


class _Answers:
    """What both front ends answer an embeddings request with: its body's decode, the metrics, the
    payload's encode."""

    def __init__(self, cfg: StubConfig) -> None:
        self.cfg = cfg
        self.decoder = msgspec.json.Decoder(_Request)
        self.encoder = msgspec.json.Encoder()
        self.zeros_b64 = base64.b64encode(bytes(4 * cfg.dim)).decode()
        self.zeros = [0.0] * cfg.dim
        self.metrics = _Metrics(cfg.model)

    def embeddings(self, body: _Request, route: str, queued: float, forward_ms: float) -> bytes:
        texts = [body.input] if isinstance(body.input, str) else body.input
        metrics = self.metrics
        metrics.batches.inc()
        metrics.inputs.inc(len(texts))
        metrics.size.observe(len(texts))
        metrics.queue.observe(queued)
        metrics.forward.observe(forward_ms / 1000.0)
        metrics.requests.labels(route, "200").inc()
        vector: str | list[float] = self.zeros_b64 if body.encoding_format == "base64" else self.zeros
        payload = {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": vector} for i in range(len(texts))],
            "model": self.cfg.model,
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }
        return self.encoder.encode(payload)


def create_app(cfg: StubConfig) -> web.Application:
    """The stub's aiohttp application."""
    answers = _Answers(cfg)
    decoder = answers.decoder
    lock = asyncio.Lock()
    metrics = answers.metrics
    count = 0

    async def compute(n: int) -> float:
        seconds = cfg.service_ms / 1000.0 + (cfg.pause_s if n == cfg.pause_on else 0.0)
        if seconds > 0:
            await asyncio.sleep(seconds)
        return seconds * 1000.0

    async def embeddings(request: web.Request) -> web.Response:
        nonlocal count
        route = request.path
        count += 1
        n = count
        if cfg.reject_every and n % cfg.reject_every == 0:
            metrics.requests.labels(route, "429").inc()
            return web.json_response(
                {"error": {"message": "full", "type": "overloaded", "param": None, "code": "queue_full"}},
                status=429,
                headers={"Retry-After": "1"},
            )
        try:
            body = decoder.decode(await request.read())
        except msgspec.DecodeError as exc:
            metrics.requests.labels(route, "400").inc()
            return web.json_response(
                {
                    "error": {
                        "message": str(exc),
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                },
                status=400,
            )
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        if cfg.serial:
            async with lock:
                queued = loop.time() - arrived
                forward_ms = await compute(n)
        else:
            queued = 0.0
            forward_ms = await compute(n)
        return web.Response(
            body=answers.embeddings(body, route, queued, forward_ms),
            content_type="application/json",
            headers={"x-queue-time": f"{queued * 1000:.3f}", "x-inference-time": f"{forward_ms:.3f}"},
        )

    async def metrics_text(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), content_type="text/plain")

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": cfg.model, "object": "model", "created": 0, "owned_by": "stub"}],
            }
        )

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/embeddings", embeddings)
    app.router.add_get("/metrics", metrics_text)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/models", models)
    return app


class RawStub(asyncio.Protocol):
    """One connection of ``--raw`` (the module's docstring): requests framed by hand, answered in order."""

    _date: tuple[int, bytes] = (0, b"")

    def __init__(self, answers: _Answers) -> None:
        self._answers = answers
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buffer[:end]).split(b"\r\n")
            method, path = lines[0].split(b" ", 2)[:2]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(buffer) < end + 4 + length:
                return
            body = bytes(buffer[end + 4 : end + 4 + length])
            del buffer[: end + 4 + length]
            assert self._transport is not None
            self._transport.write(self._answer(method, path.decode("latin-1"), body))

    def _answer(self, method: bytes, path: str, body: bytes) -> bytes:
        if method == b"GET" and path == "/ready":
            return self._response(b"200 OK", b"ok", b"text/plain")
        if method != b"POST" or path not in ("/v1/embeddings", "/embeddings"):
            return self._response(b"404 Not Found", b"{}", b"application/json")
        try:
            request = self._answers.decoder.decode(body)
        except msgspec.DecodeError:
            self._answers.metrics.requests.labels(path, "400").inc()
            return self._response(b"400 Bad Request", b"{}", b"application/json")
        answer = self._answers.embeddings(request, path, 0.0, 0.0)
        return self._response(b"200 OK", answer, b"application/json")

    @classmethod
    def _response(cls, status: bytes, body: bytes, content_type: bytes) -> bytes:
        now = int(time.time())
        if cls._date[0] != now:  # (formatted once a second, as aiohttp does)
            cls._date = (now, formatdate(now, usegmt=True).encode())
        return b"".join((b"HTTP/1.1 ", status, b"\r\nContent-Type: ", content_type, b"\r\nContent-Length: ",
                         str(len(body)).encode(), b"\r\nDate: ", cls._date[1], b"\r\n\r\n", body))


@contextlib.asynccontextmanager
async def serve_raw(cfg: StubConfig, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Run the ``--raw`` stub on the current loop; yields its base URL (``http://host:port``)."""
    answers = _Answers(cfg)
    server = await asyncio.get_running_loop().create_server(lambda: RawStub(answers), host, port)
    try:
        yield f"http://{host}:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def serve(cfg: StubConfig, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Run the stub on the current loop; yields its base URL (``http://host:port``)."""
    runner = web.AppRunner(create_app(cfg), access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def serve_in_thread(cfg: StubConfig) -> Iterator[str]:
    """Run the stub on its own event loop in a daemon thread; yields its base URL."""
    started = threading.Event()
    stop: asyncio.Event | None = None
    loop = asyncio.new_event_loop()
    url = ""

    async def main() -> None:
        nonlocal stop, url
        stop = asyncio.Event()
        async with serve(cfg) as url:
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the stub server did not start")
    try:
        yield url
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coalesce.loadtests.stub", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--service-ms", type=float, default=0.0)
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("--dim", type=int, default=4, help="width of the (zero) vectors it answers")
    parser.add_argument("--raw", action="store_true",
                        help="answer from a protocol that frames HTTP itself, not aiohttp (no service time)")
    args = parser.parse_args(argv)
    cfg = StubConfig(service_ms=args.service_ms, serial=args.serial, dim=args.dim)
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop | None = uvloop.new_event_loop()
    except ImportError:
        loop = None
    if args.raw:
        if args.service_ms or args.serial:
            parser.error("--raw has no service time and no queue")
        loop = loop or asyncio.new_event_loop()

        async def forever() -> None:
            async with serve_raw(cfg, args.host, args.port):
                await asyncio.Event().wait()

        with contextlib.suppress(KeyboardInterrupt):
            loop.run_until_complete(forever())
        return
    web.run_app(create_app(cfg), host=args.host, port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
