"""Refusing from the head (``gateway/shed.py``): under a standing queue a queued route's request is
answered 429 before its body is read, in its route's error dialect, with a request id, counted in the
metrics, and after the API key is checked — while a missing key or a malformed header still gets its
own answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from coalesce.service.errors import Overloaded
from coalesce.service.gateway.app import create_app
from coalesce.service.gateway.facade import ServedModel
from coalesce.service.gateway.models import MODELS
from coalesce.service.settings import build

from ..fakes import FakeRunner


class _Standing:
    """Makes the served model's queue stand and refuse every head; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def check_room(self, model: ServedModel, adm: object, first: int = 1, total: int = 1,
                   inputs: int = 1, *, hold: bool = True) -> None:
        assert not hold  # the route checks again, and holds
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
    client = TestClient(TestServer(app))
    await client.start_server()
    for _ in range(200):
        if (await client.get("/ready")).status == 200:
            break
        await asyncio.sleep(0.02)
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
