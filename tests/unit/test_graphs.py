"""How ``graphs.record`` unwinds a failed CUDA graph capture, on fakes of what torch keeps for one.

No GPU here: the fake graph, streams and allocator calls below keep the state CUDAGraph.cpp and the
caching allocator keep (is the stream capturing, is the pool in the allocator's captures-under-way
list, how many captures reference the pool), and fail the way torch does. The real thing runs in
``tests/gpu`` (``capture_failure_child.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from coalesce.kernels import graphs
from coalesce.kernels.graphs import host_syncs_raise, record

POOL = (0, 7)


class FakeCuda:
    """The per-process capture state, and a log of what was done to it, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.stream = "default"
        self.capturing: str | None = None  # the stream under capture
        self.invalidated = False
        self.underway: set[tuple[int, int]] = set()  # the allocator's captures_underway
        self.use_count: dict[tuple[int, int], int] = {}

    @contextlib.contextmanager
    def on(self, stream: str) -> Iterator[None]:
        previous, self.stream = self.stream, stream
        self.events.append(f"enter {stream}")
        try:
            yield
        finally:
            self.stream = previous
            self.events.append(f"exit {stream}")

    def is_capturing(self) -> bool:
        return self.capturing == self.stream

    def end_allocate(self, device: int, pool: tuple[int, int]) -> None:
        if pool not in self.underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.underway.discard(pool)
        self.events.append("end allocate-to-pool")

    def release(self, device: int, pool: tuple[int, int]) -> None:
        self.use_count[pool] -= 1
        assert self.use_count[pool] >= 0, "released more often than referenced"
        self.events.append("release pool")

    def sync_inside_capture(self) -> torch.Tensor:
        """What ``.item()`` does while capturing: the capture is invalidated and the call raises."""
        self.invalidated = True
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class FakeGraph:
    """``CUDAGraph.capture_begin``/``capture_end`` as CUDAGraph.cpp orders them."""

    def __init__(self, cuda: FakeCuda, *, instantiate_fails: bool = False) -> None:
        self.cuda = cuda
        self.instantiate_fails = instantiate_fails

    def capture_begin(self, pool: tuple[int, int], capture_error_mode: str) -> None:
        cuda = self.cuda
        cuda.use_count[pool] = cuda.use_count.get(pool, 0) + 1  # beginAllocateToPool: incref
        cuda.underway.add(pool)
        cuda.capturing, self.stream, self.pool = cuda.stream, cuda.stream, pool
        cuda.events.append(f"capture_begin on {cuda.stream}")

    def capture_end(self) -> None:
        cuda = self.cuda
        cuda.events.append(f"capture_end on {cuda.stream}")
        if cuda.stream != self.stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        cuda.capturing = None  # cudaStreamEndCapture ends it, valid or not
        if cuda.invalidated:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        cuda.underway.discard(self.pool)  # endAllocateToPool; the graph now holds the reference
        if self.instantiate_fails:
            raise RuntimeError("CUDA error: cudaGraphInstantiate failed")


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "stream", fake.on)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", fake.is_capturing)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", fake.end_allocate, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", fake.release, raising=False)
    return fake


def _record(cuda: FakeCuda, graph: Any, fn: Any) -> Any:
    return record(graph, fn, stream="side", pool=POOL, device_index=0)  # type: ignore[arg-type]


def _healthy(cuda: FakeCuda) -> None:
    assert cuda.stream == "default"
    assert cuda.capturing is None
    assert not cuda.underway  # empty_cache() would assert otherwise (torch < 2.8)


def test_a_host_sync_inside_the_capture_is_unwound_in_order(cuda: FakeCuda) -> None:
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):  # fn's error, not
        _record(cuda, FakeGraph(cuda), cuda.sync_inside_capture)  # capture_end's
    _healthy(cuda)
    assert cuda.use_count[POOL] == 0  # the failed capture's reference is released, exactly once
    assert cuda.events == [
        "enter side", "capture_begin on side",
        "enter side", "capture_end on side", "exit side",  # the capture ends on its own stream
        "exit side",  # then the previous stream comes back
        "end allocate-to-pool", "release pool",
    ]


def test_a_capture_end_that_fails_is_unwound_too(cuda: FakeCuda) -> None:
    def invalidates_quietly() -> torch.Tensor:
        cuda.invalidated = True  # e.g. an illegal call that only reports at the end of the capture
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="previous error during capture"):
        _record(cuda, FakeGraph(cuda), invalidates_quietly)
    _healthy(cuda)
    assert cuda.use_count[POOL] == 0
    assert cuda.events[-2:] == ["end allocate-to-pool", "release pool"]


def test_a_forward_that_leaves_another_stream_current_still_ends_its_capture(cuda: FakeCuda) -> None:
    def strays() -> torch.Tensor:
        cuda.stream = "elsewhere"  # a bug in the forward: capture_end's same-stream check fails
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="same stream"):
        _record(cuda, FakeGraph(cuda), strays)
    _healthy(cuda)
    assert "capture_end on elsewhere" in cuda.events and "capture_end on side" in cuda.events
    assert cuda.use_count[POOL] == 1  # the capture itself was valid: its graph holds the reference


def test_a_successful_capture_leaves_the_pool_reference_to_the_graph(cuda: FakeCuda) -> None:
    out = torch.ones(2)
    assert _record(cuda, FakeGraph(cuda), lambda: out) is out
    _healthy(cuda)
    assert cuda.use_count[POOL] == 1  # released when the graph is dropped, not here
    assert "release pool" not in cuda.events and "end allocate-to-pool" not in cuda.events


def test_when_torch_ended_allocate_to_pool_itself_nothing_is_released_twice(cuda: FakeCuda) -> None:
    with pytest.raises(RuntimeError, match="Instantiate"):
        _record(cuda, FakeGraph(cuda, instantiate_fails=True), lambda: torch.ones(1))
    _healthy(cuda)
    assert cuda.use_count[POOL] == 1  # the graph object releases it when dropped
    assert "release pool" not in cuda.events


def test_without_the_allocator_bindings_it_still_unwinds_the_stream(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool"):
        monkeypatch.delattr(torch._C, name, raising=False)
    with pytest.raises(RuntimeError, match="not permitted"):
        _record(cuda, FakeGraph(cuda), cuda.sync_inside_capture)
    assert cuda.stream == "default" and cuda.capturing is None
    assert cuda.underway == {POOL}  # nothing to end it with: logged, and the pool stays reserved


def test_host_syncs_raise_restores_the_previous_mode_after(monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int | str] = [1]  # "warn", set by someone else
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with pytest.raises(RuntimeError), host_syncs_raise():
        assert modes[-1] == "error"
        raise RuntimeError("called a synchronizing CUDA operation")
    assert modes[-1] == 1


def test_the_pool_is_measured_from_its_own_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    segments = [
        {"segment_pool_id": POOL, "total_size": 20 << 20, "allocated_size": 3 << 20},
        {"segment_pool_id": (0, 0), "total_size": 100 << 20, "allocated_size": 90 << 20},  # eager blocks
        {"segment_pool_id": POOL, "total_size": 2 << 20, "allocated_size": 1 << 20},
        {"segment_pool_id": (0, 8), "total_size": 40 << 20, "allocated_size": 0},  # another model's graphs
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert graphs.pool_usage(POOL) == graphs.PoolUsage(reserved=22 << 20, allocated=4 << 20)
