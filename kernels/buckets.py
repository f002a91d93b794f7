"""The (batch × sequence) bucket grid: pure functions on plain numbers, no torch.

A CUDA graph runs one fixed shape, so a batch of ``n`` sequences whose longest is ``max_len`` tokens
runs in the smallest captured *cell* ``(rows, cols)`` with ``rows >= n`` and ``cols >= max_len``,
padded up to it. The padded size ``rows × cols`` is what the batch costs, so it is also the cost the
batcher should see. Batches with more rows than the largest batch bucket are outside the grid; they
run eagerly at ``n`` rows, still padded to a sequence bucket.

The sequence axis always ends at the model's maximum length, so every valid sequence has a bucket.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


@dataclass(frozen=True, slots=True)
class GraphOptions:
    """How CUDA graphs are used. Ignored on CPU."""

    enabled: bool = True
    batch_sizes: tuple[int, ...] | None = None  # None = DEFAULT_BATCH_SIZES
    seq_lens: tuple[int, ...] | None = None  # None = DEFAULT_SEQ_LENS, capped at max tokens
    budget_s: float = 20.0  # start-up capture time; cells not reached are left to lazy capture
    budget_bytes: int = 2 << 30  # device memory the graphs may hold
    lazy: bool = True  # capture a cell on its first batch when start-up did not reach it


DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SEQ_LENS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)

Cell = tuple[int, int]  # (rows, cols) = (batch bucket, sequence bucket)


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse a flag value such as ``"1,2,4,8"`` into sorted, distinct positive sizes."""
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def seq_buckets(max_tokens: int, seq_lens: Iterable[int] | None = None) -> tuple[int, ...]:
    """Sequence buckets capped at ``max_tokens``, with ``max_tokens`` itself always the last bucket."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    chosen = DEFAULT_SEQ_LENS if seq_lens is None else tuple(seq_lens)
    if any(s < 1 for s in chosen):
        raise ValueError(f"sequence buckets must be positive, got {chosen}")
    return tuple(sorted({s for s in chosen if s < max_tokens} | {max_tokens}))


def batch_buckets(batch_sizes: Iterable[int] | None = None) -> tuple[int, ...]:
    """Batch buckets, sorted and distinct."""
    chosen = tuple(sorted(set(DEFAULT_BATCH_SIZES if batch_sizes is None else batch_sizes)))
    if not chosen or chosen[0] < 1:
        raise ValueError(f"batch buckets must be positive, got {chosen}")
    return chosen


def bucket(value: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the sorted ``sizes`` that is ``>= value``; None when ``value`` is above all."""
    i = bisect.bisect_left(sizes, value)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True, slots=True)
class BucketGrid:
    """Batch and sequence buckets; build it with ``BucketGrid.build``."""

    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]

    @classmethod
    def build(
        cls,
        max_tokens: int,
        batch_sizes: Iterable[int] | None = None,
        seq_lens: Iterable[int] | None = None,
    ) -> BucketGrid:
        """A grid over the given (or default) sizes, its sequence axis capped at ``max_tokens``."""
        return cls(batch_buckets(batch_sizes), seq_buckets(max_tokens, seq_lens))

    @property
    def max_tokens(self) -> int:
        return self.seq_lens[-1]

    def cells(self) -> list[Cell]:
        """Every cell of the grid."""
        return [(b, s) for b in self.batch_sizes for s in self.seq_lens]

    def cell(self, n: int, max_len: int) -> Cell | None:
        """The cell a batch of ``n`` sequences (longest ``max_len``) runs in, or None if outside."""
        _check_batch(n, max_len, self.max_tokens)
        rows = bucket(n, self.batch_sizes)
        cols = bucket(max_len, self.seq_lens)
        return None if rows is None or cols is None else (rows, cols)

    def padded_shape(self, n: int, max_len: int) -> Cell:
        """The shape the batch is padded to: its cell, or ``n`` rows × a sequence bucket outside the grid."""
        _check_batch(n, max_len, self.max_tokens)
        rows = bucket(n, self.batch_sizes) or n
        cols = bucket(max_len, self.seq_lens)
        assert cols is not None  # the last sequence bucket is max_tokens, checked above
        return rows, cols

    def padded_cost(self, n: int, max_len: int) -> int:
        """Padded tokens the batch costs: the area of ``padded_shape``."""
        rows, cols = self.padded_shape(n, max_len)
        return rows * cols


def capture_order(cells: Iterable[Cell]) -> list[Cell]:
    """The order to capture graphs in: the largest cell first, then the rest smallest first.

    The largest cell first sets the shared memory pool's high-water mark once; every later capture
    reuses its blocks. The rest go smallest first because a time or memory budget cuts the tail, and
    small cells are the launch-bound ones where a graph pays most; big cells lose little run eagerly.
    """
    ordered = sorted(set(cells), key=lambda c: (c[0] * c[1], c))
    return ordered[-1:] + ordered[:-1]


def pad_to_shape(
    batch: Sequence[Sequence[int]], rows: int, cols: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad ``batch`` into ``ids`` (rows, cols) int64 and ``lengths`` (rows,) int64.

    Rows past ``len(batch)`` are fully padded: all ``pad_id``, length 0.
    """
    n = len(batch)
    if n == 0:
        raise ValueError("empty batch")
    if n > rows:
        raise ValueError(f"{n} sequences do not fit {rows} rows")
    lengths = np.zeros(rows, dtype=np.int64)
    lengths[:n] = [len(seq) for seq in batch]
    if lengths[:n].min() < 1:
        raise ValueError("empty sequence in batch")
    if lengths.max() > cols:
        raise ValueError(f"a sequence of {lengths.max()} tokens does not fit {cols} columns")
    ids = np.full((rows, cols), pad_id, dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(batch), dtype=np.int64, count=int(lengths.sum()))
    ids[np.arange(cols) < lengths[:, None]] = flat  # boolean assignment fills row-major, row by row
    return ids, lengths


def _check_batch(n: int, max_len: int, max_tokens: int) -> None:
    if n < 1 or max_len < 1:
        raise ValueError(f"a batch needs n >= 1 and max_len >= 1, got n={n}, max_len={max_len}")
    if max_len > max_tokens:
        raise ValueError(f"max_len {max_len} exceeds the model's {max_tokens} tokens")
