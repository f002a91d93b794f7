"""The ``engine`` bench section: what the two halves of ``--workers N`` cost, and whether coalescing
still works across gateways.

* Null model (``coalesce.loadtests.nullmodel``: the real service, forward replaced by a constant), open
  loop at fixed rates: CPU µs per request of the engine process and of the gateway processes, beside
  one process (``--workers 1``); from those, the ceiling of a replica on a 16-core host.
* The real model, 32 closed-loop clients: ``--workers 2`` against ``--workers 1``, throughput and mean
  batch size (one queue per model in the engine: batches must not shrink as gateways are added).
"""

from __future__ import annotations

import argparse
import time
import urllib.request

from coalesce.loadtests import procs, servers
from coalesce.loadtests.bench_sections import CLIENTS, _met, _run, _spec
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix

ENGINE_RATES = (300, 1200)
NULL = ["--runner-factory", "coalesce.loadtests.nullmodel:factory", "--log-level", "warning"]
PROJECTED_CORES = 16


def _cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` and its children, summed by role (engine, gateway, or all for one process)."""
    kids = procs.children(pid)
    out = {"all": procs.cpu_seconds(pid)} if not kids else {}
    for child in kids:
        role = procs.role(child)
        out[role] = out.get(role, 0.0) + procs.cpu_seconds(child)
    return out


def _all_ready(url: str, timeout: float = 120.0) -> None:
    """Every process of the replica ready (``coalesce_ready`` is the minimum over them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        if any(line == "coalesce_ready 1.0" for line in text.splitlines()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not every process became ready")


def engine(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "engine"
    seconds = min(args.duration, 10.0)
    configs = (("one process", ["--workers", "1"]), ("--workers 2", ["--workers", "2"]))
    cost_rows = []
    costs: dict[tuple[str, int], dict[str, float]] = {}
    for rate in ENGINE_RATES:
        scenario = Scenario(mode=Mode.OPEN, rate=rate, duration=seconds, warmup=0.0, mix=Mix.SHORT)
        for name, flags in configs:
            with servers.running(_spec(args, f"null {name}", [*NULL, *flags]), out / "logs",
                                 args.ready_timeout) as srv:
                _all_ready(srv.base_url)
                time.sleep(1.0)  # let start-up settle
                before = _cpu_by_role(srv.proc.pid)
                st = _run(srv.url, scenario, f"null {name} {rate}", out)
                after = _cpu_by_role(srv.proc.pid)
            per = {role: (after[role] - before.get(role, 0.0)) / max(st.ok, 1) * 1e6 for role in after}
            costs[name, rate] = per
            lat = st.latency
            cost_rows.append([
                name, f"{rate:,}", fmt(st.achieved_rps, 0),
                f"{per['engine']:,.0f}" if "engine" in per else "-",
                f"{per['gateway']:,.0f}" if "gateway" in per else "-",
                f"{sum(per.values()):,.0f}",
                fmt(lat.p50_ms) if lat else "-", fmt(lat.p99_ms) if lat else "-",
            ])
    top = ENGINE_RATES[-1]
    split = costs["--workers 2", top]
    single = sum(costs["one process", top].values())
    engine_us, gateway_us = split["engine"], split["gateway"]
    engine_cap = 1e6 / engine_us
    gateway_cap = (PROJECTED_CORES - 1) * 1e6 / gateway_us
    ceiling = min(engine_cap, gateway_cap)

    closed = Scenario(
        mode=Mode.CLOSED, concurrency=CLIENTS, duration=args.duration, warmup=3.0, mix=Mix.SHORT
    )
    real = {}
    for name, flags in configs:
        with servers.running(_spec(args, f"real {name}", ["--log-level", "warning", *flags]), out / "logs",
                             args.ready_timeout) as srv:
            _all_ready(srv.base_url)
            real[name] = _run(srv.url, closed, f"real {name} c{CLIENTS}", out)
    one, two = real["one process"], real["--workers 2"]
    throughput = two.achieved_rps / one.achieved_rps if one.achieved_rps else 0.0
    mean_one = one.batch.mean_batch_size if one.batch else 0.0
    mean_two = two.batch.mean_batch_size if two.batch else 0.0
    batch_ratio = mean_two / mean_one if mean_one else 0.0
    real_rows = [
        [name, fmt(st.achieved_rps), fmt(st.latency.p50_ms if st.latency else None),
         fmt(st.latency.p99_ms if st.latency else None),
         fmt(st.batch.mean_batch_size if st.batch else None, 2), f"{st.error_rate:.1%}"]
        for name, st in real.items()
    ]
    figures = [
        [f"engine CPU per request (null model, --workers 2, {top:,}/s)", "≤ 100 µs",
         f"{engine_us:,.0f} µs", _met(engine_us <= 100)],
        ["throughput, --workers 2 ÷ one process (real model, 32 clients)", "≥ 0.9×", f"{throughput:.2f}×",
         _met(throughput >= 0.9)],
        ["mean batch, --workers 2 ÷ one process", "≥ 0.8×", f"{batch_ratio:.2f}×", _met(batch_ratio >= 0.8)],
    ]
    body = (
        "**Cost per request by process**, null model (the real service with a forward that costs "
        f"nothing), open loop, short single-sentence requests, {seconds:g} s per row, CPU from /proc "
        "(every thread; under `--workers 2` the engine process and the two gateway processes, the "
        "supervisor excluded: it only waits).\n\n"
        + markdown_table(["server", "offered/s", "achieved/s", "engine µs/req", "gateways µs/req",
                          "total µs/req", "p50 ms", "p99 ms"], cost_rows)
        + f"\n\nAt {top:,}/s one process spends {single:,.0f} µs per request; split, the engine spends "
        f"{engine_us:,.0f} µs and the gateways {gateway_us:,.0f} µs. Projection for a "
        f"{PROJECTED_CORES}-core host (one core for the engine, {PROJECTED_CORES - 1} for gateways): the "
        f"engine takes ~{engine_cap:,.0f} requests/s, the gateways ~{gateway_cap:,.0f}/s, so a replica "
        f"tops out near **{ceiling:,.0f} small requests/s** whatever the model (before the model's own "
        "time). Small requests only: a request of many inputs costs the gateway more and the engine "
        "about the same per input.\n\n"
        f"**Coalescing across gateways**, the real model, {CLIENTS} closed-loop clients, "
        f"{args.duration:g} s after 3 s warm-up, on this machine's cores (the gateways and the engine "
        "share them with the load generator):\n\n"
        + markdown_table(["server", "throughput (req/s)", "p50 ms", "p99 ms", "mean batch", "errors"],
                         real_rows)
        + "\n\n"
        + markdown_table(["figure", "target", "measured", ""], figures)
        + "\n"
    )
    return "Engine and gateways (--workers): cost per request, coalescing across processes", body
