"""The shapes ``EncoderEngine.prepare`` pads a batch to: bucket cells on CUDA, graphs or not (so eager
attention meets few distinct shapes), the batch's own shape on CPU. ``prepare`` touches no device, so a
``cuda`` device object serves here without a GPU (graphs off: their capture state needs one)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from coalesce.kernels.buckets import GraphOptions
from coalesce.kernels.encoder_runner import EncoderEngine

GRID = GraphOptions(enabled=False, batch_sizes=(1, 4, 16), seq_lens=(16, 64))


def _engine(device: str) -> EncoderEngine:
    model = cast(Any, None)  # never called by prepare or padded_cost
    return EncoderEngine(model, device=torch.device(device), max_tokens=128, pad_id=0, graphs=GRID)


def test_on_cuda_an_eager_batch_is_padded_to_its_cell() -> None:
    engine = _engine("cuda")
    prepared = engine.prepare([[5, 6, 7], [8] * 20, [9]])
    assert prepared.ids.shape == (4, 64) and prepared.cell == (4, 64)
    assert prepared.lengths.tolist() == [3, 20, 1, 0]  # the fourth row is all padding, dropped later
    assert (prepared.n, prepared.max_len) == (3, 20)
    assert prepared.ids[0, :4].tolist() == [5, 6, 7, 0] and int(prepared.ids[3].abs().sum()) == 0
    assert engine.padded_cost(3, 20) == 4 * 64  # what the batcher is told the batch costs
    assert engine.padded_shape(3, 20) == (4, 64)  # what a batch's trace span names as its cell


def test_on_cuda_a_batch_past_the_largest_bucket_keeps_its_rows_but_buckets_its_columns() -> None:
    engine = _engine("cuda")
    prepared = engine.prepare([[1] * 17] * 20)
    assert prepared.ids.shape == (20, 64) and prepared.cell is None
    assert engine.padded_shape(20, 17) == (20, 64)


def test_on_cpu_a_batch_runs_at_its_own_shape() -> None:
    engine = _engine("cpu")
    prepared = engine.prepare([[5, 6, 7], [8] * 20, [9]])
    assert prepared.ids.shape == (3, 20) and prepared.cell is None
    np.testing.assert_array_equal(prepared.lengths.numpy(), [3, 20, 1])
    assert engine.padded_cost(3, 20) == 60
    assert engine.padded_shape(3, 20) == (3, 20)
