"""Plain requests answered below aiohttp's request path: the connection's own answer to the model routes.

For each request aiohttp makes a ``Request`` (its URL, match info, payload reader), a task, a
``Response`` with a writer that prepares its headers and writes twice, and runs the app's middleware
through its dispatcher: a third of the Python a one-sentence embedding request runs in one process
(``python -m coalesce.loadtests.gateway_ops``). A request that arrived whole (head and body) on a
keep-alive HTTP/1.1 connection with nothing else in progress, to a route the app answers itself
(:func:`plain_answer`'s ``handlers``: every model route, whose body is a model's inputs — OpenAI's,
TEI's, Cohere's, classification and rerank alike; ``app.create_app``), is taken by the connection
(``guard.OWN_ANSWER``): it runs the same steps, the app's middleware (``app.front``: the head's
overload check, request id, metrics, the key check, the body limit, errors in the route's dialect)
around the route's own handler, on a :class:`PlainRequest` made from the parsed message, and its
response goes out as one write of bytes. Nothing of what a request gets changes but the ``Server``
header aiohttp adds.

Everything else goes to aiohttp as before: another route or method, a body still arriving, a request
pipelined behind another, HTTP/1.0, ``Connection: close``, ``Expect``, a chunked body, and every
request while tracing is on (its span is the ``traced`` middleware's). While a taken request is being
answered, what arrives on its connection waits, read once the answer is written (``guard``), so answers
go out in the order their requests came; a client that leaves cancels it, as aiohttp cancels a handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from .. import tracing
from ..dialects import render
from ..errors import CoalesceError
from ..logs import get_logger
from ..schemas import encoder
from .answers import raw_response
from .guard import OwnAnswer, Taken
from .routing import dialect_of
from .state import Handler

log = get_logger("coalesce.gateway")
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


class PlainRequest(dict[Any, Any]):
    """A request the connection took, as the app's middleware and a route's handler read it: its app,
    method, path, headers, route, body (already whole) and connection (:class:`guard.Taken`), and the
    values they record on it (a dict, as aiohttp's request is a mapping)."""

    __slots__ = ("_body", "app", "content", "content_length", "headers", "match_info", "path", "protocol")
    method = "POST"
    body_exists = True

    def __init__(self, app: web.Application, message: RawRequestMessage, payload: StreamReader, body: bytes,
                 length: int, match_info: object, protocol: Taken) -> None:
        super().__init__()
        self.app, self.path, self.headers, self.match_info = app, message.path, message.headers, match_info
        self.content, self._body, self.content_length, self.protocol = payload, body, length, protocol

    async def read(self) -> bytes:
        return self._body


def plain_answer(app: web.Application, handlers: Mapping[str, Handler], middleware: Middleware) -> OwnAnswer:
    """The connection's taking of a plain ``POST`` to one of ``handlers``' paths (see the module's
    docstring), answered by ``middleware`` around the path's handler; None for anything else."""
    routes = {path: (handler, _match_info(path)) for path, handler in handlers.items()}

    def take(message: RawRequestMessage, payload: StreamReader, protocol: Any
             ) -> Coroutine[Any, Any, tuple[bytes, bool]] | None:
        route = routes.get(message.path)
        if route is None or message.method != "POST" or message.should_close or message.upgrade \
                or message.version != HttpVersion11 or tracing.active is not None:
            return None
        headers = message.headers
        if hdrs.TRANSFER_ENCODING in headers or hdrs.EXPECT in headers:
            return None
        try:
            length = int(headers.get(hdrs.CONTENT_LENGTH, ""))
        except ValueError:
            return None
        if length <= 0 or payload.exception() is not None:
            return None
        body = payload.read_nowait(-1)  # (whole: the payload is at its end, its Content-Length long)
        handler, match_info = route
        request = PlainRequest(app, message, payload, body, length, match_info, Taken(protocol))
        return _answer(cast(web.Request, request), handler, middleware)

    return take


def _match_info(path: str) -> object:
    """What the middleware reads of a request's route: aiohttp's match info, its resource's canonical
    path."""
    return SimpleNamespace(route=SimpleNamespace(resource=SimpleNamespace(canonical=path)))


async def _answer(request: web.Request, handler: Handler, middleware: Middleware) -> tuple[bytes, bool]:
    """``request`` answered by ``middleware`` around ``handler``: the HTTP response in bytes, and
    whether the connection ends after it."""
    resp = await middleware(request, handler)
    body = resp.body if isinstance(resp, web.Response) else None
    if not isinstance(body, (bytes, bytearray)):  # (streamed: no model route's answer; aiohttp's would do)
        log.error("own_answer_not_bytes", route=request.path, response=type(resp).__name__,
                  body=type(body).__name__)
        rendered = render(CoalesceError("Internal server error.", code="internal_error"), dialect_of(request))
        answer = raw_response(rendered.status, encoder.encode(rendered.body), rendered.headers, close=True)
        return answer, True
    body = bytes(body)
    close = resp.keep_alive is False
    headers: Mapping[str, str] = resp.headers
    if hdrs.CONTENT_LENGTH in headers:  # (written from the body; none of the routes sets it)
        headers = {k: v for k, v in headers.items() if k != hdrs.CONTENT_LENGTH}
    # (aiohttp writes a bytes body without a type as application/octet-stream)
    content_type = None if hdrs.CONTENT_TYPE in headers else "application/octet-stream"
    return raw_response(resp.status, body, headers, close=close, content_type=content_type), close
