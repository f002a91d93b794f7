"""Log lines from several processes share one stderr; each line must reach it in one write."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog
from coalesce.service import logs


class Recorder(io.StringIO):
    """A stream that keeps each write apart, as an unbuffered pipe would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    saved_config, saved_handlers = structlog.get_config(), logging.getLogger().handlers[:]
    saved_level = logging.getLogger().level
    yield
    structlog.configure(**saved_config)
    logging.getLogger().handlers[:] = saved_handlers
    logging.getLogger().setLevel(saved_level)


def test_every_log_line_is_one_whole_write_so_processes_sharing_stderr_never_interleave(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)  # here, not in a fixture: pytest's capture resets it per phase
    logs.configure("info", "json", process="gateway-1")
    logs.get_logger("t").info("listening", port=8080)
    logging.getLogger("some.library").warning("from the stdlib")
    assert len(stderr.writes) == 2, stderr.writes
    for w in stderr.writes:
        assert w.endswith("\n") and w.count("\n") == 1, w
        assert json.loads(w)["process"] == "gateway-1"
    assert json.loads(stderr.writes[0])["event"] == "listening"


@pytest.mark.parametrize("level", ["debug", "info"])
async def test_a_requests_lines_carry_its_id_and_only_its_own(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch, level: str,
) -> None:
    """The gateway's middleware puts each request's id on the lines written while it runs (at debug, a
    line per request); a line written after it, or for the next request, does not carry it. At info no
    line is written for a request that succeeds."""
    from coalesce.service.gateway.app import create_app
    from coalesce.service.settings import build

    from ..fakes import FakeRunner, ready_client

    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)
    logs.configure(level, "json")
    client = await ready_client(create_app(build([], environ={}), lambda spec: FakeRunner()))
    try:
        for rid in ("log-1", "log-2"):
            resp = await client.post("/v1/embeddings", json={"model": "fake", "input": "hello"},
                                     headers={"X-Request-ID": rid})
            assert resp.status == 200 and resp.headers["x-request-id"] == rid
        logs.get_logger("t").info("after")
    finally:
        await client.close()
    lines = [json.loads(w) for w in stderr.writes]
    served = [x for x in lines if x["event"] == "request" and x.get("route") == "/v1/embeddings"]
    if level == "debug":
        assert [(x["request_id"], x["status"]) for x in served] == [("log-1", 200), ("log-2", 200)]
    else:
        assert served == []
    after = [x for x in lines if x["event"] == "after"]
    assert len(after) == 1 and "request_id" not in after[0]


def test_a_lines_trace_ids_come_from_the_request_and_its_own_fields_stand(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under tracing a request's lines carry its span's trace and span ids beside its id; a field the line
    names itself is not overwritten; outside a request a line carries none of them."""
    from coalesce.service import tracing
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)
    logs.configure("info", "json")
    log = logs.get_logger("t")
    tracer = tracing.Tracer("http://unused:4318", "test", "server", exporter=InMemorySpanExporter())
    monkeypatch.setattr(tracing, "active", tracer)
    caller = {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}
    try:
        with tracer.request("POST", "/embed", "/embed", caller) as trace:
            rid = logs.REQUEST_ID.set("r-1")
            try:
                log.info("inside")
                log.info("own", request_id="mine")
            finally:
                logs.REQUEST_ID.reset(rid)
        own_span = f"{trace.span.get_span_context().span_id:016x}"
        log.info("outside")
    finally:
        tracing.stop()
    inside, own, outside = (json.loads(w) for w in stderr.writes)
    assert (inside["request_id"], inside["trace_id"], inside["span_id"]) == ("r-1", "a" * 32, own_span)
    assert own_span != "b" * 16  # (the request's own span, a child of the caller's)
    assert own["request_id"] == "mine" and own["trace_id"] == "a" * 32
    assert not {"request_id", "trace_id", "span_id"} & set(outside)
