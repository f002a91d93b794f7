"""CPU cost of the scheduler per input: admit/add, next and done on a virtual clock.

The scheduler runs on the engine's event loop for every batch, so its CPU time per input is part of the
engine's budget. Each workload below pushes requests through ``admit`` + ``add``, ``next`` and ``done``
driven by a discrete-event loop (a simulated model whose batch time is ``a + b × padded tokens``), and only
the time spent inside those calls is counted (not building the entries). Best of ``--repeat`` runs,
the versions interleaved.

    python -m coalesce.loadtests.sched_bench
    mkdir -p /tmp/main-batching && for f in scheduler policy cost; do
        git show main:service/batching/$f.py > /tmp/main-batching/$f.py; done
    python -m coalesce.loadtests.sched_bench --baseline /tmp/main-batching   # side by side, same run

``--baseline`` loads another version of the batching package (``scheduler.py`` with the ``policy.py`` and
``cost.py`` it imports) from a folder; a version without ``Entry.flow`` simply gets no flows.
"""

from __future__ import annotations

import argparse
import heapq
import importlib
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from coalesce.service.batching import cost as current_cost
from coalesce.service.batching import policy as current_policy
from coalesce.service.batching import scheduler as current_scheduler


@dataclass(frozen=True)
class Request:
    time: float
    lengths: tuple[int, ...]
    tenant: str = "default"
    priority: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    a: float  # simulated seconds per batch
    b: float  # simulated seconds per padded token
    build: Callable[[random.Random], list[Request]]


def _singles(
    n: int, rate: float, tenants: int = 1, classes: int = 1
) -> Callable[[random.Random], list[Request]]:
    def build(rng: random.Random) -> list[Request]:
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(
                Request(t, (rng.randint(8, 24),), f"t{rng.randrange(tenants)}", rng.randrange(classes))
            )
        return out

    return build


def _bulk_and_queries(rng: random.Random) -> list[Request]:
    bulk = Request(0.0, tuple(rng.randint(128, 256) for _ in range(2048)))
    queries = [Request(0.001 + 0.002 * i, (rng.randint(8, 16),)) for i in range(400)]
    return [bulk, *queries]


# A GPU-like model (2 ms + 1 µs per padded token) has ~75k tokens/s of capacity: the single-input
# workloads offer twice that (the queue fills; every batch is full) and half of it (little queues).
WORKLOADS = (
    Workload(
        "singles-saturated", "20k one-input requests at 2× capacity", 0.002, 1e-6, _singles(20_000, 9000.0)
    ),
    Workload(
        "singles-light", "20k one-input requests at 0.5× capacity", 0.002, 1e-6, _singles(20_000, 2200.0)
    ),
    Workload(
        "tenants-classes",
        "20k one-input requests, 4 tenants × 3 classes, 2× capacity",
        0.002,
        1e-6,
        _singles(20_000, 9000.0, tenants=4, classes=3),
    ),
    Workload("bulk+queries", "one 2,048-input request, a query every 2 ms", 0.002, 1e-6, _bulk_and_queries),
)


def load_batching(folder: str | None) -> tuple[ModuleType, ModuleType, ModuleType]:
    """(scheduler, policy, cost) modules: this checkout's, or those in ``folder``."""
    if folder is None:
        return current_scheduler, current_policy, current_cost
    name = "_sched_bench_baseline"
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]  # a folder loaded before
    package = ModuleType(name)
    package.__path__ = [folder]  # relative imports inside resolve to the folder's modules
    sys.modules[name] = package
    modules = tuple(importlib.import_module(f"{name}.{m}") for m in ("scheduler", "policy", "cost"))
    return modules  # type: ignore[return-value]


def run(version: tuple[ModuleType, ModuleType, ModuleType], work: Workload, seed: int) -> tuple[float, int]:
    """(seconds inside the scheduler, inputs completed)."""
    mod, policy, cost = version
    requests = work.build(random.Random(seed))
    config = mod.SchedulerConfig(
        limits=policy.Limits(64, 16384), max_queued_tokens=1 << 22, tenant_max_queued_tokens=1 << 22
    )
    sched = mod.Scheduler(config, cost.CostModel(), lambda n, longest: n * longest)
    for n, length in ((1, 16), (8, 64)):
        sched.cost.observe(n * length, work.a + work.b * n * length)
    # (Entry was a dataclass before it was a msgspec Struct; a version from before flows has no ``flow``.)
    entry = mod.Entry
    fields: Any = getattr(entry, "__struct_fields__", None) or getattr(entry, "__dataclass_fields__", ())
    has_flow = "flow" in fields
    clock = time.perf_counter
    spent = 0.0
    done = 0
    events: list[tuple[float, int, Any]] = [(r.time, i, r) for i, r in enumerate(requests)]
    heapq.heapify(events)
    seq = len(events)
    while events:
        now, _, item = heapq.heappop(events)
        if isinstance(item, Request):
            flow = {"flow": seq} if has_flow else {}  # one flow per request, as the batcher keys them
            entries = [mod.Entry(n, now, item.tenant, 1.0, item.priority, None, **flow) for n in item.lengths]
            t0 = clock()
            if sched.admit(item.lengths, item.tenant, None, now) is None:
                sched.add(entries)
            spent += clock() - t0
        else:
            padded, seconds, size = item
            t0 = clock()
            sched.done(padded, seconds, now)
            spent += clock() - t0
            done += size
        while True:
            t0 = clock()
            decision = sched.next(now)[0]
            spent += clock() - t0
            if not isinstance(decision, mod.Dispatch):
                break  # no timers: the adaptive strategy without a hold never waits
            seconds = work.a + work.b * decision.padded_tokens
            seq += 1
            heapq.heappush(
                events, (now + seconds, seq, (decision.padded_tokens, seconds, len(decision.batch)))
            )
    return spent, done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="a folder with another version of the batching package "
                   "(scheduler.py, policy.py, cost.py and what they import)")
    p.add_argument(
        "--repeat", type=int, default=5, help="runs per workload and version; the best counts (default 5)"
    )
    p.add_argument("--only", help="run only the workload of this name")
    args = p.parse_args(argv)
    versions = {"this": load_batching(None)}
    if args.baseline:
        versions = {"baseline": load_batching(args.baseline), **versions}
    header = f"{'workload':<18} " + " ".join(f"{name + ' µs/input':>18}" for name in versions)
    print(header + ("   this/baseline" if args.baseline else ""))
    for work in WORKLOADS:
        if args.only and work.name != args.only:
            continue
        best = {name: math.inf for name in versions}
        for _ in range(args.repeat):  # interleaved, so a busy moment of the machine hits both alike
            for name, version in versions.items():
                spent, inputs = run(version, work, seed=1)
                best[name] = min(best[name], spent / inputs * 1e6)
        figures = list(best.values())
        line = f"{work.name:<18} " + " ".join(f"{f:>18.2f}" for f in figures)
        if args.baseline:
            line += f"   {figures[1] / figures[0]:>13.2f}"
        print(line + f"   ({work.what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
