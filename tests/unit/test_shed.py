"""Refusing from the head (``gateway/shed.py``): under a standing queue a queued route's request is
answered 429 before its body is read, in its route's error dialect, with a request id, counted in the
metrics, and after the API key is checked — while a missing key or a malformed header still gets its
own answer. On a keep-alive connection with nothing in progress, the connection itself answers a
request that arrived whole (``guard.HEAD_ANSWER``), before aiohttp makes a request of it; a request
the check passes holds its room, is not checked again, and its hold goes to admission, which ends it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from coalesce.service.batching.admit import Hold
from coalesce.service.batching.batcher import Batcher
from coalesce.service.errors import Overloaded
from coalesce.service.gateway.app import create_app
from coalesce.service.gateway.facade import ServedModel
from coalesce.service.gateway.models import MODELS
from coalesce.service.settings import build

from ..conftest import ServerThread
from ..fakes import FakeRunner, ready_client
from ..integration import rawhttp


class _Standing:
    """Makes the served model's queue stand and refuse every head; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def check_room(self, model: ServedModel, adm: object, first: int = 1, total: int = 1,
                   inputs: int = 1, *, hold: bool = True) -> None:
        assert hold  # checked once, from the head: the room of one that passes is held
        self.asked.append((adm.tenant, total))  # type: ignore[attr-defined]
        raise Overloaded("The queue stands; retry in 1.500 s.", retry_after=1.5, code="overloaded")


@pytest.fixture
async def standing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                   request: pytest.FixtureRequest) -> AsyncIterator[tuple[TestClient, _Standing]]:
    argv = []
    if getattr(request, "param", False):
        keys = tmp_path / "keys"
        keys.write_text("sk-good acme 2\n")
        argv = ["--api-keys-file", str(keys)]
    app = create_app(build(argv, environ={}), lambda spec: FakeRunner())
    client = await ready_client(app)
    spy = _Standing()
    model = app[MODELS].models[0]
    monkeypatch.setattr(type(model), "standing", property(lambda self: True))
    monkeypatch.setattr(type(model), "check_room", lambda self, *a, **k: spy.check_room(self, *a, **k))
    try:
        yield client, spy
    finally:
        await client.close()


def _count(text: str, route: str, status: str) -> float:
    for line in text.splitlines():
        if line.startswith("coalesce_requests_total{") and f'route="{route}"' in line and \
                f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_head_is_refused_in_its_route_s_dialect_with_an_id_and_counted(
    standing: tuple[TestClient, _Standing],
) -> None:
    client, spy = standing
    body = {"model": "fake", "input": "x" * 500}
    resp = await client.post("/v1/embeddings", json=body, headers={"X-Request-ID": "req-7"})
    assert resp.status == 429
    assert resp.headers["x-request-id"] == "req-7"
    assert resp.headers["Retry-After"] == "2" and resp.headers["retry-after-ms"] == "1500"
    assert (await resp.json())["error"]["code"] == "overloaded"  # OpenAI's error shape
    tei = await client.post("/embed", json={"inputs": "hello"})
    assert tei.status == 429 and "error_type" in await tei.json()  # TEI's
    assert tei.headers["x-request-id"]  # one of our own when the caller sent none
    # Judged on the body's size before it was read: 500 characters of text and the JSON around it.
    assert spy.asked[0][1] == len(json.dumps(body)) // 5
    metrics = await (await client.get("/metrics")).text()
    assert _count(metrics, "/v1/embeddings", "429") == 1 and _count(metrics, "/embed", "429") == 1


@pytest.mark.parametrize("standing", [True], indirect=True)
async def test_with_api_keys_a_head_is_refused_only_once_its_key_is_good(
    standing: tuple[TestClient, _Standing],
) -> None:
    client, spy = standing
    body = {"model": "fake", "input": "hello"}
    missing = await client.post("/v1/embeddings", json=body)
    wrong = await client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer sk-bad"})
    assert missing.status == 401 and wrong.status == 401  # not told the queue stands
    good = await client.post("/v1/embeddings", json=body, headers={"Authorization": "Bearer sk-good"})
    assert good.status == 429
    assert spy.asked == [("acme", len(json.dumps(body)) // 5)]  # as the key's tenant


async def test_a_malformed_header_is_answered_400_not_429(standing: tuple[TestClient, _Standing]) -> None:
    client, _ = standing
    resp = await client.post("/v1/embeddings", json={"model": "fake", "input": "hi"},
                             headers={"X-Priority": "urgent"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "X-Priority"


# -- answered by the connection ------------------------------------------------------------------------
@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    """A server listening as ``serve`` does (``GuardedSite``), on the fake model."""
    srv = ServerThread(build([], environ={}), lambda spec: FakeRunner()).start()
    try:
        yield srv
    finally:
        srv.stop()


def _stands(monkeypatch: pytest.MonkeyPatch, srv: ServerThread) -> _Standing:
    spy = _Standing()
    model = srv.app[MODELS].models[0]
    monkeypatch.setattr(type(model), "standing", property(lambda self: True))
    monkeypatch.setattr(type(model), "check_room", lambda self, *a, **k: spy.check_room(self, *a, **k))
    return spy


def _handled(srv: ServerThread) -> int:
    """Requests aiohttp made a request object of (and ran through the middlewares and a route)."""
    return int(srv._runner.server.requests_count)


def _post(path: str, body: object, **headers: str) -> bytes:
    return rawhttp.request("POST", path, json.dumps(body).encode(),
                           {"Content-Type": "application/json", **headers})


async def test_refused_heads_on_an_idle_keep_alive_connection_are_answered_by_it(
    served: ServerThread, monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _stands(monkeypatch, served)
    before = _handled(served)
    reader, writer = await rawhttp.connect(served.port)
    try:
        body = {"model": "fake", "input": "x" * 100}
        for i in range(3):  # one after the other on one connection, kept alive
            writer.write(_post("/v1/embeddings", body, **{"X-Request-ID": f"one-{i}"}))
            answer = await rawhttp.read_answer(reader, then_eof=False)
            assert answer.status == 429 and answer.headers["x-request-id"] == f"one-{i}"
            assert answer.headers["retry-after"] == "2" and answer.headers["retry-after-ms"] == "1500"
            assert answer.headers["content-type"] == "application/json" and "date" in answer.headers
            assert answer.json()["error"]["code"] == "overloaded"
        # Pipelined, in one write: answered in order; and the TEI route in its own dialect.
        writer.write(_post("/embed", {"inputs": "hello"}, **{"X-Request-ID": "p-0"})
                     + _post("/v1/embeddings", body, **{"X-Request-ID": "p-1"}))
        tei = await rawhttp.read_answer(reader, then_eof=False)
        openai = await rawhttp.read_answer(reader, then_eof=False)
        assert (tei.status, tei.headers["x-request-id"]) == (429, "p-0") and "error_type" in tei.json()
        assert (openai.status, openai.headers["x-request-id"]) == (429, "p-1")
        assert _handled(served) == before, "none of them reached aiohttp's request handling"
        assert spy.asked == [("default", len(json.dumps(body)) // 5)] * 3 + [
            ("default", len(json.dumps({"inputs": "hello"})) // 5), ("default", len(json.dumps(body)) // 5)]
        # An Upgrade request is aiohttp's to answer (its parser changes state for it): the same 429.
        writer.write(_post("/v1/embeddings", body, Connection="Upgrade", Upgrade="websocket"))
        upgrade = await rawhttp.read_answer(reader, then_eof=False)
        assert upgrade.status == 429 and _handled(served) == before + 1
        # A request that asks for the connection to close after it is aiohttp's to answer: the same 429.
        writer.write(_post("/v1/embeddings", body, Connection="close"))
        last = await rawhttp.read_answer(reader, then_eof=True)
        assert last.status == 429 and last.eof and _handled(served) == before + 2
    finally:
        writer.close()
    with urllib.request.urlopen(served.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert _count(metrics, "/v1/embeddings", "429") == 6 and _count(metrics, "/embed", "429") == 1


async def test_a_head_the_check_passes_holds_its_room_until_admission_and_is_not_checked_again(
    served: ServerThread, monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = served.app[MODELS].models[0]
    monkeypatch.setattr(type(model), "standing", property(lambda self: True))  # (the queue is empty)
    checks: list[tuple[bool, Hold]] = []
    admitted: list[Hold | None] = []
    check_room, enqueue_many = Batcher.check_room, Batcher.enqueue_many

    def checking(self: Batcher, *args: object, **kwargs: Any) -> Hold:
        held = check_room(self, *args, **kwargs)
        checks.append((kwargs.get("hold", True), held))
        return held

    def enqueueing(self: Batcher, requests: Any, reply: Any) -> Any:
        admitted.extend(r.held for r in requests)
        return enqueue_many(self, requests, reply)

    monkeypatch.setattr(Batcher, "check_room", checking)
    monkeypatch.setattr(Batcher, "enqueue_many", enqueueing)
    reader, writer = await rawhttp.connect(served.port)
    try:
        for i in range(2):  # a fresh connection's first request, then the next on it
            writer.write(_post("/v1/embeddings", {"model": "fake", "input": f"a short query {i}"}))
            assert (await rawhttp.read_answer(reader, then_eof=False)).status == 200
    finally:
        writer.close()
    assert len(checks) == 2, "checked once each, from the head: the route did not check again"
    assert all(hold and held for hold, held in checks), "each passed and holds its room"
    assert [id(h) for h in admitted] == [id(held) for _, held in checks], "its hold went to admission"
    assert all(held[1] == 0 for _, held in checks), "which ended it"
