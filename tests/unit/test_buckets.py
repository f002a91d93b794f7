"""The bucket grid: which cell a batch lands in, what it costs, and how it is padded."""

from __future__ import annotations

import numpy as np
import pytest
from coalesce.kernels.buckets import (
    DEFAULT_BATCH_SIZES,
    BucketGrid,
    batch_buckets,
    bucket,
    capture_order,
    pad_to_shape,
    parse_sizes,
    seq_buckets,
)


def test_parse_sizes_sorts_and_dedups() -> None:
    assert parse_sizes("8, 1,2,2,4") == (1, 2, 4, 8)


@pytest.mark.parametrize("text", ["", "0,1", "-4", "a,b", "1.5"])
def test_parse_sizes_rejects_bad_values(text: str) -> None:
    with pytest.raises(ValueError):
        parse_sizes(text)


def test_default_seq_buckets_are_capped_at_the_model_max() -> None:
    assert seq_buckets(256) == (16, 32, 64, 128, 256)
    assert seq_buckets(512) == (16, 32, 64, 128, 256, 512)


def test_model_max_is_always_the_last_seq_bucket() -> None:
    assert seq_buckets(384) == (16, 32, 64, 128, 256, 384)
    assert seq_buckets(100, [8, 1000]) == (8, 100)
    assert seq_buckets(10) == (10,)


def test_bad_buckets_are_rejected() -> None:
    with pytest.raises(ValueError):
        seq_buckets(0)
    with pytest.raises(ValueError):
        seq_buckets(64, [0, 16])
    with pytest.raises(ValueError):
        batch_buckets([0, 4])
    with pytest.raises(ValueError):
        batch_buckets([])


def test_bucket_is_the_smallest_size_that_fits() -> None:
    sizes = (1, 2, 4, 8)
    assert [bucket(v, sizes) for v in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_every_batch_lands_in_the_smallest_cell_that_holds_it() -> None:
    grid = BucketGrid.build(256, batch_sizes=(1, 4, 16), seq_lens=(16, 64))
    assert grid.seq_lens == (16, 64, 256)
    for n in range(1, 17):
        for length in range(1, 257):
            fits = [(b, s) for b, s in grid.cells() if b >= n and s >= length]
            smallest = min(fits, key=lambda c: (c[0], c[1]))
            assert grid.cell(n, length) == smallest
            assert grid.padded_shape(n, length) == smallest
            assert grid.padded_cost(n, length) == smallest[0] * smallest[1] >= n * length


def test_batches_past_the_largest_batch_bucket_are_outside_the_grid() -> None:
    grid = BucketGrid.build(128, batch_sizes=(1, 8), seq_lens=(32,))
    assert grid.cell(9, 20) is None
    assert grid.padded_shape(9, 20) == (9, 32)  # eager rows, still a sequence bucket
    assert grid.padded_cost(9, 20) == 9 * 32


def test_padded_cost_is_monotonic_so_the_batcher_can_bisect_it() -> None:
    grid = BucketGrid.build(256)
    for length in (1, 15, 16, 17, 100, 256):
        costs = [grid.padded_cost(n, length) for n in range(1, 300)]
        assert costs == sorted(costs)
    for n in (1, 3, 64, 257):
        costs = [grid.padded_cost(n, length) for length in range(1, 257)]
        assert costs == sorted(costs)


def test_lengths_past_the_model_max_are_a_bug() -> None:
    grid = BucketGrid.build(256)
    with pytest.raises(ValueError):
        grid.cell(1, 257)
    with pytest.raises(ValueError):
        grid.padded_cost(0, 10)


def test_default_grid() -> None:
    grid = BucketGrid.build(512)
    assert grid.batch_sizes == DEFAULT_BATCH_SIZES
    assert len(grid.cells()) == len(DEFAULT_BATCH_SIZES) * 6


def test_capture_order_is_largest_first_then_smallest_first() -> None:
    cells = BucketGrid.build(64, batch_sizes=(1, 2, 4), seq_lens=(16, 32)).cells()
    order = capture_order(cells)
    assert sorted(order) == sorted(cells)
    assert order[0] == (4, 64)
    areas = [b * s for b, s in order[1:]]
    assert areas == sorted(areas)


def test_pad_to_shape_keeps_real_rows_and_pads_the_rest() -> None:
    batch = [[101, 7, 8, 102], [101, 9, 102], [5]]
    ids, lengths = pad_to_shape(batch, rows=4, cols=6, pad_id=0)
    assert ids.dtype == np.int64 and lengths.dtype == np.int64
    assert ids.shape == (4, 6)
    assert lengths.tolist() == [4, 3, 1, 0]
    assert ids.tolist() == [
        [101, 7, 8, 102, 0, 0],
        [101, 9, 102, 0, 0, 0],
        [5, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],  # a fully padded row
    ]


def test_pad_to_shape_uses_the_pad_id() -> None:
    ids, _ = pad_to_shape([[1, 2]], rows=2, cols=3, pad_id=99)
    assert ids.tolist() == [[1, 2, 99], [99, 99, 99]]


@pytest.mark.parametrize(
    ("batch", "rows", "cols"),
    [([], 1, 4), ([[1], [2]], 1, 4), ([[1, 2, 3]], 1, 2), ([[1], []], 2, 4)],
)
def test_pad_to_shape_rejects_what_does_not_fit(batch: list[list[int]], rows: int, cols: int) -> None:
    with pytest.raises(ValueError):
        pad_to_shape(batch, rows, cols, pad_id=0)
