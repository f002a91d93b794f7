"""The model worker's tokenisation hand-off: requests arriving together share one call to the
tokenizer, each gets exactly its own ids, and a failure reaches only the request that caused it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from coalesce.kernels.fake import FakeRunner
from coalesce.kernels.worker import DeviceThread, ModelWorker


class CountingRunner(FakeRunner):
    """Records every tokenizer call; any text containing ``poison`` makes the call raise."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls.append(list(texts))
        if any("poison" in t for t in texts):
            raise ValueError("cannot tokenise poison")
        return super().tokenize(texts)


Rig = tuple[CountingRunner, ModelWorker]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    runner, device = CountingRunner(), DeviceThread("test")
    worker = ModelWorker(runner, device)
    yield runner, worker
    worker.close()
    device.close()


def _own_ids(runner: FakeRunner, texts: Sequence[str]) -> list[list[int]]:
    return FakeRunner.tokenize(runner, texts)


async def test_requests_arriving_together_share_one_tokenizer_call(rig: Rig) -> None:
    runner, worker = rig
    requests = [["a b"], ["c", "d e f"], ["g h i j"]]
    got = await asyncio.gather(*(worker.tokenize(texts) for texts in requests))
    assert runner.calls == [["a b", "c", "d e f", "g h i j"]]
    assert got == [_own_ids(runner, texts) for texts in requests]


async def test_a_lone_request_is_tokenised_at_once_on_its_own(rig: Rig) -> None:
    runner, worker = rig
    assert await worker.tokenize(["one"]) == _own_ids(runner, ["one"])
    assert await worker.tokenize(["two"]) == _own_ids(runner, ["two"])
    assert runner.calls == [["one"], ["two"]]


async def test_a_failing_text_fails_only_its_own_request(rig: Rig) -> None:
    runner, worker = rig
    got = await asyncio.gather(
        worker.tokenize(["fine"]),
        worker.tokenize(["poison pill"]),
        worker.tokenize(["also fine"]),
        return_exceptions=True,
    )
    assert got[0] == _own_ids(runner, ["fine"]) and got[2] == _own_ids(runner, ["also fine"])
    assert isinstance(got[1], ValueError)


async def test_a_caller_that_left_does_not_disturb_the_others(rig: Rig) -> None:
    runner, worker = rig
    gone = asyncio.ensure_future(worker.tokenize(["left early"]))
    stays = asyncio.ensure_future(worker.tokenize(["stays"]))
    await asyncio.sleep(0)
    gone.cancel()
    assert await stays == _own_ids(runner, ["stays"])
    assert gone.cancelled()
