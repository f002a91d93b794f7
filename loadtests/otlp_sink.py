"""A minimal OTLP/HTTP trace collector for the ``tracing`` bench section: accepts ``POST /v1/traces``
(protobuf), counts the spans, and tells ``GET /stats``. It runs as a process of its own, so decoding
spans costs the server under test nothing.

    python -m coalesce.loadtests.otlp_sink --port 4318
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

_OK = ExportTraceServiceResponse().SerializeToString()


def app() -> web.Application:
    stats = {"posts": 0, "spans": 0, "bytes": 0}

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(body)
        stats["posts"] += 1
        stats["bytes"] += len(body)
        stats["spans"] += sum(len(ss.spans) for rs in msg.resource_spans for ss in rs.scope_spans)
        return web.Response(body=_OK, content_type="application/x-protobuf")

    async def show(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    a = web.Application(client_max_size=64 << 20)
    a.router.add_post("/v1/traces", traces)
    a.router.add_get("/stats", show)
    a.router.add_get("/ready", ready)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.otlp_sink", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4318)
    args = p.parse_args(argv)
    web.run_app(app(), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
