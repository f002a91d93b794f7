"""Schemas, input validation and the error mapping: precise 4xx, the OpenAI error shape."""

from __future__ import annotations

import msgspec
import pytest
from coalesce.service.dialects import Dialect, render
from coalesce.service.errors import InvalidRequest, Overloaded, Unavailable
from coalesce.service.gateway.embeddings import vector
from coalesce.service.gateway.inputs import parse_inputs
from coalesce.service.schemas import EmbeddingRequest, decode


def test_decode_names_the_wrong_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode(b'{"input": ["a"], "encoding_format": "hex"}', EmbeddingRequest)
    assert info.value.param == "encoding_format"
    with pytest.raises(InvalidRequest) as info:
        decode(b'{"model": "m"}', EmbeddingRequest)
    assert info.value.param == "input"
    with pytest.raises(InvalidRequest) as info:
        decode(b'{"input": [1.5]}', EmbeddingRequest)
    assert info.value.param == "input[0]"


@pytest.mark.parametrize("body", [b"", b"{", b"[1,2", b"null"])
def test_malformed_bodies_are_invalid_requests(body: bytes) -> None:
    with pytest.raises(InvalidRequest):
        decode(body, EmbeddingRequest)


def test_inputs_of_every_accepted_form() -> None:
    assert parse_inputs("hi", 10) == (["hi"], [])
    assert parse_inputs(["a", "b"], 10) == (["a", "b"], [])
    assert parse_inputs([1, 2, 3], 10) == ([], [[1, 2, 3]])
    assert parse_inputs([[1], [2, 3]], 10) == ([], [[1], [2, 3]])


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([], "input"),
        ([""], "input[0]"),
        (["a", ""], "input[1]"),
        ([[1], []], "input[1]"),
        (["a", 1], "input"),
    ],
)
def test_bad_inputs_are_named(raw: list, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRequest) as info:
        parse_inputs(raw, 10)
    assert info.value.param == param
    assert info.value.status == 400


def test_too_many_inputs() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_inputs(["x"] * 11, 10)
    assert info.value.code == "too_many_inputs"


def test_error_shape_and_retry_after() -> None:
    rendered = render(InvalidRequest("nope", param="input"), Dialect.OPENAI)
    assert rendered.status == 400
    assert msgspec.to_builtins(rendered.body) == {
        "error": {
            "message": "nope",
            "type": "invalid_request_error",
            "param": "input",
            "code": "invalid_request",
        }
    }
    assert Overloaded("full", retry_after=0.2).headers() == {"Retry-After": "1", "retry-after-ms": "200"}
    assert Overloaded("full", retry_after=3.2).headers() == {"Retry-After": "4", "retry-after-ms": "3200"}
    assert Unavailable("x", retry_after=2).status == 503


def test_dimensions_truncate_and_renormalise() -> None:
    import numpy as np

    row = np.array([3.0, 4.0, 12.0], dtype=np.float32) / 13.0
    out = vector(row, 2)
    np.testing.assert_allclose(out, [0.6, 0.8], rtol=1e-6)
    assert vector(row, None) is row
