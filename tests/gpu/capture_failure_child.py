"""Run in a process of its own by ``test_cuda_graphs``: a CUDA graph capture that fails inside (a host
sync while capturing, after two cells were captured) must leave the process as healthy as before.

Prints ``healthy`` and exits 0, or exits 1 naming the first thing found wrong.
"""

from __future__ import annotations

import random
import sys

import torch
from coalesce.kernels.bert import GraphSafeBert
from coalesce.kernels.buckets import GraphOptions
from coalesce.kernels.encoder_runner import EncoderEngine
from coalesce.kernels.graphs import pool_usage
from coalesce.loadtests.gpu.check import hf_embed, load_config, random_bert

CUDA = torch.device("cuda")


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"not healthy: {what}", flush=True)
        raise SystemExit(1)


def main() -> int:
    hf = random_bert(load_config(None)).to(CUDA)
    model = GraphSafeBert.from_hf(hf, pooling="mean", normalize=True).to(CUDA)
    options = GraphOptions(batch_sizes=(1, 4), seq_lens=(64,))
    engine = EncoderEngine(model, device=CUDA, max_tokens=128, pad_id=0, graphs=options)
    graphs = engine._graphs
    assert graphs is not None
    captures = 0

    def breaks_the_third_capture(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        nonlocal captures
        if torch.cuda.is_current_stream_capturing():
            captures += 1
            if captures == 3:
                lengths.max().item()  # legal eagerly; inside a capture it invalidates it and raises
        return model(ids, lengths)

    graphs._forward = breaks_the_third_capture
    pool = graphs._pool
    engine.warmup()  # must not raise

    stats = engine.capture_stats
    check(captures == 3, f"expected the third capture to be the failing one, saw {captures}")
    check((stats.capture_failures, stats.cells_captured) == (1, 0), f"stats {stats}")
    check(torch.cuda.current_stream() == torch.cuda.default_stream(), "the current stream was not restored")
    with torch.cuda.stream(graphs._stream):
        check(not torch.cuda.is_current_stream_capturing(), "the capture stream is still capturing")
    check(torch.cuda.get_sync_debug_mode() == 0, "the sync debug mode was not restored")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch < 2.8 asserts here while the allocator believes in a capture
    check(pool_usage(pool).reserved == 0, f"the pool still holds {pool_usage(pool).reserved} bytes")

    rng = random.Random(0)
    batch = [[rng.randrange(1000, 30000) for _ in range(rng.randint(1, 64))] for _ in range(3)]
    ids = torch.zeros(3, 64, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(batch):
        ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
    with torch.inference_mode():
        reference = hf_embed(hf, ids.to(CUDA), mask.to(CUDA)).cpu()

    def cosine(engine: EncoderEngine) -> float:
        prepared = engine.prepare(batch)
        got = torch.from_numpy(engine.finish(engine.forward(prepared), prepared))
        return float(torch.nn.functional.cosine_similarity(got, reference, dim=-1).min())

    check(cosine(engine) >= 0.99999, "the eager forward after the failure is wrong")
    check(stats.eager_runs == 1 and stats.graph_replays == 0, f"stats {stats}")

    fresh = EncoderEngine(model, device=CUDA, max_tokens=128, pad_id=0, graphs=options)
    fresh.warmup()
    check((fresh.capture_stats.cells_captured, fresh.capture_stats.capture_failures) == (4, 0),
          f"a new model's capture after the failure: {fresh.capture_stats}")
    check(cosine(fresh) >= 0.99999, "a graph captured after the failure replays wrong")
    check(fresh.capture_stats.graph_replays == 1, f"stats {fresh.capture_stats}")
    torch.cuda.synchronize()
    print("healthy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
