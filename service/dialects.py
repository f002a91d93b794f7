"""The one error hierarchy (``errors.py``) as each peer's clients read it: status, body and headers.

A route speaks one dialect (``gateway/routing.py`` records which); the error middleware renders any
:class:`~coalesce.service.errors.CoalesceError` through :func:`render` and nothing else formats an
error. Three dialects:

* **OpenAI** (``/v1/embeddings``, ``/classify``, ...): ``{"error": {message, type, param, code}}`` at
  the error's own status, as the ``openai`` client expects;
* **TEI** (``/embed``, ``/info``, ``/rerank`` with ``texts``, ...): ``{"error": message, "error_type":
  ...}`` at TEI's statuses (table below), which ``huggingface_hub`` and LlamaIndex read;
* **Cohere** (``/v2/rerank``, ``/v1/rerank``, ``/rerank`` with ``documents``): ``{"message": ...}`` at
  the error's own status, which the ``cohere`` client hands over as an ``ApiError``'s ``body``.

Neither TEI's nor Cohere's body has room for our stable ``code`` without leaving the peer's schema, so
every error response, whatever its dialect, also carries it in the ``x-error-code`` header (OpenAI's
body keeps it too). ``Retry-After`` is kept in every dialect.

TEI's statuses and ``error_type`` for our errors:

=====================================================  ======  ============
error                                                  status  error_type
=====================================================  ======  ============
empty input or empty batch (``empty_input``)           400     Empty
too many inputs, body, request or input over limits    413     Validation
other invalid requests (types, values, too long)       422     Validation
token ids the tokenizer cannot decode                  422     Tokenizer
unknown model, route or method; bad API key            ours    Validation
queue full (``Overloaded``)                            429     Overloaded
cannot meet its deadline (``deadline_unmeetable``)     503     Overloaded
loading, draining, engine gone (``Unavailable``)       503     Unhealthy
deadline passed while waiting (``DeadlineExceeded``)   504     Overloaded
the model failed on the batch (``InferenceFailed``)    424     Backend
a broken invariant (internal error)                    500     Backend
=====================================================  ======  ============
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .errors import (
    CoalesceError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidRequest,
    Overloaded,
    PayloadTooLarge,
    Unavailable,
)
from .schemas import CohereError, ErrorDetail, ErrorResponse, TeiError, TeiErrorType

ERROR_CODE_HEADER = "x-error-code"


class Dialect(StrEnum):
    """Whose error contract a route speaks."""

    OPENAI = "openai"
    TEI = "tei"
    COHERE = "cohere"


@dataclass(frozen=True, slots=True)
class Rendered:
    """An error as one dialect answers it."""

    status: int
    body: ErrorResponse | TeiError | CohereError
    headers: dict[str, str]


# InvalidRequest codes TEI answers with its own statuses and types (any other code: 422 Validation).
_TEI_INVALID: dict[str, tuple[int, TeiErrorType]] = {
    "empty_input": (400, "Empty"),
    "too_many_inputs": (413, "Validation"),
    "request_too_large": (413, "Validation"),
    "input_too_large": (413, "Validation"),  # a chunked input past --max-input-tokens
    "invalid_token_id": (422, "Tokenizer"),
}


def tei_status(err: CoalesceError) -> tuple[int, TeiErrorType]:
    """TEI's status and ``error_type`` for ``err`` (the table in this module's docstring)."""
    if isinstance(err, InvalidRequest):
        return _TEI_INVALID.get(err.code or "", (422, "Validation"))
    if isinstance(err, PayloadTooLarge):
        return 413, "Validation"
    if isinstance(err, Overloaded):
        return 429, "Overloaded"
    if isinstance(err, Unavailable):
        return 503, "Overloaded" if err.code == "deadline_unmeetable" else "Unhealthy"
    if isinstance(err, DeadlineExceeded):
        return err.status, "Overloaded"
    if isinstance(err, InferenceFailed):
        return 424, "Backend"
    if err.status < 500:  # unknown model, route or method; a bad API key: the caller's to fix
        return err.status, "Validation"
    return err.status, "Backend"


def render(err: CoalesceError, dialect: Dialect) -> Rendered:
    """``err`` as ``dialect``'s clients expect it: status, body, and headers (``Retry-After`` when the
    error has one, ``x-error-code`` always)."""
    headers = err.headers()
    if err.code:
        headers[ERROR_CODE_HEADER] = err.code
    if dialect is Dialect.TEI:
        status, kind = tei_status(err)
        return Rendered(status, TeiError(error=err.message, error_type=kind), headers)
    if dialect is Dialect.COHERE:
        return Rendered(err.status, CohereError(message=err.message), headers)
    detail = ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code)
    return Rendered(err.status, ErrorResponse(error=detail), headers)
