"""``loadtests/forward_lanes.py``: forwards side by side, each lane on its own thread count."""

from __future__ import annotations

import threading

import torch
from coalesce.loadtests.forward_lanes import batches_per_s


class _Counting:
    """A runner that records, per forward, the thread it ran on and torch's thread count there."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def forward(self, prepared: object) -> object:
        with self._lock:
            self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        return prepared

    def finish(self, out: object, prepared: object) -> object:
        return out


def test_each_lane_runs_its_share_of_the_forwards_on_its_own_thread_count() -> None:
    main_threads = torch.get_num_threads()
    runner = _Counting()
    rate = batches_per_s(runner, object(), lanes=3, threads=1, n=10)
    assert rate > 0
    assert len(runner.seen) == 9, "three lanes of 10 // 3 forwards: the rate counts what ran"
    assert len({name for name, _ in runner.seen}) == 3
    assert {count for _, count in runner.seen} == {1}
    assert torch.get_num_threads() == main_threads, "a lane's count is its own thread's"
