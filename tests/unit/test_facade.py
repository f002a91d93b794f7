"""The model facade's tokenisation hand-off: requests arriving together share one call to the
tokenizer, each gets exactly its own ids, and a failure reaches only the request that caused it — on the
event loop for a turn of short texts, on the tokenizer thread otherwise (every test runs both ways)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence

import pytest
from coalesce.kernels.protocol import ModelInfo, Task
from coalesce.service.gateway import facade
from coalesce.service.gateway.facade import ServedModel
from coalesce.service.metrics import Metrics

from ..fakes import FakeTokens


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
