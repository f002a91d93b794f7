"""Backpressure, deadlines, disconnects, API keys and tenants on a real server (with a fake runner)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from coalesce.service.settings import build

from ..conftest import metric, metrics_text
from ..fakes import FakeRunner, GatedFake


async def post(
    url: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 30
) -> tuple[int, Any, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
        s.post(url + "/v1/embeddings", json=body, headers=headers or {}) as r,
    ):
        return r.status, await r.json(content_type=None), r.headers


async def until(url: str, name: str, at_least: float, **labels: str) -> None:
    """Poll ``/metrics`` (at most 20 s) until the samples ``name`` with ``labels`` add up to ``at_least``."""
    for _ in range(1000):
        if metric(await metrics_text(url), name, **labels) >= at_least:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} {labels} never reached {at_least}")


async def test_flood_past_the_bound_gets_429_while_admitted_requests_complete(serve: Any) -> None:
    runner = GatedFake()
    srv = serve(build(["--max-queued-tokens", "40", "--max-batch-size", "4"], environ={}), lambda s: runner)
    texts = [f"flood {i} a b c d e" for i in range(40)]  # 8 tokens each: at most 5 queue at once
    runner.gate.clear()  # hold the device: the flood meets a full queue whatever the machine's speed
    try:
        flood = asyncio.gather(*(post(srv.url, {"model": "fake", "input": t}) for t in texts))
        await until(srv.url, "coalesce_rejected_total", 1, reason="queue_full")
    finally:
        runner.gate.set()
    results = await flood
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) > 0 and statuses.count(200) > 0
    for (status, body, headers), text in zip(results, texts, strict=True):
        if status == 200:
            np.testing.assert_allclose(body["data"][0]["embedding"], runner.expected(text), rtol=1e-5)
        else:
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error"
            assert body["error"]["code"] == "queue_full"
    text = await metrics_text(srv.url)
    assert metric(text, "coalesce_rejected_total", reason="queue_full") == statuses.count(429)
    assert metric(text, "coalesce_queued_tokens") == 0


async def test_expired_deadline_is_answered_without_compute(serve: Any) -> None:
    runner = GatedFake(batch_seconds=0.4)  # calibrates as 0.4 s a batch: a 100 ms deadline cannot be met
    # The bound on queue wait off: the hurried request must queue behind the busy batch, not be refused.
    srv = serve(build(["--max-batch-size", "1", "--max-queue-wait-ms", "0"], environ={}), lambda s: runner)
    runner.batch_seconds = 0.0  # the gate holds the busy batch as long as the test needs
    before = len(runner.batches)
    runner.gate.clear()
    try:
        busy = asyncio.ensure_future(post(srv.url, {"model": "fake", "input": "keeps the model busy"}))
        assert await asyncio.to_thread(runner.entered.wait, 10), "the busy request must reach the model"
        status, body, _ = await post(
            srv.url, {"model": "fake", "input": "in a hurry"}, headers={"X-Request-Timeout": "100"}
        )
    finally:
        runner.gate.set()
    assert status in (503, 504)
    assert body["error"]["code"] in ("deadline_exceeded", "deadline_unmeetable")
    assert (await busy)[0] == 200
    # One batch at a time, in order: had the hurried input stayed queued, it would run before this one.
    assert (await post(srv.url, {"model": "fake", "input": "after"}))[0] == 200
    assert len(runner.batches) - before == 2, "the hurried request must never reach the model"
    text = await metrics_text(srv.url)
    assert (
        sum(metric(text, "coalesce_rejected_total", reason=r) for r in ("expired", "deadline_unmeetable"))
        >= 1
    )


async def test_a_deadline_that_passes_mid_batch_is_answered_504_at_once(serve: Any) -> None:
    runner = FakeRunner()  # calibrates as instant, then turns slow: admission cannot see it coming
    srv = serve(build([], environ={}), lambda s: runner)
    runner.batch_seconds = 1.0
    status, body, _ = await post(
        srv.url, {"model": "fake", "input": "caught mid-batch"}, headers={"X-Request-Timeout": "200"}
    )
    assert status == 504, "the answer must come at the deadline, not when the batch ends"
    assert body["error"]["code"] == "deadline_exceeded"
    text = await metrics_text(srv.url)
    assert metric(text, "coalesce_rejected_total", reason="expired") == 1


async def test_disconnected_clients_inputs_are_not_computed(serve: Any) -> None:
    runner = GatedFake()
    # The bound on queue wait off: the impatient requests must queue behind the busy batch, not be refused.
    srv = serve(build(["--max-batch-size", "1", "--max-queue-wait-ms", "0"], environ={}), lambda s: runner)
    before = len(runner.batches)
    runner.gate.clear()  # hold the device until the impatient clients are gone, however long that takes
    try:
        busy = asyncio.ensure_future(post(srv.url, {"model": "fake", "input": "keeps the model busy"}))
        assert await asyncio.to_thread(runner.entered.wait, 10), "the busy request must reach the model"
        bodies = [{"model": "fake", "input": f"impatient {i}"} for i in range(3)]
        impatient = [asyncio.ensure_future(post(srv.url, body)) for body in bodies]
        await until(srv.url, "coalesce_queue_depth", 3)
        for call in impatient:
            call.cancel()  # each client hangs up while its input waits
        gone = await asyncio.gather(*impatient, return_exceptions=True)
        assert all(isinstance(g, asyncio.CancelledError) for g in gone)
        await until(srv.url, "coalesce_rejected_total", 3, reason="cancelled")
    finally:
        runner.gate.set()
    assert (await busy)[0] == 200
    status, _, _ = await post(srv.url, {"model": "fake", "input": "after"})
    assert status == 200
    assert len(runner.batches) - before == 2, "only the busy request and the last one were computed"
    text = await metrics_text(srv.url)
    assert metric(text, "coalesce_rejected_total", reason="cancelled") == 3


async def test_api_keys_guard_model_routes_and_name_the_tenant(serve: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# key tenant weight\nsk-alpha-123 alpha 2\nsk-beta-456 beta\n")
    # A named tenant may queue 3 tokens: "x" (3 with special tokens) fits, "x y" does not.
    srv = serve(build(["--api-keys-file", str(keys), "--tenant-max-queued-tokens", "3"], environ={}),
                lambda s: FakeRunner())
    body = {"model": "fake", "input": "x"}
    status, err, _ = await post(srv.url, body)
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert "sk-" not in err["error"]["message"]
    status, _, _ = await post(srv.url, body, headers={"Authorization": "Bearer sk-wrong"})
    assert status == 401
    status, _, _ = await post(srv.url, body, headers={"Authorization": "Bearer sk-alpha-123"})
    assert status == 200
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/ready", "/metrics"):
            async with s.get(srv.url + path) as r:
                assert r.status == 200, path
        async with s.get(srv.url + "/v1/models") as r:
            assert r.status == 401
    # The key, not a header, names the tenant: its cap applies even when X-Tenant claims another.
    status, err, _ = await post(srv.url, {"model": "fake", "input": "x y"},
                                headers={"Authorization": "Bearer sk-alpha-123", "X-Tenant": "default"})
    assert status == 429 and err["error"]["code"] == "tenant_queue_full"
    assert "alpha" in err["error"]["message"]


async def test_malformed_admission_headers_are_400s(serve: Any) -> None:
    srv = serve(build([], environ={}), lambda s: FakeRunner())
    body = {"model": "fake", "input": "x"}
    for headers, param in (
        ({"X-Priority": "urgent"}, "X-Priority"),
        ({"X-Request-Timeout": "soon"}, "X-Request-Timeout"),
        ({"X-Request-Timeout": "-5"}, "X-Request-Timeout"),
        ({"X-Tenant": "bad tenant!"}, "X-Tenant"),
    ):
        status, err, _ = await post(srv.url, body, headers=headers)
        assert status == 400, headers
        assert err["error"]["param"] == param
    status, _, _ = await post(
        srv.url, body, headers={"X-Priority": "low", "X-Tenant": "team-a", "X-Request-Timeout": "5000"}
    )
    assert status == 200
