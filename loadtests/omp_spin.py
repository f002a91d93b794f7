"""What the forward's OpenMP threads cost beside other work, by how long they spin (``GOMP_SPINCOUNT``).

    python -m coalesce.loadtests.omp_spin [--spin-counts default,3000] [--rows 1,64] [--busy 0,0.5,0.9]
                                          [--gap-ms 5] [--forwards 12] [--rounds 2]

torch's CPU operators run on OpenMP threads (libgomp, as torch's wheels ship it). Between two parallel
operators, and after the last one of a forward, libgomp's threads spin waiting for the next, 300,000
times by default (milliseconds) before they sleep. In the server the forward's thread shares the cores
with the event loop (which reads, answers and, under overload, refuses every request), the tokenizer's
thread and, on a machine of two cores, anything else the host runs: the spin takes their CPU, and a
spinning thread that the kernel takes off its core holds every later operator of the forward back. This
measures what bounding the spin costs and gives. The server leaves libgomp's default: bounded, a lone
one-row forward ran slower, alone and beside a busy process (BENCHMARKS.md, 2026-12-06).

Each spin count runs in a process of its own (libgomp reads the variable once, when torch loads it),
``default`` leaving libgomp's. Each runs the packaged model's tuned forward on a ragged batch of each
``--rows`` (rows of at most ``--tokens`` tokens), ``--gap-ms`` apart (the event loop's turn between two
batches), beside another process that runs for ``busy`` of every 2 ms and sleeps the rest; it prints the
median forward and the forward's process's CPU per forward (its spin included), over ``--rounds`` rounds
that alternate the spin counts (a shared VM drifts).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from coalesce.loadtests.lock_contention import PERIOD_S, busy_until

LIBGOMP_SPIN = "GOMP_SPINCOUNT"


def measure(rows: Sequence[int], tokens: int, busy: Sequence[float], gap_s: float, n: int
            ) -> list[dict[str, float]]:
    """In this process: per (rows, busy share), the median forward (ms) and this process's CPU per
    forward (ms), ``n`` forwards ``gap_s`` apart beside a process busy for that share."""
    from coalesce.loadtests.lock_contention import prepared_batch

    runner = None
    out = []
    ctx = multiprocessing.get_context("spawn")
    for r in rows:
        runner, prepared = prepared_batch(r, tokens, runner)
        for share in busy:
            stop = ctx.Event()
            other = ctx.Process(target=busy_until, args=(share, stop)) if share > 0 else None
            if other is not None:
                other.start()
                time.sleep(0.3)
            times = []
            cpu0 = time.process_time()
            for _ in range(n):
                t0 = time.perf_counter()
                runner.forward(prepared)
                times.append(time.perf_counter() - t0)
                time.sleep(gap_s)  # (the spin after a forward is charged to it: nothing else runs here)
            cpu = time.process_time() - cpu0
            stop.set()
            if other is not None:
                other.join()
            out.append({"rows": r, "busy": share, "forward_ms": statistics.median(times) * 1e3,
                        "cpu_ms": cpu / n * 1e3})
    return out


def _child(spin: str, args: argparse.Namespace) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k not in (LIBGOMP_SPIN, "OMP_WAIT_POLICY")}
    if spin != "default":
        env[LIBGOMP_SPIN] = spin
    cmd = [sys.executable, "-m", "coalesce.loadtests.omp_spin", "--child", "--rows", args.rows,
           "--tokens", str(args.tokens), "--busy", args.busy, "--gap-ms", str(args.gap_ms),
           "--forwards", str(args.forwards)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=900)
    result: list[dict[str, float]] = json.loads(done.stdout.splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.omp_spin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spin-counts", default="default,3000",
                   help="comma-separated; the first is what the others are compared with")
    p.add_argument("--rows", default="1,64", help="batch sizes, comma-separated")
    p.add_argument("--tokens", type=int, default=14, help="longest row, special tokens included")
    p.add_argument("--busy", default="0,0.5,0.9", help="the other process's busy shares, comma-separated")
    p.add_argument("--gap-ms", type=float, default=5.0, help="between two forwards")
    p.add_argument("--forwards", type=int, default=12, help="per batch size and busy share, per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    busy = [float(b) for b in args.busy.split(",")]
    if args.child:
        print(json.dumps(measure(rows, args.tokens, busy, args.gap_ms / 1e3, args.forwards)))
        return 0
    spins = args.spin_counts.split(",")
    runs: dict[str, list[list[dict[str, float]]]] = {s: [] for s in spins}
    for r in range(args.rounds):
        for spin in spins if r % 2 == 0 else reversed(spins):
            runs[spin].append(_child(spin, args))
    print(f"rows of <= {args.tokens} tokens, forwards {args.gap_ms:g} ms apart, beside a process busy "
          f"for a share of every {PERIOD_S * 1e3:g} ms; median forward ms and the forward process's CPU "
          f"ms per forward, over {args.rounds} rounds of {args.forwards}")
    print(f"{'rows':>4} {'busy':>5} " + " ".join(f"{'spin ' + s:>22}" for s in spins)
          + "   " + " ".join(f"{'forward ' + s + ' ÷ ' + spins[0]:>24}" for s in spins[1:]))
    for i, cell in enumerate(runs[spins[0]][0]):
        fwd = [statistics.median(run[i]["forward_ms"] for run in runs[s]) for s in spins]
        cpu = [statistics.median(run[i]["cpu_ms"] for run in runs[s]) for s in spins]
        print(f"{int(cell['rows']):4d} {cell['busy']:5.2f} "
              + " ".join(f"{f:9.1f} ms, {c:6.1f} cpu" for f, c in zip(fwd, cpu, strict=True))
              + "   " + " ".join(f"{f / fwd[0]:23.2f}×" for f in fwd[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
