"""The ``--raw`` stub answers what the aiohttp stub answers, framing HTTP itself; the floor tool's sums."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
from coalesce.loadtests.stub import StubConfig, serve, serve_raw
from coalesce.loadtests.stub_floor import report


def _post(body: bytes) -> bytes:
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head.split(b"\r\n")[0], await reader.readexactly(length)


@pytest.mark.asyncio
async def test_the_raw_stub_answers_requests_in_order_on_one_connection_however_they_arrive() -> None:
    async with serve_raw(StubConfig(dim=8)) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        one, two = _post(b'{"input": "a", "model": "m"}'), _post(b'{"input": ["a", "b", "c"], "model": "m"}')
        writer.write(one + two)  # pipelined in one write
        writer.write(one[:10])  # and one split across writes, its body last
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(one[10:-3])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(one[-3:] + b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n" + _post(b"{not json"))
        async with asyncio.timeout(10):  # (a request it failed to frame would leave its answer unwritten)
            answers = [await _read_answer(reader) for _ in range(5)]
        writer.close()
    statuses = [status for status, _ in answers]
    assert statuses == [b"HTTP/1.1 200 OK"] * 4 + [b"HTTP/1.1 400 Bad Request"], statuses
    counts = [len(msgspec.json.decode(body)["data"]) for _, body in answers[:3]]
    assert counts == [1, 3, 1]
    assert answers[3][1] == b"ok"


@pytest.mark.asyncio
async def test_both_stubs_answer_a_request_with_the_same_body() -> None:
    # The floor tool reads the difference between them as aiohttp's: the work behind it must be the same.
    request = b'{"input": ["a", "b"], "model": "m", "encoding_format": "base64"}'
    bodies = []
    async with aiohttp.ClientSession() as session:
        for serving in (serve, serve_raw):
            async with serving(StubConfig(dim=16)) as url, \
                    session.post(url + "/v1/embeddings", data=request) as resp:
                assert resp.status == 200
                bodies.append(await resp.read())
    assert bodies[0] == bodies[1]
    assert len(msgspec.json.decode(bodies[1])["data"]) == 2


def test_the_floor_sets_aiohttps_part_against_the_targets() -> None:
    text = report({
        "aiohttp stub": {"all": 80.0, "rps": 1.0},
        "raw stub": {"all": 30.0, "rps": 1.0},
        "one process": {"all": 300.0, "rps": 1.0},
        "--workers 2": {"engine": 100.0, "gateway": 260.0, "rps": 1.0},
    })
    assert "aiohttp's part of a request: 50.0 µs (62% of the stub's)" in text
    # 300 - 50 = 250 µs, 3.12× an 80 µs stub; 260 - 50 = 210 µs, 2.62×
    assert "one process 250.0 µs (3.12× the aiohttp stub; target ≤ 2.5×), gateways 210.0 µs (2.62×" in text
