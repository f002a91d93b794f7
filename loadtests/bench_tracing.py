"""The ``tracing`` bench section: what OpenTelemetry tracing costs a request's CPU.

The null-model server (``coalesce.loadtests.nullmodel``: the real service, forward replaced by a
constant) at the gateway section's top rate, open loop, short single-sentence requests that carry no
``traceparent`` (each trace starts at the server), in four runs one after the other: tracing off, on
with every trace sampled, on with one in ten (``parentbased_traceidratio`` 0.1), and off again (the
two off rows show the noise). Spans go to ``coalesce.loadtests.otlp_sink``, a collector in a process
of its own; server CPU from /proc (all its threads, the span exporter's included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from coalesce.loadtests import servers
from coalesce.loadtests.bench_sections import GATEWAY_RATES, _run
from coalesce.loadtests.procs import cpu_seconds
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix

RATIO = {"parentbased_always_on": 1.0, "parentbased_traceidratio": 0.1}


@contextmanager
def _sink(args: argparse.Namespace) -> Iterator[str]:
    spec = servers.ServerSpec("otlp-sink", [sys.executable, "-m", "coalesce.loadtests.otlp_sink",
                                            "--port", "{port}"])
    with servers.running(spec, args.out / "tracing" / "logs", args.ready_timeout) as srv:
        yield srv.base_url


def _spans(sink: str) -> int:
    with urllib.request.urlopen(sink + "/stats", timeout=5) as resp:
        return int(json.load(resp)["spans"])


def tracing(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "tracing"
    rate = GATEWAY_RATES[-1]
    seconds = min(args.duration, 10.0)
    scenario = Scenario(mode=Mode.OPEN, rate=rate, duration=seconds, warmup=0.0, mix=Mix.SHORT)
    rows = []
    cost: dict[str, float] = {}
    with _sink(args) as sink:
        cases: list[tuple[str, list[str], dict[str, str]]] = [("off", [], {})]
        for sampler, ratio in RATIO.items():
            env = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": str(ratio),
                   "OTEL_BSP_SCHEDULE_DELAY": "1000"}
            cases.append((f"on, {ratio:.0%} sampled", ["--otlp-endpoint", sink], env))
        cases.append(("off (again)", [], {}))
        for label, flags, env in cases:
            spec = servers.ServerSpec(
                label, [sys.executable, "-m", "coalesce.loadtests.nullmodel", "--host", "127.0.0.1",
                        "--port", "{port}", "--log-level", "warning", *flags], env=env)
            spans_before = _spans(sink)
            with servers.running(spec, out / "logs", args.ready_timeout) as srv:
                time.sleep(1.0)  # let start-up settle
                before = cpu_seconds(srv.proc.pid)
                st = _run(srv.url, scenario, label.replace(",", "").replace("%", "pct"), out)
                cpu = cpu_seconds(srv.proc.pid) - before
            # The server has stopped: its drain flushed every span it had.
            spans = _spans(sink) - spans_before
            per_request = cpu / max(st.ok, 1) * 1e6
            cost[label] = per_request
            lat = st.latency
            rows.append([
                label, fmt(st.achieved_rps, 0), f"{per_request:,.0f}",
                f"{per_request / cost['off']:.2f}×", f"{spans / max(st.ok, 1):.2f}",
                fmt(lat.p50_ms) if lat else "-", fmt(lat.p99_ms) if lat else "-",
            ])
    body = (
        f"What tracing costs: the null-model server at {rate:,} requests/s offered, open loop, short "
        f"single-sentence requests, {seconds:g} s per row, server CPU from /proc (all its threads, the "
        "span exporter's included); spans exported over OTLP/HTTP to a collector in another process "
        "(`coalesce.loadtests.otlp_sink`). Rows run one after the other; the two `off` rows show the "
        "noise. Spans per request counts what the collector received, batch spans included.\n\n"
        + markdown_table(["tracing", "achieved/s", "CPU µs / request", "÷ off", "spans / request",
                          "p50 ms", "p99 ms"], rows)
        + "\n"
    )
    return "Tracing cost per request (null model, CPU)", body
