"""The CPU forward on each allocator the server can run on: wall time, page faults and system time per batch.

    python -m coalesce.loadtests.alloc_forward [--rows 64] [--batches 20] [--rounds 3]

Runs the packaged model's runner, as the engine builds it, over batches of ``--rows`` distinct chunks of
20 to 60 words (the burst's, ``loadtests/burst.py``), in a fresh process per allocator and round, the
allocators taking turns (the order reversed every other round) and the median round shown:

- ``glibc``: nothing preloaded;
- ``jemalloc, decay 1 s``: jemalloc with our ``MALLOC_CONF`` (``service/reexec.py``) and no engine
  controls, as the engine ran before it kept freed pages;
- ``jemalloc, kept + purge``: the same, plus what the engine does now (``allocator.Trimmer.for_process``:
  no dirty-page decay, every arena purged every 10 s while batches run and once after).

Each process warms with three batches, then times ``--batches`` forwards (tokenised beforehand, the
embeddings taken to numpy as the engine does); it reports wall ms, minor page faults and system CPU ms per
batch, and its resident memory after the last batch and once more after a purge has had time to run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from coalesce.service.allocator import TRIM_EVERY_S, find_jemalloc
from coalesce.service.reexec import JEMALLOC_CONF

MODES = ("glibc", "jemalloc, decay 1 s", "jemalloc, kept + purge")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(mode: str, rows: int, batches: int, seed: int) -> dict[str, Any]:
    """One process's measurement (runs in the child)."""
    from coalesce.kernels.fastload import build_fast_encoder_runner
    from coalesce.kernels.st_runner import default_model_path
    from coalesce.loadtests.burst import chunks
    from coalesce.service.allocator import Trimmer

    trimmer = Trimmer.for_process("auto") if mode == MODES[2] else None
    if mode == MODES[2] and trimmer is None:
        raise SystemExit("no jemalloc controls in this process")
    runner = build_fast_encoder_runner(default_model_path(), name=None, device="cpu", dtype="float32",
                                       cpu_fast_forward=True)
    assert runner is not None
    texts = chunks(rows * (batches + 3), seed)
    ids = [runner.with_special_tokens(row) for row in runner.tokenize(texts)]
    prepared = [runner.prepare(ids[i:i + rows]) for i in range(0, len(ids), rows)]

    def run(p: Any) -> None:
        runner.finish(runner.forward(p), p)
        if trimmer is not None:
            trimmer.batch_done()

    for p in prepared[:3]:
        run(p)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for p in prepared[3:]:
        run(p)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    rss_loaded = _rss_mib()
    time.sleep(TRIM_EVERY_S + 2 if trimmer is not None else 2)  # the trimmer's purge after the last batch
    out = {
        "ms": wall / batches * 1e3,
        "faults": (r1.ru_minflt - r0.ru_minflt) / batches,
        "sys_ms": (r1.ru_stime - r0.ru_stime) / batches * 1e3,
        "rss_loaded": rss_loaded,
        "rss_idle": _rss_mib(),
    }
    if trimmer is not None:
        trimmer.close()
    return out


def _env(mode: str, jemalloc: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    if mode != "glibc":
        env.update(LD_PRELOAD=jemalloc, MALLOC_CONF=JEMALLOC_CONF)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.alloc_forward", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.rows, args.batches, args.seed)))
        return 0
    jemalloc = find_jemalloc()
    if jemalloc is None:
        print("jemalloc is not installed (Debian/Ubuntu: libjemalloc2)", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
            cmd = [sys.executable, "-m", "coalesce.loadtests.alloc_forward", "--child", mode, "--rows",
                   str(args.rows), "--batches", str(args.batches), "--seed", str(r + 1)]
            done = subprocess.run(cmd, env=_env(mode, jemalloc), capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {mode: sorted(rs, key=lambda x: x["ms"])[len(rs) // 2] for mode, rs in runs.items()}
    base = median[MODES[1]]["ms"]
    print(f"{args.rows} chunks of 20-60 words a batch, {args.batches} batches a process, median of "
          f"{args.rounds} interleaved rounds (by wall time), {os.cpu_count()} cores\n")
    print("| allocator | ms per batch | ÷ jemalloc, decay 1 s | minor faults per batch | system CPU ms per "
          "batch | resident MiB after the batches | resident MiB idle after |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        m = median[mode]
        print(f"| {mode} | {m['ms']:.1f} | {m['ms'] / base:.2f}× | {m['faults']:,.0f} | {m['sys_ms']:.1f} | "
              f"{m['rss_loaded']:.0f} | {m['rss_idle']:.0f} |")
    spread = {mode: [round(x["ms"], 1) for x in rs] for mode, rs in runs.items()}
    ratios = [a["ms"] / b["ms"] for a, b in zip(runs[MODES[2]], runs[MODES[1]], strict=True)]
    print(f"\nevery round's ms per batch: {json.dumps(spread)}; median of the ratios by round "
          f"(kept + purge ÷ decay 1 s): {statistics.median(ratios):.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
