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
from coalesce.kernels.worker import BatchOutput, DeviceThread, ModelWorker

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


class _Held(FakeRunner):
    """Records which thread prepared each batch; a forward waits for ``release`` while ``hold`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared_on: list[str] = []
        self.hold = threading.Event()
        self.release = threading.Event()
        self.running = threading.Event()

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        self.prepared_on.append(threading.current_thread().name)
        return super().prepare(batch)

    def forward(self, prepared: list[list[int]]) -> list[list[int]]:
        if self.hold.is_set():
            self.running.set()
            assert self.release.wait(10)
        return super().forward(prepared)


async def test_a_batch_is_prepared_beside_the_device_only_when_the_device_is_busy() -> None:
    """Pipelined (a GPU): a batch handed over while another runs is padded on the CPU thread, beside
    that forward; one handed to an idle device is prepared on the device thread, with one thread
    wake-up less before its forward, and so is the next one once the device is idle again."""
    runner = _Held()
    device = DeviceThread("test")
    worker = ModelWorker(runner, device, overlap=True)
    try:
        await worker.run([[1, 5, 2]])  # alone: the device was idle
        runner.hold.set()
        first = asyncio.ensure_future(worker.run([[1, 6, 2]]))
        assert await asyncio.to_thread(runner.running.wait, 10)  # its forward is running now
        runner.hold.clear()
        second = asyncio.ensure_future(worker.run([[1, 7, 2]]))
        await asyncio.sleep(0)
        for _ in range(200):  # the second is padded while the first's forward still runs
            if len(runner.prepared_on) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(runner.prepared_on) == 3, "the busy device's next batch was prepared beside it"
        runner.release.set()
        rows = await asyncio.wait_for(asyncio.gather(first, second), 10)
        np.testing.assert_array_equal(rows[1].rows, [runner.vector([1, 7, 2])])
        await worker.run([[1, 8, 2]])  # idle again
        device_thread, prep_thread = "coalesce-test", "coalesce-prep-fake"
        assert runner.prepared_on == [device_thread, device_thread, prep_thread, device_thread]
        assert device.in_flight == 0
    finally:
        runner.release.set()
        worker.close()
        device.close()
