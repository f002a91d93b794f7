"""OpenTelemetry traces: a span per request in the caller's trace, a span per batch linked to each.

Off unless ``--otlp-endpoint`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``) is set: then nothing here imports
OpenTelemetry, no middleware is added, and the request path pays one check of :data:`active` where a
span would start (the facade's ``infer`` and ``tokenize``, the batcher's batch).

When on (:func:`start`, once per process, from ``serve`` and ``serve_engine``):

* the gateway's ``traced`` middleware opens a SERVER span per request that continues the caller's W3C
  ``traceparent``/``tracestate`` (or starts a trace), with the route, status, model, inputs and tokens;
  its children are the tokenisation (``coalesce.tokenize``) and the wait for a batch
  (``coalesce.queue``);
* the batcher opens a span per batch (``coalesce.batch``: size, tokens, padded tokens, forward time,
  device) in a trace of its own, **linked to the span of every request it computed**, and each request
  span carries the batch spans' ids (``coalesce.batch.ids``: ``<trace id>-<span id>``). Under
  ``--workers N`` the request span's context travels in the job message (:func:`pack`), so the engine
  links spans that the gateways export;
* sampling is parent-based (``OTEL_TRACES_SAMPLER``/``_ARG`` choose another); a batch span is sampled
  when any request it links was, so every sampled request finds its batch;
* spans go in the background over OTLP/HTTP protobuf (a ``BatchSpanProcessor``); :func:`stop` flushes
  them at the end of the SIGTERM drain, so scaling to zero loses none.

Everything else (batch delays, exporter headers, resource attributes) follows the standard ``OTEL_*``
environment variables, which the OpenTelemetry SDK reads itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .settings import Settings

TRACES_PATH = "/v1/traces"
# At exit, the longest an unreachable collector may hold the process after its drain: a reachable one
# takes milliseconds, and the platform's grace period was sized for grace + drain.
FLUSH_TIMEOUT_S = 1.0
PACKED = 25  # a span context on the wire: trace id (16 bytes), span id (8), flags (1)
_SAMPLED = 0x01


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector ``endpoint`` (``http://collector:4318``): ``/v1/traces``
    appended as the OTLP exporter specification says, unless it is there already."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def pack(trace_id: int, span_id: int, flags: int) -> bytes:
    """A span context as the 25 bytes a job carries to the batcher (and across the engine socket)."""
    return trace_id.to_bytes(16, "big") + span_id.to_bytes(8, "big") + bytes((flags & 0xFF,))


def unpack(raw: bytes) -> tuple[int, int, int]:
    """(trace id, span id, flags) of :func:`pack`'s bytes; ValueError for anything else."""
    if len(raw) != PACKED:
        raise ValueError(f"a packed span context is {PACKED} bytes, not {len(raw)}")
    return int.from_bytes(raw[:16], "big"), int.from_bytes(raw[16:24], "big"), raw[24]


def batch_id(raw: bytes) -> str:
    """``<trace id>-<span id>`` in hex, the form request spans name their batches in."""
    trace_id, span_id, _ = unpack(raw)
    return f"{trace_id:032x}-{span_id:016x}"


def _epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` instant as the epoch nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTrace:
    """One request's server span, and what its model calls add to it. Event loop only."""

    __slots__ = ("_tracer", "batches", "inputs", "link", "span", "tokens")

    def __init__(self, tracer: Tracer, span: Any) -> None:
        self._tracer = tracer
        self.span = span
        ctx = span.get_span_context()
        # Only a sampled span is exported, so only a sampled one is worth a batch's link.
        self.link: bytes | None = (
            pack(ctx.trace_id, ctx.span_id, int(ctx.trace_flags)) if ctx.trace_flags & _SAMPLED else None
        )
        self.inputs = 0
        self.tokens = 0
        self.batches: list[str] = []

    @contextmanager
    def child(self, name: str, **attributes: Any) -> Iterator[None]:
        """A child span around the block (tokenisation); not made current (nothing nests in it)."""
        span = self._tracer.otel.start_span(name, attributes=attributes)
        try:
            yield
        finally:
            span.end()

    def inferred(self, model: str, seqs: Sequence[Sequence[int]], submitted: float, batch_start: float,
                 batches: Sequence[bytes]) -> None:
        """A model call finished: its queue wait as a child span (``submitted`` to ``batch_start``, on
        ``time.monotonic()``), its counts and its batches on the request span."""
        if not self.span.is_recording():
            return
        if batches:  # computed, not all answered from the cache
            start = _epoch_ns(submitted)
            queue = self._tracer.otel.start_span("coalesce.queue", start_time=start)
            queue.end(end_time=max(start, _epoch_ns(batch_start)))
        self.inputs += len(seqs)
        self.tokens += sum(len(s) for s in seqs)
        self.batches += [batch_id(b) for b in batches]
        self.span.set_attributes({
            "coalesce.model": model,
            "coalesce.inputs": self.inputs,
            "coalesce.tokens": self.tokens,
            "coalesce.batch.ids": self.batches,
        })


_CURRENT: ContextVar[RequestTrace | None] = ContextVar("coalesce_request_trace", default=None)


def current() -> RequestTrace | None:
    """The trace of the request this task serves; None when tracing is off (without a lookup) or the
    task serves none."""
    return None if active is None else _CURRENT.get()


class Tracer:
    """The process's OpenTelemetry tracer provider, exporter and sampler. Built by :func:`start`."""

    def __init__(self, endpoint: str, service_name: str, process: str, exporter: Any = None) -> None:
        """``exporter`` replaces the OTLP/HTTP one (tests)."""
        from opentelemetry import propagate
        from opentelemetry.context import Context
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
        from opentelemetry.trace.span import TraceFlags

        resource = Resource.create({"service.name": service_name, "coalesce.process": process})
        self.provider = TracerProvider(resource=resource, sampler=_linked_or(_env_sampler()),
                                       shutdown_on_exit=False)  # stop() flushes, within its bound
        self.url = traces_url(endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=self.url)))
        self.otel = self.provider.get_tracer("coalesce.service")
        self._extract = propagate.extract
        self._Link, self._SpanContext, self._TraceFlags = Link, SpanContext, TraceFlags
        self._Context = Context
        self._SERVER, self._ERROR, self._Status = SpanKind.SERVER, StatusCode.ERROR, Status

    # -- requests (gateway) --------------------------------------------------------------------------
    @contextmanager
    def request(self, method: str, route: str, path: str, headers: Any) -> Iterator[RequestTrace]:
        """A server span for one request, current for the block (its children and ``current()``)."""
        parent = self._extract(headers)
        with self.otel.start_as_current_span(
            f"{method} {route}", context=parent, kind=self._SERVER, record_exception=False,
            set_status_on_exception=False,
            attributes={"http.request.method": method, "http.route": route, "url.path": path},
        ) as span:
            trace = RequestTrace(self, span)
            token = _CURRENT.set(trace)
            try:
                yield trace
            finally:
                _CURRENT.reset(token)

    def answered(self, trace: RequestTrace, status: int, request_id: str) -> None:
        span = trace.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("coalesce.request_id", request_id)
        if status >= 500:  # a server's span is in error for 5xx only (HTTP semantic conventions)
            span.set_status(self._Status(self._ERROR))

    # -- batches (engine) ----------------------------------------------------------------------------
    def batch(self, model: str, device: str, links: dict[bytes, int], started: float) -> Any:
        """The span of one batch, started at ``started`` (``time.monotonic()``), in a trace of its own,
        linked to the request spans ``links`` (packed context → that request's inputs in the batch)."""
        made = []
        for raw, inputs in links.items():
            trace_id, span_id, flags = unpack(raw)
            ctx = self._SpanContext(trace_id, span_id, is_remote=True, trace_flags=self._TraceFlags(flags))
            made.append(self._Link(ctx, {"coalesce.inputs": inputs}))
        # An empty context: the batch starts a trace of its own, whatever task it runs in.
        return self.otel.start_span("coalesce.batch", context=self._Context(), links=made,
                                    start_time=_epoch_ns(started),
                                    attributes={"coalesce.model": model, "coalesce.device": device})

    def packed(self, span: Any) -> bytes:
        ctx = span.get_span_context()
        return pack(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))

    def failed(self, span: Any, error: str) -> None:
        span.set_status(self._Status(self._ERROR, error))

    def shutdown(self, timeout_s: float) -> None:
        """Export what is buffered and stop the exporter, waiting ``timeout_s`` at most: an export
        stuck on a collector that does not answer is left to die with the process."""

        def flush() -> None:
            self.provider.force_flush(int(timeout_s * 1e3))
            self.provider.shutdown()

        worker = threading.Thread(target=flush, name="coalesce-trace-flush", daemon=True)
        worker.start()
        worker.join(timeout_s)


def _env_sampler() -> Any:
    """``OTEL_TRACES_SAMPLER``/``_ARG`` as the SDK reads them; parent-based, always on, by default."""
    from opentelemetry.sdk.trace import sampling

    return sampling._get_from_env_or_default()


def _linked_or(inner: Any) -> Any:
    """``inner``, except that a span with links (a batch: it links sampled request spans only) is
    sampled: every sampled request then finds its batch, whatever the ratio."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class LinkedOr(Sampler):
        def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                          attributes: Any = None, links: Any = None, trace_state: Any = None) -> Any:
            if links:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
            return inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"LinkedOr{{{inner.get_description()}}}"

    return LinkedOr()


# The process's tracer: None (off) until start(); read on the request path, so a plain module global.
active: Tracer | None = None


def start(settings: Settings, process: str) -> Tracer | None:
    """Turn tracing on for this process when ``settings`` names a collector; None (off) otherwise."""
    global active
    if not settings.otlp_endpoint:
        return None
    try:
        import opentelemetry.exporter.otlp.proto.http
        import opentelemetry.sdk  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"--otlp-endpoint needs OpenTelemetry's SDK and OTLP/HTTP exporter ({exc}): install "
            "coalesce[tracing]"
        ) from exc
    active = Tracer(settings.otlp_endpoint, settings.otlp_service_name, process)
    return active


def stop(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Flush and stop this process's tracing (the end of the drain); a no-op when off."""
    global active
    tracer, active = active, None
    if tracer is not None:
        tracer.shutdown(timeout_s)
