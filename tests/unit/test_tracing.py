"""Tracing's pieces without a server: the collector URL and the settings that name it, span contexts on
the wire, sampling that keeps every sampled request's batch, the batcher's batch spans and their links
(one forward serving several requests, an input two requests share), and no OpenTelemetry at all when
tracing is off."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator

import pytest
from coalesce.service import tracing
from coalesce.service.settings import build
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ..fakes import FakeRunner
from .test_batcher import Rig

REPO_ROOT = __file__.rsplit("/tests/", 1)[0]


def test_traces_url_appends_the_otlp_path_once() -> None:
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


def test_span_contexts_travel_as_25_bytes() -> None:
    trace_id, span_id = (1 << 127) | 12345, (1 << 63) | 7
    raw = tracing.pack(trace_id, span_id, 1)
    assert len(raw) == tracing.PACKED
    assert tracing.unpack(raw) == (trace_id, span_id, 1)
    assert tracing.batch_id(raw) == f"{trace_id:032x}-{span_id:016x}"
    with pytest.raises(ValueError):
        tracing.unpack(raw[:-1])


def test_the_endpoint_comes_from_the_flag_coalesce_or_opentelemetry_variables() -> None:
    assert build([], environ={}).otlp_endpoint is None  # off by default
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318", "OTEL_SERVICE_NAME": "rag-embedder"}
    s = build([], environ=otel)
    assert (s.otlp_endpoint, s.otlp_service_name) == ("http://otel:4318", "rag-embedder")
    s = build([], environ={**otel, "COALESCE_OTLP_ENDPOINT": "http://mine:4318"})
    assert s.otlp_endpoint == "http://mine:4318"
    s = build(["--otlp-endpoint", "http://flag:4318", "--otlp-service-name", "x"], environ=otel)
    assert (s.otlp_endpoint, s.otlp_service_name) == ("http://flag:4318", "x")
    assert build([], environ={}).otlp_service_name == "coalesce"
    assert tracing.start(build([], environ={"OTEL_EXPORTER_OTLP_ENDPOINT": ""}), "server") is None


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, into memory; a root trace is sampled one time in ten thousand."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.0001")
    exporter = InMemorySpanExporter()
    tracer = tracing.Tracer("http://unused:4318", "test", "server", exporter=exporter)
    monkeypatch.setattr(tracing, "active", tracer)
    yield exporter
    tracing.stop()


def _sampled_parent(i: int) -> dict[str, str]:
    return {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}


def test_sampling_is_parent_based_and_a_batch_follows_its_sampled_requests(
    traced: InMemorySpanExporter,
) -> None:
    tracer = tracing.active
    assert tracer is not None
    with tracer.request("POST", "/embed", "/embed", _sampled_parent(0)) as kept:
        assert kept.link is not None  # a sampled parent: sampled, and worth a batch's link
    with tracer.request("POST", "/embed", "/embed", {"traceparent": f"00-{2:032x}-{2:016x}-00"}) as dropped:
        assert dropped.link is None
    # A root at the ratio of 1 in 10,000 is all but never sampled; a batch linking a sampled request is.
    assert sum(tracer.otel.start_span("root").is_recording() for _ in range(50)) < 5
    batch = tracer.batch("m", "cpu", {kept.link: 1}, 0.0)
    assert batch.is_recording() and batch.get_span_context().trace_flags.sampled


@pytest.fixture
async def rig(traced: InMemorySpanExporter) -> AsyncIterator[Rig]:
    r = Rig(FakeRunner(batch_seconds=0.05))
    yield r
    await r.aclose()


async def test_a_batch_span_links_every_request_it_computed(
    traced: InMemorySpanExporter, rig: Rig
) -> None:
    tracer = tracing.active
    assert tracer is not None
    links = [tracing.pack(i + 1, i + 1, 1) for i in range(3)]
    # Three requests in one forward; the third asks for an input the first already queued.
    first = rig.batcher.submit(rig.seqs("alpha one", "alpha two"), link=links[0])
    second = rig.batcher.submit(rig.seqs("beta"), link=links[1])
    third = rig.batcher.submit(rig.seqs("alpha one"), link=links[2])
    untraced = rig.batcher.submit(rig.seqs("gamma"))  # an unsampled request: no link
    results = await asyncio.gather(first, second, third, untraced)
    tracer.provider.force_flush()
    batches = [s for s in traced.get_finished_spans() if s.name == "coalesce.batch"]
    assert len(batches) == 1, rig.runner.batches
    span = batches[0]
    inputs = {tracing.pack(ln.context.trace_id, ln.context.span_id, 1): ln.attributes["coalesce.inputs"]
              for ln in span.links}
    assert inputs == {links[0]: 2, links[1]: 1, links[2]: 1}
    assert span.attributes["coalesce.batch.size"] == 4  # alpha one computed once for two requests
    longest = span.attributes["coalesce.batch.longest"]
    assert span.attributes["coalesce.batch.cell"] == f"4x{longest}"  # the fake pads to its longest
    assert span.attributes["coalesce.batch.requests"] == 3
    assert span.attributes["coalesce.device"] == ""
    assert "coalesce.forward_ms" in span.attributes
    assert span.parent is None
    own = tracer.packed(span)
    assert [r.batches for r in results] == [(own,), (own,), (own,), ()]


async def test_without_sampled_requests_a_batch_has_no_span(traced: InMemorySpanExporter, rig: Rig) -> None:
    result = await rig.batcher.submit(rig.seqs("nobody traces this"))
    assert result.batches == ()
    assert tracing.active is not None
    tracing.active.provider.force_flush()
    assert traced.get_finished_spans() == ()


def test_off_the_server_never_imports_opentelemetry() -> None:
    """A server built and serving requests with tracing off has not imported any of OpenTelemetry."""
    script = textwrap.dedent("""
        import asyncio, sys
        from coalesce.service import tracing
        from coalesce.service.gateway.app import create_app
        from coalesce.service.settings import build
        from tests.fakes import FakeRunner, ready_client

        settings = build([], environ={})
        assert tracing.start(settings, "server") is None

        async def main():
            client = await ready_client(create_app(settings, lambda spec: FakeRunner()))
            for i in range(3):
                resp = await client.post("/v1/embeddings", json={"model": "fake", "input": [f"text {i}"]},
                                         headers={"traceparent": f"00-{1:032x}-{1:016x}-01"})
                assert resp.status == 200, await resp.text()
            await client.close()

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
