"""The ``engine`` bench section: what the two halves of ``--workers N`` cost, and whether coalescing
still works across gateways.

* Null model (``coalesce.loadtests.nullmodel``: the real service, forward replaced by a constant; no
  result cache), open loop at 1,200 requests/s and at saturation (16 closed-loop clients): CPU µs per
  request of the engine process and of the gateway processes, beside one process (``--workers 1``)
  and the aiohttp stub (``coalesce.loadtests.stub``) under the same load; from those, the ceiling of
  one engine and of a 16-core host.
* Where the live engine's and a gateway's interpreter lock go at saturation (``py-spy record --gil``,
  when py-spy is installed: the ``loadtest`` extra), and how the engine's cost per request falls as its
  batches grow (saturation at 64 clients beside 16).
* What remains of the engine's cost, without HTTP or sockets (``coalesce.loadtests.engine_ops``): its
  Python per request at 1, 4 and 16 requests a message, the device-thread hand-off per batch, and a
  message's round trip to another process.
* The real model, 32 closed-loop clients: ``--workers 2`` against ``--workers 1`` and against the
  in-process sentence-transformers rate at its best batch size, throughput and mean batch size (one
  queue per model in the engine: batches must not shrink as gateways are added); and each beside the
  other choice of CPU forwards (where the default, on two cores, runs two side by side in one process and
  one at a time in the engine of ``--workers``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
from coalesce.loadtests import procs, pyspy_summary, servers
from coalesce.loadtests.bench_sections import (
    CLIENTS,
    ROUNDS,
    _met,
    _run,
    _sentences,
    _spec,
    interleaved,
    median_by,
    sentence_transformers_best,
)
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix
from msgspec.structs import replace

OPEN_RATE = 1200
SATURATING_CLIENTS = 16
MANY_CLIENTS = 64  # the same saturation with bigger batches: how the engine's per-batch costs spread
SAMPLE_S = 8  # py-spy's sampling of the engine and of one gateway, at once, under the 16-client load
# The calls that make a system call waking another process or thread, by the name py-spy gives the
# Python function making it (its C calls count as its own samples): a message to the other side of the
# engine's sockets, the hand-off of a batch to the device thread and the device thread's answer to the
# event loop, an HTTP response's write to its client, the event loop's own wait and reads (``run``).
WAKE_CALLS = ("Link.send", "Lane.call", "ModelWorker.start.<locals>.reply", "StreamWriter._writelines")
NULL = ["--runner-factory", "coalesce.loadtests.nullmodel:factory", "--cache-mb", "0",
        "--log-level", "warning"]
PROJECTED_CORES = 16
# The real model with the other choice of CPU forwards beside the default (worker.cpu_forwards), which on
# a 2-core machine with a traced forward runs two side by side in one process, one at a time in the engine
# of --workers: one process with one forward at a time on every core, --workers 2 with two side by side.
OTHER_FORWARDS = [("one process, one forward", ["--cpu-forwards", "1"]),
                  ("--workers 2, two forwards", ["--workers", "2", "--cpu-forwards", "2"])]


def _cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` and its children, summed by role (engine, gateway, or all for one process)."""
    kids = procs.children(pid)
    out = {"all": procs.cpu_seconds(pid)} if not kids else {}
    for child in kids:
        role = procs.role(child)
        out[role] = out.get(role, 0.0) + procs.cpu_seconds(child)
    return out


def cpu_per_request(srv: servers.RunningServer, scenario: Scenario, label: str, out: Path
                    ) -> tuple[dict[str, float], Any]:
    """One load run on ``srv``: its CPU µs per answered request by role (:func:`_cpu_by_role`), and the
    run's step result. The scenario's warm-up runs first, as a run of its own outside the CPU counted:
    the load runner counts the requests of its measured window only, and CPU read across a warm-up
    too overstated every figure by warm-up ÷ duration (a tenth at the engine section's 1 s and 10 s;
    ratios between servers measured alike were unchanged)."""
    if scenario.warmup > 0:
        _run(srv.url, replace(scenario, duration=scenario.warmup, warmup=0.0), f"{label} warm-up", out)
        scenario = replace(scenario, warmup=0.0)
    before = _cpu_by_role(srv.proc.pid)
    st = _run(srv.url, scenario, label, out)
    after = _cpu_by_role(srv.proc.pid)
    return {role: (after[role] - before.get(role, 0.0)) / max(st.ok, 1) * 1e6 for role in after}, st


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


def wake_share(own: dict[str, int], total: int, calls: Iterable[str] = WAKE_CALLS) -> float:
    """The share of ``total`` samples whose own function is one of ``calls`` (names without their file)."""
    wanted = set(calls)
    return sum(n for name, n in own.items() if name.split(" (")[0] in wanted) / max(total, 1)


def _own_table(samples: pyspy_summary.Samples, top: int = 12) -> str:
    """The ``top`` functions by own samples of each process of ``samples``, side by side, as shares."""
    names = list(samples)
    tops = {name: own.most_common(top) for name, (_, _, own) in samples.items()}
    rows = []
    for i in range(top):
        row = []
        for name in names:
            total = samples[name][0]
            got = tops[name][i] if i < len(tops[name]) else None
            row += [got[0] if got else "", f"{100 * got[1] / max(total, 1):.1f}%" if got else ""]
        rows.append(row)
    return markdown_table([h for name in names for h in (f"{name}: function", "own")], rows)


def _wake_shares(samples: pyspy_summary.Samples) -> str:
    return ", ".join(f"the {name}'s {100 * wake_share(own, total):.0f}% ({total:,} samples)"
                     for name, (total, _, own) in samples.items())


def _profile(samples: pyspy_summary.Samples | str, top: int = 12) -> str:
    if isinstance(samples, str):
        return f"**Where the lock goes, live**: not sampled ({samples}).\n\n"
    return (
        f"**Where the lock goes, live** (`py-spy record --gil`, {SAMPLE_S} s at once of the engine and of "
        f"one gateway of the null `--workers 2` server under the {SATURATING_CLIENTS}-client load above; a "
        "function's own samples, which count the C calls it makes, as shares of all the process's samples). "
        f"The calls that wake another process or thread ({', '.join(f'`{c}`' for c in WAKE_CALLS)}: the "
        "sockets between the processes, the device thread's hand-off and answer, the HTTP response's write) "
        f"took {_wake_shares(samples)}:\n\n"
        + _own_table(samples, top)
        + "\n\n"
    )


def _fed_profile(row: dict[str, Any]) -> str:
    """The engine's lock when it is the busy process: ``engine_ceiling --profile``'s row."""
    spied = row["profile"]
    caption = (f"**Where the lock goes when the engine is the busy process** (`engine_ceiling --profile "
               f"{FED_PROFILE_S}`, its own run of the {FED[0]} × {FED[1]} row: {row['rps']:,.0f} requests/s "
               f"there, py-spy beside it)")
    if isinstance(spied, str):
        return f"{caption}: not sampled ({spied}).\n\n"
    own: collections.Counter[str] = collections.Counter(dict(spied["own"]))
    samples: pyspy_summary.Samples = {"engine": (spied["total"], collections.Counter(), own)}
    return (f"{caption}; the same calls that wake another thread or process took {_wake_shares(samples)}:\n\n"
            + _own_table(samples) + "\n\n")


def _sample_under_load(server: Any, scenario: Scenario, out: Path) -> pyspy_summary.Samples | str:
    """:func:`.pyspy_summary.record_gil` of ``server``'s engine and of one of its gateways while
    ``scenario`` (a few seconds longer than the sampling) loads it."""
    kids = {procs.role(pid): pid for pid in procs.children(server.proc.pid)}  # (one gateway of them)
    load = msgspec.structs.replace(scenario, duration=SAMPLE_S + 4.0, warmup=1.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_run, server.url, load, "null --workers 2 sampled", out)
        time.sleep(2.0)  # past the warm-up
        samples = pyspy_summary.record_gil({"engine": kids["engine"], "gateway": kids["gateway"]},
                                           SAMPLE_S)
        running.result()
    return samples


# engine_ops' second run: this many gateways, a message of 1 or 2 requests each, read in one turn
# (a loaded GPU replica behind many gateways).
MANY_GATEWAYS = 8


def _engine_ops(*flags: str) -> dict[str, Any]:
    """``coalesce.loadtests.engine_ops``' figures (its own process: it runs several event loops)."""
    out = subprocess.run([sys.executable, "-m", "coalesce.loadtests.engine_ops", "--json", *flags],
                         capture_output=True, text=True, timeout=900, check=True).stdout
    figures: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return figures


# engine_ceiling's rows: (gateways, requests in flight at each), the engine the busy process. The host the
# projection is for has PROJECTED_CORES - 1 gateways; FED is the row it reads (a gateway's turn under load
# carries a request or two); the others show how the figures move with the load.
CEILING_ROWS = ((1, 2), (4, 2), (PROJECTED_CORES - 1, 1), (PROJECTED_CORES - 1, 2), (PROJECTED_CORES - 1, 4))
FED = (PROJECTED_CORES - 1, 2)
COMPASS_RPS = 20_000  # issue 25's goal for one 16-core H200 host
FED_PROFILE_S = 5  # py-spy's sampling of the FED row's engine, in a run of its own


def _engine_ceiling(*flags: str) -> list[dict[str, Any]]:
    """``coalesce.loadtests.engine_ceiling``'s rows for :data:`CEILING_ROWS` (its own process each run:
    it starts an engine and drives it from its own event loop); with ``flags``, its rows for them."""
    each = {g: ",".join(str(k) for h, k in CEILING_ROWS if h == g) for g, _ in CEILING_ROWS}
    runs = [flags] if flags else [("--gateways", str(g), "--outstanding", ks) for g, ks in each.items()]
    rows: list[dict[str, Any]] = []
    for run in runs:
        out = subprocess.run([sys.executable, "-m", "coalesce.loadtests.engine_ceiling", "--json", *run],
                             capture_output=True, text=True, timeout=900, check=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])["rows"]
    return rows


def _ceiling_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["gateways", "in flight", "requests/s", "engine µs/request", "engine core", "mean batch", "p50 ms",
         "p99 ms"],
        [[str(r["gateways"]), str(r["gateways"] * r["outstanding"]), f"{r['rps']:,.0f}",
          f"{r['engine_us']:,.1f}", f"{r['engine_core']:.2f}", f"{r['mean_batch']:.2f}", f"{r['p50_ms']:.2f}",
          f"{r['p99_ms']:.2f}"]
         for r in rows])


def _remains(ops: dict[str, Any], many: dict[str, Any] | None = None) -> str:
    """What the engine's CPU per request is made of, from ``engine_ops`` (one gateway), and with
    ``many`` gateways' messages in each turn."""
    rows = [[f"1 × {r['jobs']}", f"{r['batches']:.2f}", f"{r['threaded_us']:,.1f}", f"{r['inline_us']:,.1f}",
             f"{r['hand_off_us']:,.1f}"] for r in ops["rows"]]
    if many is not None:
        rows += [[f"{many['gateways']} × {r['jobs']}", f"{r['batches']:.2f}", f"{r['threaded_us']:,.1f}",
                  f"{r['inline_us']:,.1f}", f"{r['hand_off_us']:,.1f}"] for r in many["rows"]]
    trips = ops["message_round_trip_us"]
    assert isinstance(trips, dict)
    messages = "; ".join(f"over {t}: {mine:,.1f} µs here and {theirs:,.1f} µs there"
                         for t, (mine, theirs) in trips.items())
    return (
        "**What remains**, without HTTP or sockets (`python -m coalesce.loadtests.engine_ops`: the engine's "
        "own path, `Submit` in and `Results` out, a message of N one-sentence requests at a time, the "
        "forward a constant), CPU per request with the batch run on the device thread as served, and "
        "inline on the event loop (the engine's Python alone; the difference is the hand-off to the "
        "device thread and back). G × N: G gateways each send a message of N requests, all read in one "
        f"event-loop turn (`--gateways {MANY_GATEWAYS} --jobs 1,2`: many gateways' small messages, "
        "admitted together by the engine's turn):\n\n"
        + markdown_table(["gateways × requests/message", "batches/message", "threaded µs/request",
                          "inline µs/request", "hand-off µs/batch"], rows)
        + f"\n\nA bare thread round trip (a call handed to a thread that answers the loop) costs "
        f"{ops['thread_round_trip_us']:,.1f} µs of CPU here; a small message's round trip to another "
        f"process (CPU of each side) {messages}.\n\n"
    )


def engine(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "engine"
    seconds = min(args.duration, 10.0)
    stub = servers.stub_spec()
    configs = (("stub", None), ("one process", ["--workers", "1"]), ("--workers 2", ["--workers", "2"]))
    loads = (
        (f"{OPEN_RATE:,}/s", Scenario(mode=Mode.OPEN, rate=OPEN_RATE, duration=seconds, warmup=0.0,
                                     mix=Mix.SHORT)),
        (f"saturation, {SATURATING_CLIENTS} clients",
         Scenario(mode=Mode.CLOSED, concurrency=SATURATING_CLIENTS, duration=seconds, warmup=1.0,
                  mix=Mix.SHORT)),
        (f"saturation, {MANY_CLIENTS} clients",
         Scenario(mode=Mode.CLOSED, concurrency=MANY_CLIENTS, duration=seconds, warmup=1.0, mix=Mix.SHORT)),
    )
    # Every server stays up for the whole part and the runs interleave (ROUNDS rounds of each load on
    # each server; the round of median total CPU is reported).
    with contextlib.ExitStack() as stack:
        started = {}
        for name, flags in configs:
            spec = stub if flags is None else _spec(args, f"null {name}", [*NULL, *flags])
            started[name] = stack.enter_context(servers.running(spec, out / "logs", args.ready_timeout))
            if flags is not None:
                _all_ready(started[name].base_url)
        time.sleep(1.0)  # let start-up settle
        scenarios = dict(loads)

        def cost(cell: tuple[str, str], r: int) -> tuple[dict[str, float], Any]:
            name, load = cell
            return cpu_per_request(started[name], scenarios[load], f"null {name} {load} round {r + 1}", out)

        runs = interleaved([(name, load) for load, _ in loads for name in started], cost)
        samples = _sample_under_load(started["--workers 2"], loads[1][1], out)
    cost_rows = []
    costs: dict[tuple[str, str], dict[str, float]] = {}
    for load, _ in loads:
        for name, _ in configs:
            per, st = median_by(runs[name, load], lambda run: sum(run[0].values()))
            costs[name, load] = per
            total = sum(per.values())
            lat = st.latency
            cost_rows.append([
                name, load, fmt(st.achieved_rps, 0),
                f"{per['engine']:,.0f}" if "engine" in per else "-",
                f"{per['gateway']:,.0f}" if "gateway" in per else "-",
                f"{total:,.0f}", f"{total / sum(costs['stub', load].values()):.2f}×",
                fmt(st.batch.mean_batch_size, 2) if st.batch else "-",
                fmt(lat.p50_ms) if lat else "-", fmt(lat.p99_ms) if lat else "-",
            ])
    at_rate, saturated = loads[0][0], loads[1][0]
    stub_us = sum(costs["stub", saturated].values())
    single = sum(costs["one process", saturated].values())
    split = costs["--workers 2", saturated]
    engine_us, gateway_us = split["engine"], split["gateway"]
    engine_open_us = costs["--workers 2", at_rate]["engine"]
    engine_cap = 1e6 / engine_us
    gateway_cap = (PROJECTED_CORES - 1) * 1e6 / gateway_us

    remains = _remains(_engine_ops(), _engine_ops("--gateways", str(MANY_GATEWAYS), "--jobs", "1,2"))
    fed_rows = _engine_ceiling()
    fed = next(r for r in fed_rows if (r["gateways"], r["outstanding"]) == FED)
    (fed_spied,) = _engine_ceiling("--gateways", str(FED[0]), "--outstanding", str(FED[1]),
                                   "--seconds", str(FED_PROFILE_S), "--profile", str(FED_PROFILE_S))
    ceiling = min(fed["rps"], gateway_cap)
    closed = Scenario(
        mode=Mode.CLOSED, concurrency=CLIENTS, duration=max(args.duration / ROUNDS, 5.0), warmup=3.0,
        mix=Mix.SHORT
    )
    best_batch, best_rate = sentence_transformers_best(_sentences(closed))
    with contextlib.ExitStack() as stack:  # all up at once, their runs interleaved, as above
        up = {}
        for name, flags in [*configs[1:], *OTHER_FORWARDS]:
            assert flags is not None
            up[name] = stack.enter_context(servers.running(
                _spec(args, f"real {name}", ["--log-level", "warning", *flags]), out / "logs",
                args.ready_timeout))
            _all_ready(up[name].base_url)
        real_runs = interleaved(
            list(up), lambda name, r: _run(up[name].url, closed, f"real {name} c{CLIENTS} round {r + 1}", out)
        )
    real = {name: median_by(sts, lambda st: st.achieved_rps) for name, sts in real_runs.items()}
    one, two = real["one process"], real["--workers 2"]
    one_other, two_other = (real[name] for name, _ in OTHER_FORWARDS)
    vs_best = one.achieved_rps / best_rate if best_rate else 0.0
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
        [f"engine CPU per request (null model, --workers 2, {saturated})", "≤ 40 µs", f"{engine_us:,.0f} µs",
         _met(engine_us <= 40)],
        [f"engine CPU per request (null model, --workers 2, {at_rate})", "≤ 100 µs",
         f"{engine_open_us:,.0f} µs", _met(engine_open_us <= 100)],
        [f"one process ÷ stub, CPU per request ({saturated})", "≤ 2.5×", f"{single / stub_us:.2f}×",
         _met(single <= 2.5 * stub_us)],
        [f"gateway ÷ stub, CPU per request ({saturated})", "≤ 3×", f"{gateway_us / stub_us:.2f}×",
         _met(gateway_us <= 3 * stub_us)],
        [f"one process ÷ in-process best batch ({best_batch}), real model, {CLIENTS} clients", "≥ 0.95×",
         f"{vs_best:.2f}×", _met(vs_best >= 0.95)],
        [f"throughput, --workers 2 ÷ one process (real model, {CLIENTS} clients)", "≥ 1.0×",
         f"{throughput:.2f}×", _met(throughput >= 1.0)],
        ["mean batch, --workers 2 ÷ one process", "≥ 0.8×", f"{batch_ratio:.2f}×", _met(batch_ratio >= 0.8)],
        [f"one engine fed by {FED[0]} gateways, {FED[1]} in flight each (null model): requests/s",
         f"≥ {COMPASS_RPS:,} (a 16-core host's goal)", f"{fed['rps']:,.0f}", _met(fed["rps"] >= COMPASS_RPS)],
    ]
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}×" if b else "-"
    body = (
        "**Cost per request by process**, null model (the real service with a forward that costs "
        f"nothing, no result cache), short single-sentence requests, open loop at {at_rate} and closed "
        f"loop at {saturated}; every server up at once and {ROUNDS} interleaved rounds of {seconds:g} s "
        "per row, the round of median CPU shown; CPU from /proc (every thread; under `--workers 2` the "
        "engine process and the two gateway processes, the supervisor excluded: it only waits). The stub "
        "(`coalesce.loadtests.stub`: aiohttp answering a canned 384-wide vector) is the floor for any "
        "Python gateway.\n\n"
        + markdown_table(["server", "load", "achieved/s", "engine µs/req", "gateways µs/req",
                          "total µs/req", "÷ stub", "mean batch", "p50 ms", "p99 ms"], cost_rows)
        + f"\n\nAt {saturated} one process spends {single:,.0f} µs per request; split, the engine spends "
        f"{engine_us:,.0f} µs and the gateways {gateway_us:,.0f} µs. Here the engine is not the busy "
        "process (the gateways and the load generator take the two cores), so its batches are small and "
        f"10⁶ ÷ its µs per request (~{engine_cap:,.0f}/s) understates what it takes when it is: measured "
        "below, fed by a 16-core host's gateways.\n\n"
        + _profile(samples)
        + remains
        + "**What one engine takes when it is the busy process** (`python -m coalesce.loadtests."
        "engine_ceiling`: the real engine process, null model, no result cache, metrics shared as under "
        "`--workers`, fed over its sockets by G gateways' engine clients in one process on the other core, "
        "each keeping K one-sentence requests in flight, no HTTP; 4 s after 1 s of warm-up a row; latency "
        "from a request's submit to its answer, the engine's share of it):\n\n"
        + _ceiling_table(fed_rows)
        + "\n\n"
        + _fed_profile(fed_spied)
        + f"Projection for a {PROJECTED_CORES}-core host (one core for the engine, "
        f"{PROJECTED_CORES - 1} for gateways): one engine takes ~{fed['rps']:,.0f} requests/s fed by "
        f"{FED[0]} gateways with {FED[1]} in flight each (more with more in flight: its batches grow and "
        f"each request pays less of them), the gateways ~{gateway_cap:,.0f}/s at the {saturated} figure, "
        f"so a replica tops out near **{ceiling:,.0f} small requests/s** (before the model's own time and "
        "its device's CPU: a GPU's launches and copies run on the engine's device thread). Small requests "
        "only: a request of many inputs costs the gateway more and the engine about the same per "
        "input.\n\n"
        + f"**Coalescing across gateways**, the real model, {CLIENTS} closed-loop clients, all up at "
        f"once, {ROUNDS} interleaved rounds of {closed.duration:.3g} s after 3 s warm-up (the round of "
        "median throughput shown), on this machine's cores (the gateways and the engine "
        "share them with the load generator); in-process sentence-transformers at its best batch size "
        f"({best_batch}) embeds {best_rate:,.0f} sentences/s. The rows above run the default, which on two "
        "cores with the traced forward is two forwards side by side, one core each, in one process and "
        "one forward at a time on every core in the engine of `--workers`; the last two rows run the "
        "other choice (`--cpu-forwards 1` in one process, `--cpu-forwards 2` under `--workers 2`):\n\n"
        + markdown_table(["server", "throughput (req/s)", "p50 ms", "p99 ms", "mean batch", "errors"],
                         real_rows)
        + f"\n\nThe default served {ratio(one.achieved_rps, one_other.achieved_rps)} the requests/s of one "
        f"forward at a time in one process, {ratio(two.achieved_rps, two_other.achieved_rps)} the "
        "requests/s of two side by side under `--workers 2`.\n\n"
        + markdown_table(["figure", "target", "measured", ""], figures)
        + "\n"
    )
    return "Engine and gateways (--workers): cost per request, coalescing across processes", body
