"""Plain embedding requests answered by the connection (``gateway/plain.py``, ``guard.OWN_ANSWER``): a
request that arrived whole on an idle keep-alive connection gets what aiohttp's path answers, without
aiohttp making a request of it; what arrives meanwhile waits, and answers go out in request order; a
client that leaves withdraws its request; a shutdown answers it before the connection goes."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any, cast

import pytest
from coalesce.service.settings import build

from ..conftest import ServerThread
from ..fakes import GatedFake
from ..integration import rawhttp

# What differs between two answers to the same request, whichever path: when, and how long it took.
_PER_ANSWER = {"date", "x-request-id", "x-total-time", "x-queue-time", "x-inference-time"}


@pytest.fixture
def gated() -> Iterator[tuple[ServerThread, GatedFake]]:
    """A server listening as ``serve`` does, on a fake model whose forward the test can hold."""
    runner = GatedFake()
    srv = ServerThread(build(["--cpu-forwards", "1"], environ={}), lambda spec: runner).start()
    try:
        yield srv, runner
    finally:
        runner.gate.set()
        if srv._thread.is_alive():  # (unless the test stopped it)
            srv.stop()


def _handled(srv: ServerThread) -> int:
    """Requests aiohttp made a request object of (and ran through the middleware and a route)."""
    return int(srv._runner.server.requests_count)


def _post(body: object, path: str = "/v1/embeddings", **headers: str) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return rawhttp.request("POST", path, raw, {"Content-Type": "application/json", **headers})


def _without_id(body: object) -> object:
    """A response body less its own id (Cohere's responses name themselves)."""
    return {k: v for k, v in body.items() if k != "id"} if isinstance(body, dict) else body


def _metrics(srv: ServerThread) -> str:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def _count(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s series with these labels (whatever their others)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


async def test_a_plain_request_gets_what_aiohttp_answers_without_aiohttp_handling_it(
    gated: tuple[ServerThread, GatedFake],
) -> None:
    srv, runner = gated
    cases = [
        ("/v1/embeddings", {"model": "fake", "input": ["a few words", "more"]}, {}),
        ("/v1/embeddings", {"model": "fake", "input": "hello", "encoding_format": "base64", "dimensions": 4},
         {}),
        ("/v1/embeddings", b"{not json", {}),  # 400, in OpenAI's shape
        ("/v1/embeddings", {"model": "nope", "input": "hello"}, {}),  # 404
        ("/v1/embeddings", {"model": "fake", "input": "hello"}, {"X-Priority": "urgent"}),  # 400 naming it
        ("/v1/embeddings", {"model": "fake", "input": []}, {}),
        ("/embeddings", {"model": "fake", "input": ["a few words", "more"]}, {}),  # OpenAI's alias
        ("/embed", {"inputs": ["a few words", "more"], "normalize": False}, {}),  # TEI's route
        ("/embed", {"inputs": []}, {}),  # and its error shape
        ("/v2/embed", {"model": "fake", "texts": ["hello"], "input_type": "search_query",
                       "embedding_types": ["float"]}, {}),  # Cohere's
        ("/v2/embed", {"model": "fake", "texts": "not a list"}, {}),
        # The dialect a body's shape chose (Cohere's documents on TEI's path), for a model that is not a
        # reranker: its error in the chosen dialect.
        ("/rerank", {"query": "q", "documents": ["a", "b"]}, {}),
    ]
    counted = _count(_metrics(srv), "coalesce_requests_total")
    before = _handled(srv)
    reader, writer = await rawhttp.connect(srv.port)
    try:
        own = []
        for path, body, headers in cases:  # one after the other on one connection, kept alive
            writer.write(_post(body, path, **headers))
            own.append(await rawhttp.read_answer(reader, then_eof=False))
    finally:
        writer.close()
    assert _handled(srv) == before, "none of them reached aiohttp's request handling"
    theirs = []
    for path, body, headers in cases:  # the same requests, each asking to close after it: aiohttp's
        reader, writer = await rawhttp.connect(srv.port)
        try:
            writer.write(_post(body, path, Connection="close", **headers))
            theirs.append(await rawhttp.read_answer(reader, then_eof=True))
        finally:
            writer.close()
    assert _handled(srv) == before + len(cases)
    assert [a.status for a in own] == [a.status for a in theirs] == \
        [200, 200, 400, 404, 400, 400, 200, 200, 400, 200, 400, 400]
    for mine, aiohttp_s in zip(own, theirs, strict=True):
        assert _without_id(mine.json()) == _without_id(aiohttp_s.json())
        # Every header alike (aiohttp adds Server, and Connection: close was asked of it), but the
        # answer's own: its date, id and timings, which each has.
        theirs_kept = _PER_ANSWER | {"server", "connection"}
        assert {k: v for k, v in mine.headers.items() if k not in _PER_ANSWER} == \
            {k: v for k, v in aiohttp_s.headers.items() if k not in theirs_kept}
        assert _PER_ANSWER - {"x-queue-time", "x-inference-time"} <= set(mine.headers)
        assert float(mine.headers["x-total-time"]) >= 0
    data = own[0].json()["data"]
    assert [d["index"] for d in data] == [0, 1]
    assert data[0]["embedding"] == pytest.approx(runner.expected("a few words").tolist(), abs=1e-6)
    assert own[6].json()["data"] == own[0].json()["data"]  # (the alias)
    for got, text in zip(own[7].json(), ("a few words", "more"), strict=True):  # TEI's rows
        assert got == pytest.approx(runner.expected(text).tolist(), abs=1e-6)
    assert "error_type" in own[8].json() and "message" in own[10].json()  # TEI's error, Cohere's
    assert "message" in own[11].json() and "error" not in own[11].json()  # the dialect its body chose
    # Counted as aiohttp's path counts them, by route and status.
    metrics = _metrics(srv)
    assert _count(metrics, "coalesce_requests_total") - counted == 2 * len(cases) + 1  # (+1: the scrape)
    assert _count(metrics, "coalesce_requests_total", route="/embed", status="400") == 2


async def test_what_arrives_while_a_taken_request_is_answered_waits_and_answers_go_in_order(
    gated: tuple[ServerThread, GatedFake],
) -> None:
    srv, runner = gated
    before = _handled(srv)
    reader, writer = await rawhttp.connect(srv.port)
    try:
        runner.gate.clear()  # the first request's forward waits
        writer.write(_post({"model": "fake", "input": "first"}, **{"X-Request-ID": "r-0"}))
        assert await asyncio.to_thread(runner.entered.wait, 10)
        # Pipelined behind it meanwhile: a probe, a request past the held input's bound (it pauses the
        # socket), and one more, the last in pieces.
        big = {"model": "fake", "input": "word " * 20000, "long_input": "truncate"}
        last = _post({"model": "fake", "input": "third"}, **{"X-Request-ID": "r-2"})
        writer.write(rawhttp.request("GET", "/health") + _post(big, **{"X-Request-ID": "r-1"}) + last[:20])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(last[20:])
        await writer.drain()
        with pytest.raises(TimeoutError):  # nothing is answered before the first request is
            await asyncio.wait_for(reader.read(1), 0.3)
        runner.gate.set()
        answers = [await rawhttp.read_answer(reader, then_eof=False) for _ in range(4)]
    finally:
        writer.close()
    assert [a.status for a in answers] == [200, 200, 200, 200]
    # The first was taken; what was pipelined behind it arrived together, and went to aiohttp's path.
    assert _handled(srv) == before + 3
    assert [answers[i].headers["x-request-id"] for i in (0, 2, 3)] == ["r-0", "r-1", "r-2"]
    assert answers[1].json() == {"status": "ok"}
    third = answers[3].json()["data"][0]["embedding"]
    assert third == pytest.approx(runner.expected("third").tolist(), abs=1e-6)


async def test_a_client_that_leaves_while_its_taken_request_waits_withdraws_it(
    gated: tuple[ServerThread, GatedFake],
) -> None:
    srv, runner = gated
    ran, before = len(runner.batches), _handled(srv)  # (the start-up's calibration ran some batches)
    runner.gate.clear()  # the device is held by a first request...
    held_reader, held_writer = await rawhttp.connect(srv.port)
    held_writer.write(_post({"model": "fake", "input": "holding"}))
    assert await asyncio.to_thread(runner.entered.wait, 10)
    _, writer = await rawhttp.connect(srv.port)  # ...and a second waits in the queue behind it
    writer.write(_post({"model": "fake", "input": "leaving"}))
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()  # its client leaves
    await asyncio.sleep(0.3)
    runner.gate.set()
    try:
        assert (await rawhttp.read_answer(held_reader, then_eof=False)).status == 200
    finally:
        held_writer.close()
    assert _handled(srv) == before, "both were taken"
    metrics = _metrics(srv)
    assert runner.batches[ran:] == [1], "the request whose client left was never computed"
    assert _count(metrics, "coalesce_rejected_total", reason="cancelled") == 1
    assert _count(metrics, "coalesce_requests_total", route="/v1/embeddings", status="499") == 1


async def test_a_shutdown_answers_a_taken_request_before_its_connection_goes(
    gated: tuple[ServerThread, GatedFake],
) -> None:
    srv, runner = gated
    runner.gate.clear()
    reader, writer = await rawhttp.connect(srv.port)
    try:
        writer.write(_post({"model": "fake", "input": "in flight"}))
        assert await asyncio.to_thread(runner.entered.wait, 10)
        stopping = threading.Thread(target=srv.stop)  # the listener closes, then every connection
        stopping.start()
        await asyncio.sleep(0.3)
        runner.gate.set()
        answer = await rawhttp.read_answer(reader, then_eof=False)
        await asyncio.to_thread(stopping.join, 30)
    finally:
        writer.close()
    assert answer.status == 200
    vector = answer.json()["data"][0]["embedding"]
    assert vector == pytest.approx(runner.expected("in flight").tolist(), abs=1e-6)


async def test_a_connection_idle_after_a_taken_request_is_closed_at_the_keepalive_timeout() -> None:
    # The keep-alive timer is off while a request is taken (it must not close the connection under it)
    # and counts from its answer: here the answer comes after the timer's first deadline has passed.
    runner = GatedFake()
    srv = ServerThread(build(["--keepalive-timeout-s", "0.3"], environ={}), lambda spec: runner).start()
    try:
        reader, writer = await rawhttp.connect(srv.port)
        runner.gate.clear()
        writer.write(_post({"model": "fake", "input": "slow"}))
        assert await asyncio.to_thread(runner.entered.wait, 10)
        await asyncio.sleep(0.6)  # past the timer's deadline, counted from the connection's start
        runner.gate.set()
        assert (await rawhttp.read_answer(reader, then_eof=False)).status == 200
        async with asyncio.timeout(5):  # then idle: closed once the timeout has passed since the answer
            assert await reader.read(1) == b""
        writer.close()
    finally:
        runner.gate.set()
        srv.stop()


async def test_a_taken_request_s_answer_is_its_response_in_bytes_or_a_500_for_one_it_cannot_write() -> None:
    from aiohttp import web
    from coalesce.service.gateway.plain import _answer

    async def handler(request: web.Request) -> web.StreamResponse:
        raise AssertionError("the middleware answers alone here")

    def answering(resp: web.StreamResponse) -> Any:
        async def middleware(request: web.Request, handler: object) -> web.StreamResponse:
            return resp
        return middleware

    class _Request(dict[str, object]):  # (what the 500's dialect and log read of a request)
        path = "/v1/embeddings"

        def __init__(self) -> None:
            super().__init__()
            self.app: dict[object, object] = {}

    req = cast(web.Request, _Request())
    resp = web.Response(body=bytearray(b'{"a":1}'), status=201, content_type="application/json",
                        headers={"x-one": "1"})
    written, close = await _answer(req, handler, answering(resp))
    head, _, body = written.partition(b"\r\n\r\n")
    assert not close and body == b'{"a":1}' and head.startswith(b"HTTP/1.1 201 Created\r\n")
    assert b"\r\nContent-Length: 7\r\n" in head and b"\r\nx-one: 1\r\n" in head and b"\r\nDate: " in head
    # A streamed body (not bytes) cannot be written whole: a 500 in the route's dialect, and the close.
    written, close = await _answer(req, handler, answering(web.Response(body=memoryview(b"x"))))
    assert close and written.startswith(b"HTTP/1.1 500 ") and b"Connection: close" in written
    assert json.loads(written.partition(b"\r\n\r\n")[2])["error"]["code"] == "internal_error"


async def test_requests_the_parser_kept_at_its_bound_are_answered_after_the_one_taken_in_order() -> None:
    # aiohttp's parser stops at its bound of requests in flight, keeping the rest unparsed. Here the
    # connection answers the first ones from their heads (as a standing queue's refusals), takes the one
    # at the bound, and what the parser kept comes after it. Reading the taken request's body asked
    # aiohttp to resume, which parsed the kept request then, before the taken one was set: that one was
    # taken too, the first overwritten, and its answer could go first.
    from aiohttp import web_protocol
    from coalesce.service.gateway.answers import raw_response
    from coalesce.service.gateway.guard import HEAD_ANSWER

    bound = getattr(web_protocol, "MAX_MSG_QUEUE_SIZE", 0)
    if not bound:
        pytest.skip("this aiohttp's parser keeps no bound of requests in flight")
    runner = GatedFake()
    srv = ServerThread(build(["--cpu-forwards", "1"], environ={}), lambda spec: runner)
    refusal = raw_response(429, b'{"refused": true}', {}, close=False)

    def refuse_marked(message: Any, payload: Any, protocol: Any) -> bytes | None:
        return refusal if "X-Refuse" in message.headers else None

    srv.app[HEAD_ANSWER] = refuse_marked
    srv.start()
    try:
        texts = ["the one at the bound", "the one kept behind it"]
        refused = _post({"model": "fake", "input": "x"}, **{"X-Refuse": "1"})
        stream = refused * (bound - 1) + b"".join(_post({"model": "fake", "input": t}) for t in texts)
        before = _handled(srv)
        reader, writer = await rawhttp.connect(srv.port)
        try:
            writer.write(stream)  # (one write, read in one go: far under a read's size)
            answers = [await rawhttp.read_answer(reader, then_eof=False)
                       for _ in range(bound - 1 + len(texts))]
        finally:
            writer.close()
        assert [a.status for a in answers] == [429] * (bound - 1) + [200] * len(texts)
        for text, answer in zip(texts, answers[bound - 1:], strict=True):
            assert answer.json()["data"][0]["embedding"] == pytest.approx(runner.expected(text).tolist(),
                                                                          abs=1e-6)
        assert _handled(srv) == before, "all of them answered by the connection"
    finally:
        srv.stop()
