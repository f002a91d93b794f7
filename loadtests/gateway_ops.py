"""The Python one process's event loop executes per request, HTTP to answer, counted by package and function.

    python -m coalesce.loadtests.gateway_ops [--clients 16] [--seconds 4] [--top 30] [--json]

The null-model service in one process (``coalesce.loadtests.nullmodel``: the real service, forward
replaced by a constant; no result cache), short one-sentence requests in a closed loop of ``--clients``
from this process. After a second's warm-up, for the ``--seconds`` of the measured run, the server's
event-loop thread counts the Python bytecodes it executes and the frames it enters (``sys.settrace`` with
opcode events, switched on and off by signals, as ``engine_ops --ops`` counts the engine's): per answered
request, the total, the share of each package (aiohttp's, each of the service's modules, ...) and the
functions that execute the most. What a change to the request path takes off the gateway's own
Python, read without the machine's noise: counts, unlike CPU time, hardly move with the machine's speed
(a little with the batch sizes the load happens to form).

Not counted: C code (the HTTP parser, msgspec, orjson, the tokenizer's Rust, system calls) and the
other threads (the tokenizer's and the device's). The counts are the interpreter's share of the event
loop's work, which is most of a request's CPU here, not all of it.

``bash loadtests/gateway_ops_ab.sh REV`` counts this checkout's service beside commit REV's, alternated.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from . import servers
from .bench_engine import NULL
from .cli import run_async
from .pyspy_summary import short_path
from .results import StepResult
from .scenario import Mode, Runner, Scenario, Target
from .workload import Mix

START, STOP = signal.SIGUSR1, signal.SIGUSR2
# A frame's file -> the package it is counted under: a dependency by its name, the service's own code
# by its module's path (service/gateway/facade.py), anything else by its file name.
_PACKAGES = ("aiohttp", "yarl", "multidict", "structlog", "prometheus_client", "msgspec", "asyncio", "uvloop")
_STDLIB = f"/python{sys.version_info.major}.{sys.version_info.minor}/"


def package(filename: str) -> str:
    """Where a code object's file is counted (see ``_PACKAGES``; the standard library's by file name)."""
    for name in _PACKAGES:
        if f"/{name}/" in filename:
            return name
    if _STDLIB in filename and "-packages/" not in filename:
        return "stdlib " + Path(filename).name
    return where(filename)


def where(filename: str) -> str:
    """A file as the report names it: the service's from its package's root (``service/gateway/app.py``,
    installed or not), others as the profile summaries do."""
    return filename.rsplit("/coalesce/", 1)[-1] if "/coalesce/" in filename else short_path(filename)


def _run(url: str, scenario: Scenario, label: str) -> StepResult:
    """One load run that does not scrape the server's metrics (a scrape's Python would count)."""
    return run_async(Runner(Target(url, metrics_url=None), scenario).run(label)).steps[0]


# The server side, run with ``python -c``: it imports nothing of this module, so that it runs any
# checkout's service (``--server-path``: an earlier commit's, first on PYTHONPATH). ``coalesce serve``
# (``sys.argv[2:]``) with its event loop's thread counted from START to STOP (``{start}``, ``{stop}``: their
# names; as ``engine_ops``' ``_OpCounter`` counts); at STOP the totals and each function's bytecodes
# (qualified name, file, first line) go to the file ``sys.argv[1]`` names, whole or not at all.
SERVER = """
import collections, json, os, signal, sys
out, argv = sys.argv[1], sys.argv[2:]
ops, calls, by_code = [0], [0], collections.Counter()
def step(frame, event, arg):
    if event == "opcode":
        ops[0] += 1
        by_code[frame.f_code] += 1
    return step
def call(frame, event, arg):
    if event != "call":
        return None
    calls[0] += 1
    frame.f_trace_opcodes = True
    return step
def start(*_):
    sys.settrace(call)
def stop(*_):
    sys.settrace(None)
    functions = [[c.co_qualname, c.co_filename, c.co_firstlineno, n] for c, n in by_code.items()]
    with open(out + ".tmp", "w") as f:
        json.dump({"bytecodes": ops[0], "calls": calls[0], "functions": functions}, f)
    os.replace(out + ".tmp", out)
signal.signal(signal.{start}, start)
signal.signal(signal.{stop}, stop)
from coalesce.service.cli import main
sys.exit(main(argv))
"""


def measure(clients: int, seconds: float, out: Path, server_path: str | None = None) -> dict[str, Any]:
    """One counted run: bytecodes and calls per answered request, by package and by function, and the
    run's requests and rate. ``server_path``: a directory first on the server's PYTHONPATH (another
    checkout's service)."""
    counts = out / "counts.json"
    counts.unlink(missing_ok=True)
    command = [sys.executable, "-c", SERVER.replace("{start}", START.name).replace("{stop}", STOP.name),
               str(counts)]
    # (The system allocator: jemalloc's is set by re-executing the process, which these signals' handlers
    # would not survive; the allocator moves no bytecode.)
    spec = servers.coalesce_spec("one process", [*NULL, "--workers", "1", "--allocator", "system"], command)
    if server_path is not None:
        path = os.pathsep.join(p for p in (server_path, os.environ.get("PYTHONPATH")) if p)
        spec = dataclasses.replace(spec, env={**spec.env, "PYTHONPATH": path})
    load = Scenario(mode=Mode.CLOSED, concurrency=clients, duration=seconds, warmup=0.0, mix=Mix.SHORT)
    with servers.running(spec, out / "logs", 180) as srv:
        _run(srv.url, replace(load, duration=1.0), "warm-up")
        os.kill(srv.proc.pid, START)
        time.sleep(0.2)  # (the handler runs at the loop's next bytecode; an idle loop counts nothing)
        st = _run(srv.url, load, "counted")
        time.sleep(0.2)
        os.kill(srv.proc.pid, STOP)
        deadline = time.monotonic() + 30
        while not counts.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the server wrote no counts")
            time.sleep(0.1)
    data = json.loads(counts.read_text())
    answered = sum(st.by_status.values())
    if answered == 0:
        raise RuntimeError("no request was answered")
    by_package: collections.Counter[str] = collections.Counter()
    functions = []
    for name, filename, line, n in data["functions"]:
        by_package[package(filename)] += n
        functions.append((f"{name} ({where(filename)}:{line})", n / answered))
    functions.sort(key=lambda f: -f[1])
    return {
        "requests": answered,
        "ok": st.ok,
        "rps": st.achieved_rps,
        "bytecodes": data["bytecodes"] / answered,
        "calls": data["calls"] / answered,
        "packages": {k: n / answered for k, n in by_package.most_common()},
        "functions": functions,
    }


def report(figures: dict[str, Any], top: int) -> str:
    total = figures["bytecodes"]
    lines = [f"{figures['requests']:,} requests answered ({figures['ok']:,} ok) at {figures['rps']:,.0f}/s; "
             f"per request, on the event loop's thread: {total:,.0f} Python bytecodes, "
             f"{figures['calls']:.1f} Python function calls (sys.settrace)",
             "", "by package, bytecodes a request:"]
    lines += [f"{n:9,.0f}  {n / total:6.1%}  {name}" for name, n in figures["packages"].items() if n >= 1]
    lines += ["", f"the {top} functions that execute the most, bytecodes a request:"]
    lines += [f"{n:9,.1f}  {place}" for place, n in figures["functions"][:top]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.gateway_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (16)")
    p.add_argument("--seconds", type=float, default=4.0, help="the counted run's seconds (4)")
    p.add_argument("--top", type=int, default=30, help="functions listed (30)")
    p.add_argument("--json", action="store_true", help="the figures as one JSON line, last")
    p.add_argument("--server-path", metavar="DIR",
                   help="first on the server's PYTHONPATH: another checkout's service (gateway_ops_ab.sh)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(args.clients, args.seconds, Path(tmp), args.server_path)
    print(report(figures, args.top))
    if args.json:
        print(json.dumps({**figures, "functions": figures["functions"][: args.top]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
