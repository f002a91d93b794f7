"""The raw load-test client: its response parser on byte streams cut anywhere, and its connections
against a loopback server (reuse, ``Connection: close``, the in-flight cap)."""

from __future__ import annotations

import asyncio
import gc
import math
from typing import Any

import pytest
from aiohttp import web
from coalesce.loadtests.engine import Recorder, collector_aside
from coalesce.loadtests.rawclient import RawClient, ResponseParser
from coalesce.loadtests.workload import Payload

OK = b'{"data":[{"index":0,"embedding":"AAAA"}]}'
RESPONSES = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-queue-time: 1.5\r\nContent-Length: %d\r\n\r\n%s"
    % (len(OK), OK)
    + b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nContent-Length: 2\r\n\r\n{}"
    + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=1\r\n world\r\n0\r\n\r\n"
    + b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
)


def _parse_in_pieces(data: bytes, size: int) -> list[tuple[int, dict[str, str], bytes]]:
    parser = ResponseParser()
    out = []
    for i in range(0, len(data), size):
        out += parser.feed(data[i : i + size])
    assert not parser.broken
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(RESPONSES)])
def test_responses_parse_the_same_however_the_bytes_arrive(size: int) -> None:
    got = _parse_in_pieces(RESPONSES, size)
    assert [(status, body) for status, _, body in got] == [(200, OK), (429, b"{}"), (200, b"hello world"),
                                                           (204, b"")]
    assert got[0][1]["x-queue-time"] == "1.5"  # names lower-cased
    assert got[1][1]["retry-after"] == "2"
    assert got[3][1]["connection"] == "close"


@pytest.mark.parametrize("garbage", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 abc OK\r\n\r\n",
                                     b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"])
def test_bytes_that_are_not_a_response_break_the_parser(garbage: bytes) -> None:
    parser = ResponseParser()
    assert parser.feed(garbage) == [] and parser.broken


def _payload(i: int = 0) -> Payload:
    return Payload(b'{"model":"m","input":"text %d"}' % i, 1, (3,))


async def _serve(path: str, handler: Any) -> tuple[web.AppRunner, str]:
    """A loopback server answering POST ``path`` with ``handler``: its runner and base URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_connections_are_kept_alive_and_capped() -> None:
    peers: set[object] = set()
    inflight = peak = 0

    async def embed(request: web.Request) -> web.Response:
        nonlocal inflight, peak
        await request.read()
        peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.02)
        inflight -= 1
        return web.json_response({"data": [{"index": 0, "embedding": [0.0]}]})

    runner, base = await _serve("/v1/embeddings", embed)
    client = RawClient(base + "/v1/embeddings", max_inflight=3, timeout_s=5.0)
    rec = Recorder()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(30):  # all at once: three go out, the rest wait for a free connection
            client.fire(_payload(i), t0, t0, rec)
        await client.drain()
    finally:
        await client.close()
        await runner.cleanup()
    assert rec.status == [200] * 30
    assert peak <= 3  # never more than the cap in flight
    assert len(peers) == 3  # three connections opened at once, then reused for the other 27
    # The queued requests' wait counts: the last answers came about ten service times after t0.
    assert max(rec.done) >= 9 * 0.02


async def test_a_server_that_closes_after_each_answer_costs_a_connection_each() -> None:
    peers: set[object] = set()

    async def embed(request: web.Request) -> web.Response:
        await request.read()
        peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        body = {"data": [{"index": 0, "embedding": [0.0]}]}
        return web.json_response(body, headers={"Connection": "close"})

    runner, base = await _serve("/e", embed)
    client = RawClient(base + "/e", max_inflight=2, timeout_s=5.0)
    rec = Recorder()
    try:
        t0 = asyncio.get_running_loop().time()
        for i in range(6):
            await client.timed(_payload(i), t0, t0, rec)
    finally:
        await client.close()
        await runner.cleanup()
    assert rec.status == [200] * 6 and len(peers) == 6
    assert all(math.isnan(q) for q in rec.queue_ms)  # no x-queue-time header: NaN, as aiohttp's client


def test_only_plain_http_urls() -> None:
    with pytest.raises(ValueError, match="http://"):
        RawClient("https://example.invalid/v1/embeddings", 4, 1.0)


async def test_a_run_keeps_what_it_holds_out_of_the_collector_s_full_passes() -> None:
    # A run's bodies are made before its clock starts and its records grow as it runs: half a million
    # objects in the ten-minute soak, which each full collection walked with the generator's loop
    # stopped, delaying sends due meanwhile (latency from the scheduled send time then charged the
    # pause to the server). Frozen, they are out of every collection's reach until the run ends.
    if gc.get_freeze_count():
        pytest.skip("something in this process froze its heap already")
    bodies = [_payload(i) for i in range(5000)]
    gc.collect()  # (old enough for the full passes)
    async with collector_aside(every_s=0.02):
        in_full_pass = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(b) in in_full_pass for b in bodies)
        records = [[i] for i in range(1000)]  # what the run adds while it runs
        await asyncio.sleep(0.2)
        gc.collect()
        in_full_pass = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(r) in in_full_pass for r in records)
        assert gc.get_freeze_count() >= len(bodies) + len(records)
    assert gc.get_freeze_count() == 0  # handed back: collectable again once the run lets go of them
