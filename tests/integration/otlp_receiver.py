"""An OTLP/HTTP trace receiver for tests: an aiohttp server on loopback, in a thread of its own, that
accepts ``POST /v1/traces`` (protobuf), decodes each ``ExportTraceServiceRequest`` with
``opentelemetry-proto`` and keeps every span with its resource's attributes."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ..conftest import free_port


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    """One received span, ids in hex as W3C ``traceparent`` writes them."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]  # (trace id, span id, attributes)
    resource: dict[str, Any]
    status_code: int
    trace_state: str


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    spans: list[Span] = field(default_factory=list)
    posts: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        got = []
        for rs in msg.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                        s.start_time_unix_nano, s.end_time_unix_nano, attributes(s.attributes),
                        [(ln.trace_id.hex(), ln.span_id.hex(), attributes(ln.attributes)) for ln in s.links],
                        resource, s.status.code, s.trace_state,
                    ))
        with self._lock:
            self.spans += got
            self.posts += 1
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def start(self) -> Receiver:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_post("/v1/traces", self._traces)
            self._runner = web.AppRunner(app)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="otlp-receiver", daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> None:
        """Until ``predicate(spans)`` holds (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(list(self.spans)):
                    return
            time.sleep(0.05)
        raise AssertionError(f"the spans never satisfied the test; got {len(self.spans)}")
