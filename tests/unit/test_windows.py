"""Long inputs: how a request's choice combines with the old truncate fields and the server default,
where windows start, what they hold (prompt, special tokens, the raw mark), and how their rows pool."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from coalesce.kernels.protocol import ModelInfo, Task, is_raw, marks
from coalesce.service.errors import InvalidRequest
from coalesce.service.gateway.state import SETTINGS
from coalesce.service.gateway.windows import LongInput, fit_long, long_input, pool_windows, window_starts
from coalesce.service.settings import build


def _request(*flags: str) -> Any:
    app = web.Application()
    app[SETTINGS] = build(list(flags), environ={})
    return SimpleNamespace(app=app)


@pytest.mark.parametrize(
    ("flags", "asked", "truncate", "mode"),
    [
        ((), None, None, "truncate"),  # today's default
        (("--no-truncate",), None, None, "error"),  # today's --no-truncate
        (("--long-input", "chunk"), None, None, "chunk"),
        (("--long-input", "chunk"), None, True, "truncate"),  # TEI's truncate: true means what it meant
        (("--long-input", "chunk"), None, False, "error"),
        (("--no-truncate",), "chunk", False, "chunk"),  # the request's long_input wins over all
        ((), "CHUNK", None, "chunk"),
    ],
)
def test_the_request_then_its_truncate_field_then_the_server_decide(
    flags: tuple[str, ...], asked: str | None, truncate: bool | None, mode: str
) -> None:
    assert long_input(_request(*flags), asked, truncate).mode == mode


def test_overlap_and_bound_come_from_the_server_unless_the_request_says() -> None:
    request = _request("--chunk-overlap", "16", "--max-input-tokens", "500")
    assert long_input(request, "chunk") == LongInput("chunk", 16, 500)
    assert long_input(request, "chunk", overlap=0).overlap == 0
    with pytest.raises(InvalidRequest) as bad:
        long_input(request, "chunks")
    assert bad.value.param == "long_input"
    with pytest.raises(InvalidRequest) as neg:
        long_input(request, "chunk", overlap=-1)
    assert neg.value.param == "chunk_overlap"


def test_contradicting_flags_are_refused_at_start_up() -> None:
    with pytest.raises(SystemExit, match="contradicts"):
        build(["--no-truncate", "--long-input", "chunk"], environ={})
    with pytest.raises(SystemExit, match="long_input must be"):
        build(["--long-input", "split"], environ={})
    assert build(["--no-truncate", "--long-input", "error"], environ={}).default_long_input == "error"


@pytest.mark.parametrize(
    ("length", "room", "overlap", "starts"),
    [
        (10, 10, 0, [0]),
        (11, 10, 0, [0, 10]),
        (25, 10, 0, [0, 10, 20]),
        (25, 10, 4, [0, 6, 12, 18]),  # each repeats the last 4 of the one before; the last ends the text
        (30, 10, 0, [0, 10, 20]),
    ],
)
def test_windows_cover_the_text_once_each_token_plus_the_overlap(
    length: int, room: int, overlap: int, starts: list[int]
) -> None:
    assert window_starts(length, room, overlap) == starts
    assert starts[-1] + room >= length  # nothing left out


def test_pooling_weights_by_tokens_before_normalising() -> None:
    rows = np.array([[3.0, 0.0], [0.0, 1.0], [0.0, 2.0], [5.0, 5.0]], dtype=np.float32)
    out = pool_windows(rows, [1, 2, 1], [4, 3, 1, 9], normalize=True)
    assert np.allclose(out[0], [3.0, 0.0]) and np.allclose(out[2], [5.0, 5.0])  # alone: as returned
    # (3·[0,1] + 1·[0,2]) / 4 = [0, 1.25], then normalised
    assert np.allclose(out[1], [0.0, 1.0])
    mixed = pool_windows(np.array([[2.0, 0.0], [0.0, 1.0]]), [2], [1, 1], normalize=True)
    assert np.allclose(mixed[0], np.array([2.0, 1.0]) / np.sqrt(5))  # raw rows: the longer one weighs more
    unnormalised = pool_windows(np.array([[2.0, 0.0], [0.0, 1.0]]), [2], [3, 1], normalize=False)
    assert np.allclose(unnormalised[0], [1.5, 0.25])


class _Tokens:
    prefix_len = 1
    specials = 2

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        return [101, *ids, 102]


def _model(normalized: bool = True, include_prompt: bool = True, raw_rows: bool = True) -> Any:
    info = ModelInfo(name="m", task=Task.EMBED, max_tokens=8, vocab_size=200, dim=4, normalized=normalized,
                     include_prompt=include_prompt, raw_rows=raw_rows)
    return SimpleNamespace(info=info, specials=2, tokens=_Tokens())


def test_chunked_windows_fill_the_model_behind_the_prompt() -> None:
    prompt = [7, 7]
    text = list(range(10, 20))  # 10 tokens; 8 − 2 specials − 2 prompt = 4 per window
    fitted = fit_long(_model(include_prompt=False), [prompt + text, [*prompt, 5]], LongInput("chunk"),
                      field="input", prompt_len=2)
    assert fitted.counts == [3, 1]
    assert [list(s) for s in fitted.seqs] == [
        [101, 7, 7, 10, 11, 12, 13, 102],
        [101, 7, 7, 14, 15, 16, 17, 102],
        [101, 7, 7, 18, 19, 102],
        [101, 7, 7, 5, 102],
    ]
    assert [is_raw(s) for s in fitted.seqs] == [True, True, True, False]  # a text that fits runs as before
    assert [marks(s)[1] for s in fitted.seqs] == [3, 3, 3, 3]  # pooling leaves [CLS] + prompt out
    assert fitted.weights == [5, 5, 3, 2]
    assert fitted.tokens == 8 + 8 + 6 + 5  # usage: every token embedded


def test_a_model_that_does_not_normalise_needs_no_raw_rows() -> None:
    fitted = fit_long(_model(normalized=False, raw_rows=False), [list(range(10, 22))], LongInput("chunk"),
                      field="input")
    assert fitted.counts == [2] and not any(is_raw(s) for s in fitted.seqs)


@pytest.mark.parametrize(
    ("model", "how", "ids", "param", "code"),
    [
        (_model(raw_rows=False), LongInput("chunk"), [1] * 20, "long_input", "unsupported"),
        (_model(), LongInput("chunk", overlap=6), [1] * 20, "chunk_overlap", "invalid_value"),
        (_model(), LongInput("chunk", most=15), [1] * 16, "input[0]", "input_too_large"),
        (_model(), LongInput("error"), [1] * 7, "input[0]", "input_too_long"),
    ],
)
def test_what_cannot_be_chunked_is_refused_by_name(
    model: Any, how: LongInput, ids: list[int], param: str, code: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        fit_long(model, [ids], how, field="input")
    assert (err.value.param, err.value.code) == (param, code)


def test_truncate_mode_cuts_as_before() -> None:
    fitted = fit_long(_model(), [list(range(10, 30))], LongInput("truncate"), field="input")
    assert fitted.counts is None and [list(s) for s in fitted.seqs] == [[101, *range(10, 16), 102]]
