"""The model facade's tokenisation hand-off: requests arriving together share one call to the
tokenizer, each gets exactly its own ids, and a failure reaches only the request that caused it — on the
event loop for a turn of short texts, on the tokenizer thread otherwise (every test runs both ways)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
from coalesce.kernels.protocol import ModelInfo, OutputKind, Task
from coalesce.service.batching.batcher import Submission
from coalesce.service.errors import InvalidRequest
from coalesce.service.gateway import facade
from coalesce.service.gateway.admission import Admission
from coalesce.service.gateway.facade import LocalModel, ServedModel
from coalesce.service.metrics import Metrics

from ..fakes import FakeRunner, FakeTokens
from .test_batcher import Rig as BatcherRig


class CountingTokens(FakeTokens):
    """Records every tokenizer call; any text containing ``poison`` makes the call raise."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []
        self.threads: list[str] = []

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls.append(list(texts))
        self.threads.append(threading.current_thread().name)
        if any("poison" in t for t in texts):
            raise ValueError("cannot tokenise poison")
        return super().tokenize(texts)


Rig = tuple[CountingTokens, ServedModel]


@pytest.fixture(params=["inline", "thread"])
async def rig(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    if request.param == "thread":
        monkeypatch.setattr(facade, "INLINE_TOKENIZE_CHARS", 0)
    tokens = CountingTokens()
    info = ModelInfo(name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8)
    model = ServedModel(info, tokens, device="cpu", metrics=Metrics())
    yield tokens, model
    model.close()


def _own_ids(tokens: FakeTokens, texts: Sequence[str]) -> list[list[int]]:
    return FakeTokens.tokenize(tokens, texts)


async def test_requests_arriving_together_share_one_tokenizer_call(rig: Rig) -> None:
    tokens, model = rig
    requests = [["a b"], ["c", "d e f"], ["g h i j"]]
    got = await asyncio.gather(*(model.tokenize(texts) for texts in requests))
    assert tokens.calls == [["a b", "c", "d e f", "g h i j"]]
    assert got == [_own_ids(tokens, texts) for texts in requests]


async def test_a_lone_request_is_tokenised_at_once_on_its_own(rig: Rig) -> None:
    tokens, model = rig
    assert await model.tokenize(["one"]) == _own_ids(tokens, ["one"])
    assert await model.tokenize(["two"]) == _own_ids(tokens, ["two"])
    assert tokens.calls == [["one"], ["two"]]


async def test_a_failing_text_fails_only_its_own_request(rig: Rig) -> None:
    tokens, model = rig
    got = await asyncio.gather(
        model.tokenize(["fine"]),
        model.tokenize(["poison pill"]),
        model.tokenize(["also fine"]),
        return_exceptions=True,
    )
    assert got[0] == _own_ids(tokens, ["fine"]) and got[2] == _own_ids(tokens, ["also fine"])
    assert isinstance(got[1], ValueError)


async def test_a_caller_that_left_does_not_disturb_the_others(rig: Rig) -> None:
    tokens, model = rig
    gone = asyncio.ensure_future(model.tokenize(["left early"]))
    stays = asyncio.ensure_future(model.tokenize(["stays"]))
    await asyncio.sleep(0)
    gone.cancel()
    assert await stays == _own_ids(tokens, ["stays"])
    assert gone.cancelled()


async def test_a_turn_of_short_texts_is_tokenised_on_the_loop_and_a_long_one_on_the_thread(rig: Rig) -> None:
    tokens, model = rig
    loop_thread = threading.current_thread().name
    await model.tokenize(["short"])
    await model.tokenize(["long " * (facade.INLINE_TOKENIZE_CHARS // 5 + 1)])
    inline = facade.INLINE_TOKENIZE_CHARS > 0
    assert (tokens.threads[0] == loop_thread) is inline
    assert tokens.threads[1] != loop_thread


# -- one process: a turn's requests reach the batcher together -------------------------------------------
def _admission(deadline_s: float = 30.0) -> Admission:
    now = time.monotonic()
    return Admission("default", 1.0, 1, deadline_s, now + deadline_s, now)


@pytest.fixture
async def local() -> AsyncIterator[tuple[LocalModel, BatcherRig, list[int]]]:
    rig = BatcherRig(FakeRunner(), max_queued_tokens=12)
    calls: list[int] = []
    enqueue_many = rig.batcher.enqueue_many

    def counted(requests: Sequence[Submission], reply: Any) -> list[Any]:
        calls.append(len(requests))
        return enqueue_many(requests, reply)

    rig.batcher.enqueue_many = counted  # type: ignore[method-assign]
    info = ModelInfo(name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8)
    model = LocalModel(rig.batcher, info, FakeTokens(), device="cpu", metrics=rig.metrics, prompts=None,
                       calibration=None)
    yield model, rig, calls
    model.close()
    await rig.aclose()


async def test_one_process_hands_a_turns_requests_to_the_batcher_at_once_each_answered_its_own(
    local: tuple[LocalModel, BatcherRig, list[int]],
) -> None:
    model, rig, calls = local
    texts = ["a", "b c", "d"]
    got = await asyncio.gather(*(model.infer(rig.seqs(t), _admission()) for t in texts))
    assert calls == [3]  # one hand-over for the turn
    for t, result in zip(texts, got, strict=True):
        np.testing.assert_allclose(result.rows[0], rig.runner.expected(t), rtol=1e-6)


async def test_in_one_process_a_refusal_reaches_only_its_own_request_and_a_caller_gone_is_never_queued(
    local: tuple[LocalModel, BatcherRig, list[int]],
) -> None:
    model, rig, calls = local
    gone = model.submit(rig.seqs("gone"), _admission(), OutputKind.POOLED)
    gone.cancel()  # its caller left before the turn ended
    small = model.infer(rig.seqs("a"), _admission())
    huge = model.infer(rig.seqs(" ".join(["word"] * 12)), _admission())  # 14 tokens, past the bound
    got = await asyncio.gather(small, huge, return_exceptions=True)
    assert calls == [2]
    assert not isinstance(got[0], BaseException)
    np.testing.assert_allclose(got[0].rows[0], rig.runner.expected("a"), rtol=1e-6)
    assert isinstance(got[1], InvalidRequest) and got[1].code == "request_too_large"
    assert rig.sample("coalesce_inputs_total") == 1  # "gone" was never computed


async def test_in_one_process_the_routes_hold_goes_with_its_request_and_ends_whole_at_admission() -> None:
    # The route's check before tokenising holds room for an estimate of the request's tokens; admission
    # ends that hold whole on the real count. Released by count instead (the oldest hold of the class),
    # an estimate above the real count left its excess held, counted ahead of every later request.
    rig = BatcherRig(FakeRunner(), max_queue_wait_s=2.0)
    info = ModelInfo(name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8)
    model = LocalModel(rig.batcher, info, FakeTokens(), device="cpu", metrics=rig.metrics, prompts=None,
                       calibration=None)
    admission = rig.batcher.scheduler.admission
    try:
        first, second = _admission(), _admission()
        held = model.check_room(first, 1, 20, 1)  # an estimate of 20 tokens; the text is 3
        assert held and admission._held_ahead(1, time.monotonic())[0] == 20
        assert model.check_room(first, 1, 20, 1) is held  # checked once: its hold is not taken twice
        model.check_room(second, 1, 5, 1)
        results = await asyncio.gather(model.infer(rig.seqs("a"), first), model.infer(rig.seqs("b"), second))
        assert [len(r.rows) for r in results] == [1, 1]
        assert first.held is held and held[1] == 0 and second.held is not None and second.held[1] == 0
        assert admission._held_ahead(2, time.monotonic()) == (0, 0.0)  # nothing left over by either
    finally:
        model.close()
        await rig.aclose()
