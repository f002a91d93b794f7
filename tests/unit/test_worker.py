"""The model worker's hand-off: a batch's rows, or the exception its runner raised while preparing or
running it, come back to the event loop, whether the batch is prepared beside the device (pipelined)
or on it; and batches run in the order they were handed over."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from coalesce.kernels.protocol import OutputKind
from coalesce.kernels.worker import BatchOutput, DeviceThread, ModelWorker, SpareCore

from ..fakes import FakeRunner


class _BadPrepare(FakeRunner):
    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        raise ValueError("cannot pad this")


@pytest.mark.parametrize("overlap", [True, False])
async def test_rows_and_failures_come_back_to_the_loop_in_order(overlap: bool) -> None:
    runner = FakeRunner(fail_token=666)
    device = DeviceThread("test")
    worker = ModelWorker(runner, device, overlap=overlap)
    try:
        got: list[BatchOutput | Exception] = []
        done = asyncio.Event()
        batches = [[[1, 5, 2]], [[1, 666, 2]], [[1, 7, 2], [1, 8, 9, 2]]]

        def collect(outcome: BatchOutput | Exception) -> None:
            got.append(outcome)
            if len(got) == len(batches):
                done.set()

        for batch in batches:
            worker.start(batch, OutputKind.POOLED, collect)
        await asyncio.wait_for(done.wait(), 10)
        first, failed, last = got
        assert isinstance(first, BatchOutput) and isinstance(last, BatchOutput)
        np.testing.assert_array_equal(first.rows, [runner.vector([1, 5, 2])])
        np.testing.assert_array_equal(last.rows, [runner.vector([1, 7, 2]), runner.vector([1, 8, 9, 2])])
        assert isinstance(failed, RuntimeError) and "injected" in str(failed)
        assert runner.batches == [1, 1, 2], "every batch reached the runner, in the order handed over"

        bad = ModelWorker(_BadPrepare(), device, overlap=overlap)
        with pytest.raises(ValueError, match="cannot pad"):
            await bad.run([[1, 2]])
        bad.close()
    finally:
        worker.close()
        device.close()


def test_a_spare_core_runs_forwards_on_one_thread_fewer_while_any_queue_stands() -> None:
    set_to: list[tuple[int, str]] = []  # (threads, the thread that set them): torch's count is per thread
    spare = SpareCore(4, lambda n: set_to.append((n, threading.current_thread().name)))
    device = DeviceThread("spare")
    device.spare = spare
    worker = ModelWorker(FakeRunner(), device, overlap=False)
    try:
        def forward() -> None:
            asyncio.run(worker.run([[1, 2, 3]]))

        forward()
        assert set_to == []  # calm: the usual count, nothing to change
        spare.standing("a", True)
        forward()
        spare.standing("b", True)
        spare.standing("a", False)  # b still stands
        forward()
        assert [n for n, _ in set_to] == [3]
        spare.standing("b", False)
        forward()
        assert [n for n, _ in set_to] == [3, 4]  # every thread again once no queue stands
        assert all(name.startswith("coalesce-spare") for _, name in set_to)  # on the device thread
        one = SpareCore(1, lambda n: set_to.append((n, "")))
        one.standing("a", True)
        assert one.wanted == 1  # never below one thread
    finally:
        worker.close()
        device.close()
