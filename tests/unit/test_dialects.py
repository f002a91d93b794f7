"""The error hierarchy rendered in each dialect: TEI's statuses and error types, Cohere's body, OpenAI's
unchanged, and what every dialect keeps (``Retry-After``, the stable code in ``x-error-code``)."""

from __future__ import annotations

import msgspec
import pytest
from coalesce.service.dialects import Dialect, render
from coalesce.service.errors import (
    CoalesceError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
)


@pytest.mark.parametrize(
    ("err", "status", "error_type"),
    [
        (InvalidRequest("empty", code="empty_input"), 400, "Empty"),
        (InvalidRequest("too many", code="too_many_inputs"), 413, "Validation"),
        (InvalidRequest("too big", code="request_too_large"), 413, "Validation"),
        (PayloadTooLarge("body"), 413, "Validation"),
        (InvalidRequest("long", code="input_too_long"), 422, "Validation"),
        (InvalidRequest("type", code="invalid_type"), 422, "Validation"),
        (InvalidRequest("json", code="invalid_json"), 422, "Validation"),
        (InvalidRequest("id", code="invalid_token_id"), 422, "Tokenizer"),
        (ModelNotFound("nope"), 404, "Validation"),
        (MethodNotAllowed("GET"), 405, "Validation"),
        (Unauthorized("key"), 401, "Validation"),
        (Overloaded("full", retry_after=2), 429, "Overloaded"),
        (Unavailable("late", retry_after=2, code="deadline_unmeetable"), 503, "Overloaded"),
        (Unavailable("draining", retry_after=1, code="draining"), 503, "Unhealthy"),
        (Unavailable("loading", retry_after=2, code="loading"), 503, "Unhealthy"),
        (DeadlineExceeded("expired"), 504, "Overloaded"),
        (InferenceFailed("boom"), 424, "Backend"),
        (CoalesceError("bug", code="internal_error"), 500, "Backend"),
    ],
)
def test_tei_status_and_error_type(err: CoalesceError, status: int, error_type: str) -> None:
    rendered = render(err, Dialect.TEI)
    assert rendered.status == status
    assert msgspec.to_builtins(rendered.body) == {"error": err.message, "error_type": error_type}
    assert rendered.headers["x-error-code"] == err.code


def test_cohere_body_is_the_message_and_the_status_ours() -> None:
    err = InvalidRequest("bad top_n", param="top_n", code="invalid_top_n")
    rendered = render(err, Dialect.COHERE)
    assert (rendered.status, msgspec.to_builtins(rendered.body)) == (400, {"message": "bad top_n"})
    assert rendered.headers == {"x-error-code": "invalid_top_n"}


def test_openai_body_keeps_type_param_and_code() -> None:
    rendered = render(ModelNotFound("no such model", param="model"), Dialect.OPENAI)
    assert rendered.status == 404
    assert msgspec.to_builtins(rendered.body) == {
        "error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}
    }


@pytest.mark.parametrize("dialect", list(Dialect))
def test_every_dialect_keeps_retry_after(dialect: Dialect) -> None:
    for err in (Overloaded("full", retry_after=2.2), Unavailable("draining", retry_after=1, code="draining")):
        assert render(err, dialect).headers["Retry-After"] == err.headers()["Retry-After"]


@pytest.mark.parametrize("dialect", list(Dialect))
def test_a_405_names_the_allowed_methods_in_every_dialect(dialect: Dialect) -> None:
    rendered = render(MethodNotAllowed("DELETE /embed", allowed=["POST", "GET", "POST"]), dialect)
    assert rendered.status == 405
    assert rendered.headers == {"Allow": "GET, POST", "x-error-code": "method_not_allowed"}
