"""What a route promises its callers, declared where the route is registered.

Every route is registered through ``routing.add_route`` with a :class:`Doc`: its summary, the msgspec
type its request body decodes into, the type its answer encodes from, and the failures it can answer
with, as sample errors of the one hierarchy (``errors.py``). ``openapi`` turns these into the
published document, rendering each sample through ``dialects.render`` for the route's dialect, so the
statuses a route declares are the statuses that mapping gives and never a second copy of it. A route
cannot be added without one, and a test checks the router against the document.

The failure groups below are what each step of a request path can raise; a route lists the steps it
takes. ``queued`` marks a route that runs its inputs on a model through the queue: it reads the
admission headers, answers with the timing headers, and can be refused or time out on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dialects import Dialect
from ..errors import (
    CoalesceError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
)


def _invalid(code: str) -> InvalidRequest:
    return InvalidRequest(code, code=code)


@dataclass(frozen=True, slots=True)
class Text:
    """An answer that is not JSON: what it holds and its media types (a string in each)."""

    description: str
    media_types: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Doc:
    """One route's contract.

    ``answer`` and ``body`` are types msgspec can describe (Structs, lists and unions of them), a
    tuple of such types (any of them: shapes msgspec cannot put in one union), or a :class:`Text`;
    ``body`` None means the route reads no body. ``fails`` are samples of every error
    the route can raise (the groups below). ``speaks`` names dialects the body may switch the route's
    errors to besides its path's own (``/rerank``: Cohere's for ``documents``). ``answers`` are
    statuses other than 200 that are not errors (``/ready``'s 503). ``query`` is (name, description)
    of optional query parameters; ``path_enum`` the values of the one path parameter a templated path
    has. ``description`` defaults to the handler's docstring.
    """

    summary: str
    tag: str
    answer: object
    body: object | None = None
    fails: tuple[CoalesceError, ...] = ()
    queued: bool = False
    speaks: tuple[Dialect, ...] = ()
    answers: tuple[tuple[int, object, str], ...] = ()
    query: tuple[tuple[str, str], ...] = ()
    path_enum: tuple[str, ...] = ()
    description: str | None = None


# -- what each step of a request path can raise ------------------------------------------------------

#: A JSON body: not JSON, a field of the wrong type or missing, or over ``--max-body-bytes``.
DECODED: tuple[CoalesceError, ...] = (
    _invalid("invalid_json"),
    _invalid("invalid_type"),
    PayloadTooLarge("payload_too_large"),
)
#: Picking the model: an unknown name, one of the wrong task, none named where one is needed, or the
#: models not loaded yet (or failed, or the engine gone).
MODEL: tuple[CoalesceError, ...] = (
    ModelNotFound("model_not_found"),
    _invalid("wrong_task"),
    _invalid("missing_model"),
    _invalid("no_model_for_task"),
    Unavailable("loading", retry_after=1, code="loading"),
)
#: The inputs: empty, too many, too long without truncation, a chunked one past --max-input-tokens, a
#: value out of range (dimensions, top_n, ...), a prompt name the model lacks.
INPUTS: tuple[CoalesceError, ...] = (
    _invalid("empty_input"),
    _invalid("too_many_inputs"),
    _invalid("input_too_long"),
    _invalid("input_too_large"),
    _invalid("invalid_value"),
    _invalid("invalid_dimensions"),
    _invalid("unknown_prompt"),
)
#: Token ids outside the model's vocabulary.
TOKEN_IDS: tuple[CoalesceError, ...] = (_invalid("invalid_token_id"),)
#: A queued route (``Doc.queued``): a malformed X-Tenant, X-Priority or X-Request-Timeout; more
#: tokens than the queue can ever hold; the queue full at the door; a deadline it cannot meet or that
#: passed; the model failing on the batch.
QUEUE: tuple[CoalesceError, ...] = (
    _invalid("invalid_header"),
    _invalid("request_too_large"),
    Overloaded("queue_full", retry_after=1),
    Unavailable("deadline_unmeetable", retry_after=1, code="deadline_unmeetable"),
    DeadlineExceeded("deadline_exceeded"),
    InferenceFailed("inference_failed"),
)
#: With ``--api-keys-file``, on every route but the open ones.
UNAUTHORIZED = Unauthorized("invalid_api_key")

#: A model route's own steps (``queued`` adds the queue's): a JSON body, a model, its inputs.
MODEL_ROUTE: tuple[CoalesceError, ...] = (*DECODED, *MODEL, *INPUTS)
