"""The one closed error hierarchy. Each class fixes our HTTP status and OpenAI ``type``; how each peer's
clients see an error (OpenAI's, TEI's or Cohere's body and status) is mapped in ``dialects.py``, the one
place that formats errors.

Anything raised in a request path that is not a :class:`CoalesceError` is a bug: the error middleware
logs it loudly and answers 500.
"""

from __future__ import annotations

from collections.abc import Iterable


class CoalesceError(Exception):
    """An error the client is told about. Subclasses fix the HTTP status and the OpenAI ``type``."""

    status: int = 500
    type: str = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def headers(self) -> dict[str, str]:
        """Extra response headers (``Retry-After`` for overload)."""
        return {}


class InvalidRequest(CoalesceError):
    """Malformed JSON, wrong types, empty or oversized input: the caller must change the request."""

    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class Unauthorized(CoalesceError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFound(CoalesceError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class RouteNotFound(CoalesceError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class MethodNotAllowed(CoalesceError):
    """A method the path does not serve; ``allowed`` (the ones it does) go in ``Allow``, as RFC 9110
    requires of a 405."""

    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"

    def __init__(self, message: str, *, allowed: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.allowed = sorted(set(allowed))

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


class PayloadTooLarge(CoalesceError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class RequestTimeout(CoalesceError):
    """The client took too long to send its request head or body; the connection is closed after."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


class HeadersTooLarge(CoalesceError):
    """The request line, a header field, or the number of fields is over the server's limits."""

    status = 431
    type = "invalid_request_error"
    default_code = "headers_too_large"


class RetryableError(CoalesceError):
    """An error the caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        # Retry-After takes whole seconds (rounded up; never 0 s). retry-after-ms carries the exact
        # hint: the openai client (and ours) read it first, so callers refused together come back
        # paced as the server planned, not all at the same whole second.
        return {
            "Retry-After": str(max(1, round(self.retry_after + 0.4999))),
            "retry-after-ms": str(max(1, round(self.retry_after * 1e3))),
        }


class Overloaded(RetryableError):
    """The queue bound would be exceeded: rejected at the door, before any work is done."""

    status = 429
    type = "rate_limit_error"
    default_code = "queue_full"


class Unavailable(RetryableError):
    """Not ready, draining, or a request that cannot meet its deadline."""

    status = 503
    type = "server_error"
    default_code = "unavailable"


class DeadlineExceeded(CoalesceError):
    """The request's deadline passed before its result was ready; it was not computed."""

    status = 504
    type = "timeout_error"
    default_code = "deadline_exceeded"


class InferenceFailed(CoalesceError):
    """The model runner raised on a batch: the requests of that batch, and only those, get this."""

    status = 500
    type = "server_error"
    default_code = "inference_failed"

