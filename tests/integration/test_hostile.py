"""Hostile clients against a real server on loopback (fake runner): each is cut off in bounded time with
an answer it can read, while a polite client keeps being served in normal time.

Each test prints one ``outcome:`` line (``pytest -s``): what the hostile client saw, how long it took,
and what the bystander saw meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from coalesce.service.gateway.guard import LINGER_S
from coalesce.service.settings import build

from ..conftest import metric, metrics_text
from ..fakes import FakeRunner
from .rawhttp import Answer, Bystander, connect, read_answer, request, trickle

EMBED = b'{"model": "fake", "input": "hello"}'


def start(serve: Any, *flags: str) -> Any:
    return serve(build(list(flags), environ={}), lambda s: FakeRunner())


async def settle(srv: Any, at_most: int = 0, timeout: float = 10.0) -> None:
    """Wait until the server holds at most ``at_most`` connections (the readiness poll's may linger)."""
    deadline = time.monotonic() + timeout
    while srv.site.connections.open > at_most and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert srv.site.connections.open <= at_most, srv.site.connections.open


async def refusals(srv: Any, reason: str) -> float:
    return metric(await metrics_text(srv.url), "coalesce_connections_refused_total", reason=reason)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """Samples this process's resident memory every 10 ms; yields [growth of the peak over the start]."""
    base, peak, stop = rss_bytes(), [rss_bytes()], threading.Event()

    def sample_rss() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], rss_bytes())

    thread = threading.Thread(target=sample_rss, daemon=True)
    thread.start()
    out = [0]
    try:
        yield out
    finally:
        stop.set()
        thread.join(5)
        out[0] = max(peak[0], rss_bytes()) - base


async def _all_timed_out(srv: Any, results: list[tuple[Answer, float, float]], reason: str,
                         case: str, bystander: Bystander) -> None:
    """Every trickling client got 408 in the error shape with Connection: close, after the 1.5 s timeout
    and well before its 30 s of trickling, and the server counted each refusal under ``reason``; prints
    the ``case``'s outcome line."""
    for answer, answered, closed in results:
        assert answer.status == 408 and answer.eof
        assert answer.json()["error"]["code"] == "request_timeout"
        assert answer.headers["connection"] == "close"
        assert 1.0 <= answered < 6.0 and closed < answered + 5.0
    assert await refusals(srv, reason) == len(results)
    print(f"outcome: {case}: 408 after at most {max(r[1] for r in results):.1f} s, closed by "
          f"{max(r[2] for r in results):.1f} s; bystander: {bystander.summary()}")


async def test_slow_heads_get_408_at_the_header_timeout_while_others_are_served(serve: Any) -> None:
    srv = start(serve, "--header-timeout-s", "1.5")
    bystander = Bystander(srv.url).start()
    try:
        # 20 slowloris clients, half on a fresh connection, half after a request on a kept-alive one:
        # a header line every 0.3 s, for 30 s if nobody stops them.
        results = await asyncio.gather(*(
            trickle(srv.port, b"POST /v1/embeddings HTTP/1.1\r\n", b"X-Slow: 1\r\n", 0.3, 30.0,
                    warm=i % 2 == 1)
            for i in range(20)
        ))
    finally:
        await bystander.finish()
    await _all_timed_out(srv, results, "header_timeout",
                         "slow head (20 clients, 1 header line/0.3 s, --header-timeout-s 1.5)", bystander)


async def test_a_slow_body_gets_408_at_the_body_timeout(serve: Any) -> None:
    srv = start(serve, "--body-timeout-s", "1.5")
    bystander = Bystander(srv.url).start()
    try:
        head = request("POST", "/v1/embeddings", headers={"Content-Type": "application/json",
                                                         "Content-Length": "200"})
        results = await asyncio.gather(*(trickle(srv.port, head + b"{", b" ", 0.3, 30.0) for _ in range(10)))
    finally:
        await bystander.finish()
    await _all_timed_out(srv, results, "body_timeout",
                         "slow body (10 clients, 1 byte/0.3 s of 200, --body-timeout-s 1.5; the close after "
                         "a 2 s lingering read)", bystander)


async def test_past_the_connection_cap_a_client_is_answered_503_with_retry_after(serve: Any) -> None:
    srv = start(serve, "--max-connections", "10")
    await settle(srv)
    held = []
    for _ in range(10):  # each is accepted and answered, then idles on keep-alive
        reader, writer = await connect(srv.port)
        writer.write(request("GET", "/ready"))
        assert (await read_answer(reader, then_eof=False)).status == 200
        held.append(writer)
    assert srv.site.connections.open == 10
    try:
        t0 = time.monotonic()
        reader, writer = await connect(srv.port)
        writer.write(request("POST", "/v1/embeddings", EMBED, {"Content-Type": "application/json"}))
        refused = await read_answer(reader)
        refused_s = time.monotonic() - t0
        writer.close()
        assert refused.status == 503 and refused.eof
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_connections"
        assert refused_s < LINGER_S  # closed at once, not after a lingering read of the request
        # Liveness stays green at the cap (busy is not dead); readiness does not.
        reader, writer = await connect(srv.port)
        writer.write(request("GET", "/health"))
        assert (await read_answer(reader)).status == 200
        writer.close()
    finally:
        for w in held:
            w.close()
    await settle(srv)
    reader, writer = await connect(srv.port)
    writer.write(request("POST", "/v1/embeddings", EMBED, {"Content-Type": "application/json"}))
    assert (await read_answer(reader, then_eof=False)).status == 200
    writer.close()
    assert await refusals(srv, "over_capacity") == 2
    print(f"outcome: connection 11 of --max-connections 10: 503, Retry-After: 1, body, close in "
          f"{refused_s * 1e3:.0f} ms; GET /health at the cap: 200; served again once below the cap")


@pytest.mark.parametrize(
    ("case", "head"),
    [
        ("one 64 KiB header", request("GET", "/v1/models", headers={"X-Big": "a" * 65536})),
        ("200 headers", request("GET", "/v1/models", headers={f"X-H{i}": "v" for i in range(200)})),
        ("a 16 MiB header, all sent before reading",
         request("GET", "/v1/models", headers={"X-Huge": "a" * (16 << 20)})),
    ],
)
async def test_oversized_heads_get_431_with_a_body_not_a_reset(serve: Any, case: str, head: bytes) -> None:
    srv = start(serve)
    bystander = Bystander(srv.url).start()
    try:
        reader, writer = await connect(srv.port)
        t0 = time.monotonic()
        writer.write(head)
        await writer.drain()  # a reset would raise here
        answer = await read_answer(reader)
        took = time.monotonic() - t0
        writer.close()
    finally:
        await bystander.finish()
    assert answer.status == 431 and answer.eof
    assert answer.json()["error"]["code"] == "headers_too_large"
    assert took < 5.0
    print(f"outcome: {case}: 431 + JSON body + close in {took * 1e3:.0f} ms, no reset; "
          f"bystander: {bystander.summary()}")


async def test_a_malformed_request_gets_400_in_the_error_shape(serve: Any) -> None:
    srv = start(serve)
    reader, writer = await connect(srv.port)
    writer.write(b"\x16\x03\x01 not http at all\r\n\r\n")  # e.g. TLS to the plain-text port
    answer = await read_answer(reader)
    writer.close()
    assert answer.status == 400 and answer.eof
    assert answer.json()["error"]["code"] == "malformed_request"


async def stream_chunked(port: int, limit_bytes: int, chunk: bytes) -> tuple[Answer, int, float]:
    """POST a chunked body of up to ``limit_bytes``, reading meanwhile; stops at the answer. Returns the
    answer, the bytes sent by then, and the seconds it took."""
    reader, writer = await connect(port)
    head = request("POST", "/v1/embeddings", headers={"Content-Type": "application/json",
                                                     "Transfer-Encoding": "chunked"})
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    t0 = time.monotonic()
    writer.write(head)
    answer = asyncio.ensure_future(read_answer(reader, timeout=60, then_eof=False))
    sent = 0
    try:
        while sent < limit_bytes and not answer.done():
            writer.write(frame)
            sent += len(chunk)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(0)  # let the answer in (drain need not yield)
        got, took = await answer, time.monotonic() - t0
        got.eof = await asyncio.wait_for(reader.read(1), 10) == b""  # then the server closes
        return got, sent, took
    finally:
        answer.cancel()
        writer.close()


async def test_a_chunked_body_past_the_limit_gets_413_without_being_buffered(serve: Any) -> None:
    srv = start(serve, "--max-body-bytes", str(1 << 20))
    bystander = Bystander(srv.url).start()
    try:
        with peak_rss_growth() as growth:
            answer, sent, took = await stream_chunked(srv.port, 512 << 20, b"x" * 65536)
    finally:
        await bystander.finish()
    assert answer.status == 413 and answer.eof
    assert answer.json()["error"]["code"] == "payload_too_large"
    assert sent < 128 << 20, "the answer should come near the limit, not after the whole body"
    assert growth[0] < 48 << 20, f"resident memory grew {growth[0] >> 20} MiB"
    print(f"outcome: chunked body streamed against --max-body-bytes 1 MiB: 413 + close after "
          f"{sent >> 20} MiB sent, {took * 1e3:.0f} ms; peak RSS growth {growth[0] >> 20} MiB "
          f"(up to 512 MiB would have been sent); bystander: {bystander.summary()}")


async def test_a_declared_length_past_the_limit_gets_413_before_the_body(serve: Any) -> None:
    srv = start(serve, "--max-body-bytes", str(1 << 20))
    reader, writer = await connect(srv.port)
    t0 = time.monotonic()
    writer.write(request("POST", "/v1/embeddings", headers={"Content-Type": "application/json",
                                                           "Content-Length": str(1 << 30)}))
    answer = asyncio.ensure_future(read_answer(reader, timeout=30, then_eof=False))
    sent = 0
    with peak_rss_growth() as growth:
        while sent < 1 << 30 and not answer.done():
            writer.write(b"x" * 65536)
            sent += 65536
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(0)  # let the answer in (drain need not yield)
        got = await answer
        took = time.monotonic() - t0
        got.eof = await asyncio.wait_for(reader.read(1), 10) == b""
    writer.close()
    assert got.status == 413 and got.eof
    assert sent < 256 << 20
    assert growth[0] < 48 << 20
    print(f"outcome: Content-Length 1 GiB against a 1 MiB limit: 413 + close after {took * 1e3:.0f} ms and "
          f"{sent >> 20} MiB sent; peak RSS growth {growth[0] >> 20} MiB")


async def test_bytes_past_a_lying_content_length_are_a_new_malformed_request(serve: Any) -> None:
    srv = start(serve)
    reader, writer = await connect(srv.port)
    lie = request("POST", "/v1/embeddings",
                  headers={"Content-Type": "application/json", "Content-Length": "8"})
    writer.write(lie + b'{"model"')
    first = await read_answer(reader, then_eof=False)
    writer.write(b"garbage " * 4096)  # what the client meant as the rest of its body
    second = await read_answer(reader)
    writer.close()
    assert first.status == 400  # the 8 declared bytes: not a whole JSON document
    assert second.status == 400 and second.eof  # the rest: not HTTP
    assert second.json()["error"]["code"] == "malformed_request"
    assert len(second.body) < 1000, "the answer must not echo the client's bytes"


async def test_idle_connections_are_closed_at_the_keepalive_timeout(serve: Any) -> None:
    srv = start(serve, "--keepalive-timeout-s", "1")
    await settle(srv)
    conns = []
    for i in range(20):
        reader, writer = await connect(srv.port)
        if i % 2 == 0:  # half make a request first, half never send a byte
            writer.write(request("GET", "/health"))
            assert (await read_answer(reader, then_eof=False)).status == 200
        conns.append((reader, writer))
    t0 = time.monotonic()
    closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 10) for r, _ in conns))
    took = time.monotonic() - t0
    for _, w in conns:
        w.close()
    assert closed == [b""] * 20
    assert took < 5.0
    await settle(srv)


IDLE = 5000


async def test_thousands_of_idle_keepalive_connections_leave_others_served_in_normal_time(serve: Any) -> None:
    srv = start(serve)  # listening raised this process's soft limit to the hard one
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < 2 * IDLE + 512:  # both ends live in this process
        pytest.skip(f"RLIMIT_NOFILE {soft} is below the {2 * IDLE + 512} this test needs")
    await settle(srv)
    base = Bystander(srv.url, every=0.0).start()  # latency with nothing else connected
    await asyncio.sleep(1.0)
    await base.finish()

    async def idle_client() -> asyncio.StreamWriter:
        reader, writer = await connect(srv.port)
        writer.write(request("GET", "/health"))
        assert (await read_answer(reader, then_eof=False)).status == 200
        return writer

    rss0 = rss_bytes()
    writers: list[asyncio.StreamWriter] = []
    try:
        for _ in range(IDLE // 250):
            writers += await asyncio.gather(*(idle_client() for _ in range(250)))
        assert srv.site.connections.open >= IDLE
        per_conn = (rss_bytes() - rss0) / IDLE / 2  # both ends are in this process
        loaded = Bystander(srv.url, every=0.0).start()
        await asyncio.sleep(2.0)
        await loaded.finish()
    finally:
        for w in writers:
            w.close()
    await settle(srv, timeout=30)
    base_p50 = sorted(base.latencies)[len(base.latencies) // 2]
    p50 = sorted(loaded.latencies)[len(loaded.latencies) // 2]
    assert p50 < max(10 * base_p50, 0.25), (p50, base_p50)
    print(f"outcome: {IDLE} idle keep-alive connections: bystander p50 {p50 * 1e3:.1f} ms against "
          f"{base_p50 * 1e3:.1f} ms with none ({loaded.summary()}); ~{per_conn / 1024:.0f} KiB RSS per "
          f"connection end; RLIMIT_NOFILE {soft}")
