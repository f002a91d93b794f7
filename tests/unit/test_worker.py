"""The model worker's hand-off: a batch's rows, or the exception its runner raised while preparing or
running it, come back to the event loop, whether the batch is prepared beside the device (pipelined)
or on it; and batches run in the order they were handed over."""

from __future__ import annotations

import asyncio
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
