"""CUDA graph capture and replay of one encoder forward over the cells of a bucket grid.

Each cell ``(rows, cols)`` gets a ``torch.cuda.CUDAGraph`` with static input buffers (ids, lengths)
and a static output buffer. All graphs share one memory pool and are captured largest first (see
``buckets.capture_order``), each after a warm-up on a side stream. Replay copies a padded batch into
the cell's static inputs, replays, and clones the real rows out, so the next replay of the same cell
cannot overwrite a result nobody has read yet.

Capture is a cold-start cost, bounded two ways: a time budget (cells not reached are captured lazily on
first use if ``lazy`` is set, else they run eagerly) and a memory budget on what the graphs hold (their
pool's segments, read from the allocator, plus their static inputs): a cell whose warm-up shows it
would need more is left eager, and a capture that grew the pool past the budget anyway is dropped.
Everything here runs on the model thread only: it owns the device, the graphs and the pool.
``CaptureStats`` is written by that thread and read by the metrics exporter.

A lazy capture happens in the middle of serving, so it neither synchronises the device nor empties the
allocator's cache: ``record`` drives ``CUDAGraph.capture_begin``/``capture_end`` itself instead of
``torch.cuda.graph``, whose ``__enter__`` does both before every capture (and ``gc.collect()`` too on
older torch).

A capture that fails (an operation the forward uses turns out not to be capturable on this device or
version) must not take the service down. The last warm-up before each capture runs with host
synchronisations raising (``torch.cuda.set_sync_debug_mode("error")``), so the commonest cause fails
eagerly, before any capture state exists. A failure inside the capture is unwound by ``record`` (see
there). Either way it is logged with its traceback, graphs are switched off for the model, their pool
is given back, and every batch runs the same forward eagerly from then on.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import Cell, capture_order

log = logging.getLogger("coalesce.kernels")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids (B, S), lengths (B,)) -> (B, dim)


@dataclass(slots=True)
class CaptureStats:
    """Counters about graph capture and use; plain attributes for the metrics exporter."""

    seconds: float = 0.0  # wall time spent warming up and capturing, start-up and lazy together
    bytes: int = 0  # device memory the graphs hold: their pool's segments plus their static inputs
    cells_planned: int = 0  # cells of the grid
    cells_captured: int = 0
    cells_over_memory: int = 0  # cells left eager (or dropped after capture) by the memory budget
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

    @property
    def static_bytes(self) -> int:
        """The inputs live outside the pool (allocated before capture); the output is in it."""
        return self.ids.nbytes + self.lengths.nbytes


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
        self._index = device.index if device.index is not None else torch.cuda.current_device()
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
        started = time.perf_counter()
        try:
            with torch.cuda.device(self._device):
                return self._capture(cell)
        except Exception as exc:
            # The failed forward's frames hold tensors allocated in the pool: let them go now, whoever
            # keeps the exception (a log handler, a test's caplog), so the pool can be given back.
            _clear_frames(exc)
            log.exception("CUDA graph capture of cell %s failed; graphs are off, batches run eagerly", cell)
        finally:
            self.stats.seconds += time.perf_counter() - started
        self._switch_off()
        return None

    def _switch_off(self) -> None:
        """After a failure (``record`` has already unwound any capture): drop every graph and give the
        pool back, so the eager forward starts from a settled device with that memory free."""
        self._failed = True
        self._graphs.clear()  # each graph's destruction releases its reference to the pool
        self.stats.cells_captured = 0
        self.stats.bytes = 0
        self.stats.capture_failures += 1
        with torch.cuda.device(self._device):
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()  # once, here: the pool is unreferenced now, and this frees it

    def _capture(self, cell: Cell) -> _Captured | None:
        """Warm up and capture one cell; None if the memory budget refuses it."""
        rows, cols = cell
        dev = self._device
        ids = torch.full((rows, cols), self._pad_id, dtype=torch.int64, device=dev)
        lengths = torch.full((rows,), cols, dtype=torch.int64, device=dev)
        kept_static = sum(c.static_bytes for c in self._graphs.values())
        held_static = kept_static + ids.nbytes + lengths.nbytes
        allocated_before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)

        side = self._stream
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            if not self._graphs:  # the first forward on this stream may set up libraries: not under "error"
                self._forward(ids, lengths)
            with host_syncs_raise():  # a host sync raises here, eagerly, instead of breaking the capture
                self._forward(ids, lengths)
        torch.cuda.current_stream(dev).wait_stream(side)

        # Free blocks of the pool serve a new graph first; only the rest of the forward's peak would be
        # new memory (fragmentation can make it more: the real growth is checked after capture).
        peak = torch.cuda.max_memory_allocated(dev) - allocated_before
        before = pool_usage(self._pool)
        estimate = max(0, peak - (before.reserved - before.allocated))
        if before.reserved + estimate + held_static > self._budget_bytes:
            self._refuse(cell, f"~{estimate >> 20} MiB more would exceed")
            return None

        graph = torch.cuda.CUDAGraph()
        out = record(graph, lambda: self._forward(ids, lengths), stream=side, pool=self._pool,
                     device_index=self._index)
        after = pool_usage(self._pool)
        if after.reserved + held_static > self._budget_bytes:
            del graph, out  # its pool reference goes; the segments it added stay with the pool
            if not self._graphs:
                # Nothing references the pool now, so the allocator may free it: capture into a new one
                # (torch asserts on a capture into a pool that is unreferenced but not yet freed).
                self._pool = torch.cuda.graph_pool_handle()
            self.stats.bytes = pool_usage(self._pool).reserved + kept_static
            grown = (after.reserved - before.reserved) >> 20
            self._refuse(cell, f"its capture grew the pool by {grown} MiB, past")
            return None
        captured = _Captured(graph, ids, lengths, out)
        self._graphs[cell] = captured
        self.stats.bytes = after.reserved + held_static
        self.stats.cells_captured += 1
        return captured

    def _refuse(self, cell: Cell, why: str) -> None:
        self._refused.add(cell)
        self.stats.cells_over_memory += 1
        log.info("graph cell %s left eager: %s the %d MiB memory budget", cell, why, self._budget_bytes >> 20)


def record(
    graph: torch.cuda.CUDAGraph,
    fn: Callable[[], torch.Tensor],
    *,
    stream: torch.cuda.Stream,
    pool: Any,
    device_index: int,
) -> torch.Tensor:
    """``fn()`` captured into ``graph`` on ``stream``, allocating from ``pool``; its (static) output.

    On failure it re-raises after leaving no capture state behind, which ``torch.cuda.graph`` does not:
    its ``__exit__`` calls ``capture_end``, and when that raises (it does whenever the capture was
    invalidated, e.g. by a host sync inside ``fn``), ``cudaStreamEndCapture``'s error is thrown before
    the allocator's ``endAllocateToPool`` and before the stream context is left (CUDAGraph.cpp as read
    on PyTorch's main branch; ``torch.cuda.graph.__exit__`` in the 2.13 installed here). The allocator
    then believes a capture is still under way: ``empty_cache()`` reaches
    ``TORCH_INTERNAL_ASSERT(captures_underway.empty())`` in ``synchronize_and_free_events`` (torch <
    2.8), end-of-life events of blocks used across streams stop being processed, and the capture's
    reference to the pool is never released (``CUDAGraph::reset`` releases it only after a completed
    ``capture_end``), so the pool's memory can never be freed, and the next capture starts on that
    state. So, in this order: end the stream's capture if it is still capturing (on the capture
    stream), restore the previous stream, end allocate-to-pool, and release the failed capture's pool
    reference (``_leave_pool``).

    ``capture_error_mode="thread_local"``: CUDA calls other threads make meanwhile are not this
    capture's business.
    """
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
                graph.capture_end()
            except BaseException:
                _end_stream_capture(graph, stream)
                raise
    except BaseException:
        _leave_pool(pool, device_index)
        raise
    return out


def _end_stream_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """End ``stream``'s capture if it is still capturing (active or invalidated: ``fn`` raised before
    ``capture_end``, or ``capture_end`` failed its same-stream check). Its error, if any, is the
    expected one for an invalidated capture; the caller re-raises the original failure."""
    with torch.cuda.stream(stream):
        if not torch.cuda.is_current_stream_capturing():
            return
        try:
            graph.capture_end()
        except Exception as exc:  # cudaStreamEndCapture has ended the capture by the time it reports
            log.debug("ending the failed capture: %s", exc)


def _leave_pool(pool: Any, device_index: int) -> None:
    """End the allocator's allocate-to-pool state for a failed capture and release its pool reference.

    ``endAllocateToPool`` raising "not currently recording" means ``capture_end`` got that far itself;
    then the graph object holds the reference and releases it when it is dropped, so nothing is
    released here (releasing twice would corrupt the pool's use count).

    Private allocator bindings, looked up by name because they moved: ``_cuda_endAllocateToPool``
    (torch >= 2.8, and the 2.13 installed here), ``_cuda_endAllocateCurrentStreamToPool`` (its name
    before 2.8), ``_cuda_releasePool`` (both). Without them the pool's memory stays reserved (logged).
    Left alone: on torch versions where ``capture_begin`` also puts the pinned host allocator into
    allocate-to-pool, no Python binding ends that; our forward allocates no pinned memory.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None
    )
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        log.warning("this torch lacks the allocator calls that end a failed capture; its pool stays reserved")
        return
    try:
        end(device_index, pool)
    except RuntimeError:
        return
    release(device_index, pool)


@contextlib.contextmanager
def host_syncs_raise() -> Iterator[None]:
    """Inside, a CUDA operation that synchronises with the host raises instead of running
    (``torch.cuda.set_sync_debug_mode``, public since torch 1.10); the previous mode comes back after.

    The mode is process-wide: it is right here because only the model thread issues CUDA work.
    """
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    reserved: int  # bytes of the pool's segments
    allocated: int  # bytes of its blocks in use


def pool_usage(pool: Any) -> PoolUsage:
    """What the caching allocator holds for ``pool``, summed over its segments.

    Read from ``torch.cuda.memory_snapshot()`` (public; every segment names its pool in
    ``segment_pool_id``, which torch's own cudagraph trees rely on). Chosen over deltas of
    ``memory_stats``/``memory_reserved``: those count the whole device, so the warm-up's first blocks
    on the capture stream (cached in the default pool, not the graphs') would be charged to a graph,
    and only an ``empty_cache()`` before each capture made the delta mean anything; the snapshot needs
    neither and counts exactly what the budget bounds. It costs a walk of the allocator's segments
    (no device sync): small next to a capture.
    """
    want = tuple(pool)
    reserved = allocated = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == want:
            reserved += int(segment["total_size"])
            allocated += int(segment["allocated_size"])
    return PoolUsage(reserved, allocated)


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame in ``exc``'s tracebacks (its context chain included)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
