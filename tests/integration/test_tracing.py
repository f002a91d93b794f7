"""OpenTelemetry traces from a real `coalesce serve` (one process, and two gateways in front of an
engine), received by an in-process OTLP/HTTP collector (``otlp_receiver``).

A request that carries ``traceparent`` has its server span in the caller's trace under the caller's
span, with tokenisation and queue-wait children; every batch span links each request span it computed
and each request span names its batches; an unsampled caller exports nothing; the trace id is on the
request's log line; and the spans, held back by a long export delay, all arrive on SIGTERM's drain.
Off, nothing is exported even with OpenTelemetry's own variables pointing at the collector.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from ..conftest import wait_gateways
from .otlp_receiver import Receiver

MODEL = "all-MiniLM-L6-v2"
NULL = ["--runner-factory", "coalesce.loadtests.nullmodel:factory"]
SERVER_KIND = 2  # SPAN_KIND_SERVER in OTLP


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def _caller() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


async def _post(s: aiohttp.ClientSession, url: str, i: int, headers: dict[str, str]) -> None:
    body = {"model": MODEL, "input": [f"traced request {i} first text", f"traced request {i} second text"]}
    async with s.post(url + "/v1/embeddings", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-gateways"])
async def test_request_spans_continue_the_callers_trace_and_batches_link_them_all(
    workers: int, receiver: Receiver, replica: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Spans leave only on the drain: the export delay is far longer than the test.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    r = replica(workers, [*NULL, "--otlp-endpoint", receiver.endpoint, "--log-level", "debug",
                          "--otlp-service-name", "embedder"])
    await wait_gateways(r.url, r.proc, workers)

    callers = [_caller() for _ in range(8)]
    unsampled = _caller()
    # A fresh connection per request, so that with two gateways the kernel spreads them over both.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await asyncio.gather(*(
            _post(s, r.url, i, {"traceparent": f"00-{tid}-{sid}-01", "tracestate": "vendor=x"})
            for i, (tid, sid) in enumerate(callers)
        ))
        await _post(s, r.url, 100, {})  # no caller trace: a trace of its own
        await _post(s, r.url, 101, {"traceparent": f"00-{unsampled[0]}-{unsampled[1]}-00"})
        probe = _caller()
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapes are not traced
            async with s.get(r.url + path, headers={"traceparent": f"00-{probe[0]}-{probe[1]}-01"}) as resp:
                assert resp.status == 200
    await asyncio.sleep(0.5)
    assert receiver.spans == [], "spans were exported before the drain (the delay did not hold)"

    os.kill(r.proc.pid, signal.SIGTERM)
    assert await asyncio.to_thread(r.proc.wait, 90) == 0
    log = r.stop()

    servers = [s for s in receiver.spans if s.kind == SERVER_KIND and s.name == "POST /v1/embeddings"]
    by_trace = {s.trace_id: s for s in servers}
    assert len(servers) == len(callers) + 1  # the unsampled caller's request exports nothing
    assert unsampled[0] not in by_trace
    assert probe[0] not in {s.trace_id for s in receiver.spans}
    own = [s for s in servers if s.parent_span_id == ""]
    assert len(own) == 1 and own[0].trace_id not in {tid for tid, _ in callers}

    batches = receiver.named("coalesce.batch")
    assert batches
    linked: dict[tuple[str, str], int] = {}  # request span → its inputs over every batch
    for b in batches:
        assert b.attributes["coalesce.model"] == MODEL
        assert b.attributes["coalesce.batch.size"] >= 1
        assert b.attributes["coalesce.batch.padded_tokens"] >= b.attributes["coalesce.batch.tokens"]
        rows, cols = map(int, b.attributes["coalesce.batch.cell"].split("x"))
        assert rows >= b.attributes["coalesce.batch.size"] and cols >= b.attributes["coalesce.batch.longest"]
        assert b.parent_span_id == "" and b.resource["service.name"] == "embedder"
        for trace_id, span_id, attrs in b.links:
            key = (trace_id, span_id)
            linked[key] = linked.get(key, 0) + attrs["coalesce.inputs"]
    assert unsampled[0] not in {trace_id for trace_id, _ in linked}
    batch_ids = {f"{b.trace_id}-{b.span_id}": b for b in batches}

    for tid, sid in callers:
        span = by_trace[tid]
        assert span.parent_span_id == sid  # under the caller's span, in the caller's trace
        assert span.trace_state == "vendor=x"
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["http.route"] == "/v1/embeddings"
        assert span.attributes["coalesce.model"] == MODEL
        assert span.attributes["coalesce.inputs"] == 2
        assert span.attributes["coalesce.tokens"] > 2
        assert span.attributes["coalesce.request_id"]
    for span in servers:
        # Both inputs were computed in batches that link this request span...
        assert linked.get((span.trace_id, span.span_id)) == 2, span.trace_id
        # ...and the request span names exactly those batches, each linking it back.
        named = span.attributes["coalesce.batch.ids"]
        assert named and all(n in batch_ids for n in named)
        for n in named:
            assert (span.trace_id, span.span_id) in {(t, s) for t, s, _ in batch_ids[n].links}
        children = {c.name: c for c in receiver.spans if c.parent_span_id == span.span_id}
        assert {"coalesce.tokenize", "coalesce.queue"} <= children.keys()
        for child in children.values():
            assert child.trace_id == span.trace_id
            assert span.start_ns <= child.start_ns <= child.end_ns <= span.end_ns

    processes = {s.resource["coalesce.process"] for s in servers}
    if workers == 1:
        assert processes == {"server"} and {b.resource["coalesce.process"] for b in batches} == {"server"}
    else:  # the batch spans come from the engine, the request spans from the gateways
        assert processes <= {"gateway-0", "gateway-1"}
        assert {b.resource["coalesce.process"] for b in batches} == {"engine"}

    # The trace id is on each request's log line.
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    logged = {x.get("trace_id") for x in lines if x.get("event") == "request" and x.get("status") == 200}
    assert {tid for tid, _ in callers} <= logged


async def test_off_nothing_is_exported(
    receiver: Receiver, replica: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenTelemetry's own variables point at the collector, but Coalesce's endpoint is empty (the
    # manifests' default): tracing stays off.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint + "/v1/traces")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    r = replica(1, [*NULL, "--log-level", "debug"])
    await wait_gateways(r.url, r.proc, 1)
    tid, sid = _caller()
    async with aiohttp.ClientSession() as s:
        for i in range(3):
            await _post(s, r.url, i, {"traceparent": f"00-{tid}-{sid}-01"})
    os.kill(r.proc.pid, signal.SIGTERM)
    assert await asyncio.to_thread(r.proc.wait, 90) == 0
    log = r.stop()
    assert receiver.posts == 0 and receiver.spans == []
    requests = [json.loads(x) for x in log.splitlines() if x.startswith("{") and '"request"' in x]
    assert requests and all("trace_id" not in x for x in requests)
