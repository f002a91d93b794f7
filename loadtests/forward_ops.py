"""Where the CPU forward's time goes, per operator, float32 beside bfloat16 (the packaged model).

    python -m coalesce.loadtests.forward_ops [--rows 16] [--tokens 14] [--repeat 20] [--plain] [--eager]

Builds all-MiniLM-L6-v2's runner in float32 and in bfloat16, each on the tuned and on the plain CPU
forward (``--no-cpu-fast-forward``) — the graph-safe forward, or with ``--eager`` the eager
sentence-transformers runner — and on a ragged batch of ``--rows`` rows of at most ``--tokens`` tokens
prints each operator's self CPU time per forward (``torch.profiler``, ``--repeat`` forwards) of the
tuned forward (``--plain``: the plain one) in both precisions and their ratio — which parts bfloat16
speeds up on this CPU and which it does not — then the four runners' wall time per forward without the
profiler, the median of interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

ROUNDS = 7  # interleaved wall-time rounds per runner


def build_runner(dtype: str, *, eager: bool, tuned: bool) -> Any:
    """The packaged model's runner: eager sentence-transformers, or the graph-safe one; ``tuned``: the
    tuned CPU forward."""
    from coalesce.kernels.st_runner import SentenceTransformerRunner, default_model_path

    if eager:
        return SentenceTransformerRunner(default_model_path(), name=None, device="cpu", dtype=dtype,
                                         cpu_fast_forward=tuned)
    from coalesce.kernels.fastload import build_fast_encoder_runner

    runner = build_fast_encoder_runner(default_model_path(), name=None, device="cpu", dtype=dtype,
                                       cpu_fast_forward=tuned)
    assert runner is not None
    return runner


def ragged_lengths(rows: int, tokens: int, g: torch.Generator) -> list[int]:
    """``rows`` random lengths from a third of ``tokens`` to ``tokens`` (special tokens included), the
    first of them ``tokens``: a ragged batch like the service's."""
    lengths: list[int] = torch.randint(max(1, tokens // 3), tokens + 1, (rows,), generator=g).tolist()
    lengths[0] = tokens
    return lengths


def ragged_ids(lengths: Sequence[int], g: torch.Generator) -> list[list[int]]:
    """Random token ids for rows of ``lengths`` (room left for the two special tokens)."""
    return [torch.randint(1000, 20000, (max(0, n - 2),), generator=g).tolist() for n in lengths]


def _ops(runner: Any, prepared: Any, repeat: int) -> dict[str, float]:
    """Operator → self CPU ms per forward of ``runner.forward`` on ``prepared``, under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeat):
            runner.forward(prepared)
    return {e.key: e.self_cpu_time_total / 1e3 / repeat for e in prof.key_averages()}


def _wall(runner: Any, prepared: Any, repeat: int) -> float:
    """Wall ms per forward over ``repeat`` forwards, no profiler."""
    start = time.perf_counter()
    for _ in range(repeat):
        runner.forward(prepared)
    return (time.perf_counter() - start) / repeat * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.forward_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=14, help="longest row, special tokens included")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--plain", action="store_true",
                   help="show the plain forward's operators (--no-cpu-fast-forward); wall times show both")
    p.add_argument("--eager", action="store_true", help="the eager sentence-transformers runner")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    lengths = ragged_lengths(args.rows, args.tokens, g)
    shown = not args.plain  # the tuned forward's operators, or the plain one's
    runs: dict[tuple[str, bool], tuple[Any, Any]] = {}
    for dtype in ("float32", "bfloat16"):
        ids = ragged_ids(lengths, g)
        for tuned in (False, True):
            runner = build_runner(dtype, eager=args.eager, tuned=tuned)
            prepared = runner.prepare([runner.with_special_tokens(row) for row in ids])
            for _ in range(5):
                runner.forward(prepared)
            runs[(dtype, tuned)] = (runner, prepared)
    # Wall time: ROUNDS rounds, the four runners taking turns within each (the order reversed every other
    # round), the median round: on a shared VM one runner timed after another drifts with the machine.
    walls: dict[tuple[str, bool], list[float]] = {key: [] for key in runs}
    for r in range(ROUNDS):
        for key in runs if r % 2 == 0 else reversed(runs):
            walls[key].append(_wall(*runs[key], args.repeat))
    wall = {key: statistics.median(times) for key, times in walls.items()}
    f32, bf16 = (_ops(*runs[(d, shown)], args.repeat) for d in ("float32", "bfloat16"))
    print(f"{args.rows} rows x <= {args.tokens} tokens, {torch.get_num_threads()} threads, "
          f"{'eager sentence-transformers' if args.eager else 'graph-safe'} runner; self CPU ms per "
          f"forward of the {'tuned' if shown else 'plain'} CPU forward")
    print(f"{'operator':<52} {'float32':>9} {'bfloat16':>9} {'f32÷bf16':>9}")
    for op in sorted(set(f32) | set(bf16), key=lambda k: -max(f32.get(k, 0.0), bf16.get(k, 0.0)))[:12]:
        a, b = f32.get(op, 0.0), bf16.get(op, 0.0)
        print(f"{op[:52]:<52} {a:9.2f} {b:9.2f} {a / b if b else float('inf'):8.2f}×")
    a, b = sum(f32.values()), sum(bf16.values())
    print(f"{'all operators':<52} {a:9.2f} {b:9.2f} {a / b:8.2f}×")
    print(f"\nwall ms per forward, no profiler, median of {ROUNDS} interleaved rounds")
    print(f"{'forward':<52} {'float32':>9} {'bfloat16':>9} {'f32÷bf16':>9}")
    for tuned in (False, True):
        a, b = wall[("float32", tuned)], wall[("bfloat16", tuned)]
        name = "tuned (--cpu-fast-forward)" if tuned else "plain (--no-cpu-fast-forward)"
        print(f"{name:<52} {a:9.2f} {b:9.2f} {a / b:8.2f}×")
    a, b = (wall[(d, False)] / wall[(d, True)] for d in ("float32", "bfloat16"))
    print(f"{'plain ÷ tuned':<52} {a:8.2f}× {b:8.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
