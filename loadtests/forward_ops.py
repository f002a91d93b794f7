"""Where the CPU forward's time goes, per operator, float32 beside bfloat16 (the packaged model).

    python -m coalesce.loadtests.forward_ops [--rows 16] [--tokens 14] [--repeat 20] [--plain]

Builds all-MiniLM-L6-v2 on the graph-safe forward in float32 and in bfloat16 (the tuned CPU forward
unless ``--plain``), runs ``--repeat`` forwards of a ragged batch of ``--rows`` rows of at most
``--tokens`` tokens under ``torch.profiler``, and prints each operator's self CPU time per forward in
both precisions and their ratio: which parts bfloat16 speeds up on this CPU and which it does not.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch


def _profile(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor,
             repeat: int) -> tuple[dict[str, float], float]:
    """(operator → self CPU ms per forward, wall ms per forward)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(5):
            model(ids, lengths)
        start = time.perf_counter()
        for _ in range(repeat):
            model(ids, lengths)
        wall = (time.perf_counter() - start) / repeat * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeat):
                model(ids, lengths)
    ops = {e.key: e.self_cpu_time_total / 1e3 / repeat for e in prof.key_averages()}
    return ops, wall


def main(argv: Sequence[str] | None = None) -> int:
    from coalesce.kernels.fastload import build_fast_encoder_runner
    from coalesce.kernels.st_runner import default_model_path

    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.forward_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=14)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--plain", action="store_true", help="the plain forward (--no-cpu-fast-forward)")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (args.rows, args.tokens), generator=g)
    lengths = torch.randint(max(1, args.tokens // 3), args.tokens + 1, (args.rows,), generator=g)
    lengths[0] = args.tokens
    measured = {}
    for dtype in ("float32", "bfloat16"):
        runner = build_fast_encoder_runner(default_model_path(), name=None, device="cpu", dtype=dtype,
                                           cpu_fast_forward=not args.plain)
        assert runner is not None
        measured[dtype] = _profile(runner.model, ids, lengths, args.repeat)
    (f32, f32_wall), (bf16, bf16_wall) = measured["float32"], measured["bfloat16"]
    print(f"{args.rows} rows x <= {args.tokens} tokens, {torch.get_num_threads()} threads, "
          f"{'plain' if args.plain else 'tuned'} CPU forward; self CPU ms per forward")
    print(f"{'operator':<52} {'float32':>9} {'bfloat16':>9} {'f32÷bf16':>9}")
    for op in sorted(set(f32) | set(bf16), key=lambda k: -max(f32.get(k, 0.0), bf16.get(k, 0.0)))[:12]:
        a, b = f32.get(op, 0.0), bf16.get(op, 0.0)
        print(f"{op[:52]:<52} {a:9.2f} {b:9.2f} {a / b if b else float('inf'):8.2f}×")
    a, b = sum(f32.values()), sum(bf16.values())
    print(f"{'all operators':<52} {a:9.2f} {b:9.2f} {a / b:8.2f}×")
    wall = "wall ms per forward (no profiler)"
    print(f"{wall:<52} {f32_wall:9.2f} {bf16_wall:9.2f} {f32_wall / bf16_wall:8.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
