"""CUDA graph capture and replay of one encoder forward over the cells of a bucket grid.

Each cell ``(rows, cols)`` gets a ``torch.cuda.CUDAGraph`` with static input buffers (ids, lengths)
and a static output buffer. All graphs share one memory pool and are captured largest first (see
``buckets.capture_order``), each after a warm-up on a side stream. Replay copies a padded batch into
the cell's static inputs, replays, and clones the real rows out, so the next replay of the same cell
cannot overwrite a result nobody has read yet.

Capture is a cold-start cost, bounded two ways: a time budget (cells not reached are captured lazily on
first use if ``lazy`` is set, else they run eagerly) and a memory budget on the pool's growth (a cell
that would exceed it runs eagerly). Everything here runs on the model thread only: it owns the device,
the graphs and the pool. ``CaptureStats`` is written by that thread and read by the metrics exporter.

A capture that fails (an operation the forward uses turns out not to be capturable on this device or
version) must not take the service down: it is logged with its traceback, graphs are switched off for
the model, and every batch runs the same forward eagerly from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .buckets import Cell, capture_order

log = logging.getLogger("coalesce.kernels")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids (B, S), lengths (B,)) -> (B, dim)


@dataclass(slots=True)
class CaptureStats:
    """Counters about graph capture and use; plain attributes for the metrics exporter."""

    seconds: float = 0.0  # wall time spent warming up and capturing, start-up and lazy together
    bytes: int = 0  # device memory the graphs hold (pool growth plus static buffers)
    cells_planned: int = 0  # cells of the grid
    cells_captured: int = 0
    cells_over_memory: int = 0  # cells left eager because the memory budget would be exceeded
    capture_failures: int = 0  # captures that raised; the first one switches graphs off
    lazy_captures: int = 0  # cells captured on first use after start-up
    graph_replays: int = 0  # batches served by a graph
    eager_runs: int = 0  # batches served by the eager forward (outside the grid, or not captured)


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    lengths: torch.Tensor
    out: torch.Tensor


class CudaGraphs:
    """Graphs of ``forward`` per cell, sharing one memory pool. Model thread only."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        *,
        pad_id: int,
        budget_s: float,
        budget_bytes: int,
        lazy: bool,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self._forward = forward
        self._device = device
        self._pad_id = pad_id
        self._budget_s = budget_s
        self._budget_bytes = budget_bytes
        self._lazy = lazy
        self._pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture run on this stream of the model's device (torch.cuda.graph's default
        # capture stream belongs to whichever device was current when it was first made).
        self._stream = torch.cuda.Stream(device)
        self._graphs: dict[Cell, _Captured] = {}
        self._refused: set[Cell] = set()  # over the memory budget: never retried
        self._failed = False  # a capture raised: graphs are off for this model
        self.stats = CaptureStats()

    def capture_grid(self, cells: Iterable[Cell]) -> None:
        """Capture ``cells`` within the time and memory budgets (start-up, on the model thread)."""
        ordered = capture_order(cells)
        self.stats.cells_planned = len(ordered)
        start = time.perf_counter()
        for i, cell in enumerate(ordered):
            if time.perf_counter() - start >= self._budget_s:
                what = "captured on first use" if self._lazy else "run eagerly"
                log.info(
                    "graph capture stopped by its %.1f s budget; %d of %d cells will be %s",
                    self._budget_s, len(ordered) - i, len(ordered), what,
                )
                break
            if self._try_capture(cell) is None and self._failed:
                break
        log.info(
            "captured %d of %d CUDA graphs in %.2f s, %.1f MiB",
            self.stats.cells_captured, len(ordered), self.stats.seconds, self.stats.bytes / 2**20,
        )

    def run(self, cell: Cell, ids: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor | None:
        """Replay the graph of ``cell`` on host tensors padded to it; the first ``n`` output rows.

        None when the cell has no graph (and lazy capture is off or refused): run eagerly instead.
        """
        captured = self._graphs.get(cell)
        if captured is None and self._lazy and not self._failed and cell not in self._refused:
            captured = self._try_capture(cell)
            if captured is not None:
                self.stats.lazy_captures += 1
        if captured is None:
            return None
        captured.ids.copy_(ids, non_blocking=True)
        captured.lengths.copy_(lengths, non_blocking=True)
        captured.graph.replay()
        self.stats.graph_replays += 1
        return captured.out[:n].clone()

    def _try_capture(self, cell: Cell) -> _Captured | None:
        """``_capture``, except that a failure switches graphs off (logged) instead of raising."""
        try:
            with torch.cuda.device(self._device):
                return self._capture(cell)
        except Exception:
            self._failed = True
            self._graphs.clear()  # a failure mid-capture may have left the shared pool inconsistent
            self.stats.cells_captured = 0
            self.stats.bytes = 0
            self.stats.capture_failures += 1
            log.exception("CUDA graph capture of cell %s failed; graphs are off, batches run eagerly", cell)
            torch.cuda.synchronize(self._device)  # let the eager forward start from a settled device
            torch.cuda.empty_cache()  # the dropped graphs' pool
            return None

    def _capture(self, cell: Cell) -> _Captured | None:
        """Warm up and capture one cell; None if the memory budget refuses it."""
        started = time.perf_counter()
        rows, cols = cell
        dev = self._device
        torch.cuda.empty_cache()  # so the growth measured below is this graph's and nothing else's
        reserved_before = torch.cuda.memory_reserved(dev)
        ids = torch.full((rows, cols), self._pad_id, dtype=torch.int64, device=dev)
        lengths = torch.full((rows,), cols, dtype=torch.int64, device=dev)
        torch.cuda.reset_peak_memory_stats(dev)
        allocated_before = torch.cuda.memory_allocated(dev)

        side = self._stream
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2 if not self._graphs else 1):
                self._forward(ids, lengths)
        torch.cuda.current_stream(dev).wait_stream(side)

        # The pool reuses its free blocks across graphs, so a cell needs new memory only where its peak
        # exceeds what the pool already holds.
        peak = torch.cuda.max_memory_allocated(dev) - allocated_before
        needed = max(0, peak - self.stats.bytes)
        if self.stats.bytes + needed > self._budget_bytes:
            self._refused.add(cell)
            self.stats.cells_over_memory += 1
            torch.cuda.empty_cache()
            self.stats.seconds += time.perf_counter() - started
            log.info("graph cell %s left eager: ~%d MiB would exceed the memory budget", cell, needed >> 20)
            return None

        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls the prep thread may make meanwhile are not this capture's business.
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            out = self._forward(ids, lengths)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        captured = _Captured(graph, ids, lengths, out)
        self._graphs[cell] = captured
        self.stats.bytes += max(0, torch.cuda.memory_reserved(dev) - reserved_before)
        self.stats.cells_captured += 1
        self.stats.seconds += time.perf_counter() - started
        return captured
