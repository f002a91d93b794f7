"""What the CPU's cores give the forward two ways: one forward at a time on every core (torch's intra-op
threads, as the server runs it), or one single-thread forward per core side by side.

    python -m coalesce.loadtests.forward_lanes [--rows 1,4,16,32,64] [--tokens 24] [--dtype auto]
                                               [--busy 0,0.5] [--forwards 48] [--rounds 3]

The server hands every batch to one device thread, whose forward runs its operators on one OpenMP thread
per core: each operator is split across the cores and waits at its end for the slowest part. Small
operators split poorly (a MiniLM batch of a few short rows is many small matrix products), and a core
taken by anything else holds every operator back. The other way to use the cores is to run as many
forwards at once, each on one thread, none waiting for another. This measures both on the packaged
model's tuned CPU forward: batches per second for each batch size, beside another process that runs
Python for ``busy`` of every 2 ms (the event loop's share of a core), over ``--rounds`` rounds that
alternate the ways (a shared VM drifts). The engine runs forwards side by side with ``--cpu-forwards
N``; by default two on a 2-core machine whose forward is traced, else one (BENCHMARKS.md, 2026-12-06).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from coalesce.loadtests.lock_contention import PERIOD_S, busy_until


def batches_per_s(runner: Any, prepared: Any, lanes: int, threads: int, n: int) -> float:
    """``n`` forwards of ``prepared``, shared by ``lanes`` threads that each run theirs on ``threads``
    intra-op threads at once: batches per second of wall time."""
    import torch

    def lane(count: int) -> None:
        torch.set_num_threads(threads)  # (the calling thread's own count)
        for _ in range(count):
            runner.finish(runner.forward(prepared), prepared)

    workers = [threading.Thread(target=lane, args=(n // lanes,)) for _ in range(lanes)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return lanes * (n // lanes) / (time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.forward_lanes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,32,64", help="batch sizes, comma-separated")
    p.add_argument("--tokens", type=int, default=24, help="longest row, special tokens included")
    p.add_argument("--dtype", default="auto", help="the runner's dtype, as --dtype of coalesce serve")
    p.add_argument("--busy", default="0,0.5", help="the other process's busy shares, comma-separated")
    p.add_argument("--forwards", type=int, default=48, help="per batch size, busy share and way, per round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    from coalesce.loadtests.forward_ops import build_runner, ragged_ids, ragged_lengths

    cores = torch.get_num_threads()
    runner = build_runner(args.dtype, eager=False, tuned=True)
    ways = {"one forward, every core": (1, cores), f"{cores} forwards, one core each": (cores, 1),
            "one forward, one core": (1, 1)}
    ctx = multiprocessing.get_context("spawn")
    print(f"{cores} cores; the packaged model's tuned forward ({args.dtype}); ragged rows of <= "
          f"{args.tokens} tokens; median batches/s of {args.rounds} rounds of {args.forwards} forwards, "
          f"beside a process busy for a share of every {PERIOD_S * 1e3:g} ms")
    print(f"{'rows':>4} {'busy':>5} " + " ".join(f"{w:>28}" for w in ways)
          + f" {'side by side ÷ every core':>27}")
    for rows in (int(r) for r in args.rows.split(",")):
        g = torch.Generator().manual_seed(rows)
        prepared = runner.prepare([runner.with_special_tokens(row)
                                   for row in ragged_ids(ragged_lengths(rows, args.tokens, g), g)])
        for share in (float(b) for b in args.busy.split(",")):
            stop = ctx.Event()
            other = ctx.Process(target=busy_until, args=(share, stop)) if share > 0 else None
            if other is not None:
                other.start()
                time.sleep(0.5)
            rates: dict[str, list[float]] = {w: [] for w in ways}
            try:
                for r in range(args.rounds):
                    for way in ways if r % 2 == 0 else reversed(ways):
                        batches_per_s(runner, prepared, *ways[way], n=ways[way][0] * 2)  # (warm)
                        rates[way].append(batches_per_s(runner, prepared, *ways[way], n=args.forwards))
            finally:
                stop.set()
                if other is not None:
                    other.join()
            med = {w: statistics.median(v) for w, v in rates.items()}
            first, second = list(ways)[:2]
            print(f"{rows:4d} {share:5.2f} " + " ".join(f"{med[w]:28.1f}" for w in ways)
                  + f" {med[second] / med[first]:26.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
