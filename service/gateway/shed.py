"""Refusing from the head alone: under a standing queue, a queued route's request is answered 429
before its body is read, decoded or tokenised, and before the rest of the request's path runs.

While the queue stands (:mod:`..batching.overload`) most arrivals are refused, and each refusal's CPU
is taken from the batches the admitted requests wait for. A route's own check (``check_room``) runs
after the body is read and decoded: cheap for a one-text query, not for a bulk body of megabytes. This
middleware decides first, on an estimate from the head: the tenant, priority and deadline headers
(:func:`.admission.admission`) and ``Content-Length`` at :data:`BODY_BYTES_PER_TOKEN` bytes a token (a
low estimate for long texts: JSON's quoting and keys count as text; for a short query the envelope
makes it a high one). Only while the one served model's queue stands: otherwise, or with several
models (the body names which), the route decides after decoding, as before. A request it lets through
holds its room and is not checked again before tokenising: admission decides on the real counts, and
ends the hold.

It is the first step of the app's one middleware (``app.front``; tracing's aside), and answers a
refusal itself as the rest of it would have — the route's error dialect, ``x-request-id``, the request
counted in the metrics and logged at debug — without its per-request work (log context, in-flight
gauge, an exception raised and caught), which is most of what a refusal cost beyond aiohttp's own
handling. With API keys configured it checks the key first, as ``auth.check_key`` does (and records the
tenant, so that check does not hash it again); a request without a valid key, or with a malformed
header, goes on to the steps that answer it (401, 400).

**Answered by the connection** (:func:`head_refusal`, ``guard.HEAD_ANSWER``). Under an overload most
of a refusal's CPU is aiohttp's, not this check's: a request object, a task, the middleware chain, a
response and its writer, per refused request. So the connection itself asks first, on the parsed head,
whenever a request has arrived whole (head and body) on a keep-alive HTTP/1.1 connection with nothing
else in progress: a refused request is answered there with the same 429 (in bytes, keep-alive kept)
and never reaches aiohttp. Everything else, and every request the check lets through, goes on to the
middleware as before. With tracing on, refusals stay with the middleware, whose span records them.

An invalid request refused here is answered 429, not its 4xx: the 4xx comes once the overload passes
(a body is not validated unread).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from .. import tracing
from ..batching.admit import Hold
from ..dialects import Rendered, render
from ..errors import CoalesceError, InvalidRequest
from ..logs import get_logger
from ..schemas import encoder
from .admission import HELD, admission
from .answers import raw_response, request_id
from .auth import KEYS, TENANT, bearer_key
from .facade import ServedModel
from .guard import HeadAnswer, held_at_head
from .models import MODELS
from .responses import json_response
from .routing import dialect_of
from .state import METRICS

log = get_logger("coalesce.gateway")

# Routes whose body is a model's inputs (``contract.Doc.queued``): filled by ``create_app``.
QUEUED_PATHS: web.AppKey[frozenset[str]] = web.AppKey("queued_paths")

BODY_BYTES_PER_TOKEN = 5  # JSON of English text: ~4 characters a word piece, plus quotes and keys


def shed(request: web.Request, app: web.Application) -> web.Response | None:
    """The 429 a queued route's request is answered from its head while the queue stands, or None to
    pass it on (holding its room, when it was judged: ``admission.HELD``). The first step of the app's
    one middleware (``app.front``), before the others."""
    if request.method == "POST" and request.path in app[QUEUED_PATHS]:
        held = held_at_head(request)
        if held is not None:  # the connection's check passed it, and holds its room
            request[HELD] = held
            return None
        length = request.content_length
        if length and (model := _standing(app)) is not None:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            judged = _judge(request, model, length, route)
            if isinstance(judged, Hold):
                request[HELD] = judged
            elif judged is not None:
                rendered, rid = judged
                return json_response(rendered.body, status=rendered.status,
                                     headers={**rendered.headers, "x-request-id": rid})
    return None


def head_refusal(app: web.Application) -> HeadAnswer:
    """The connection's answer (``guard.HEAD_ANSWER``) to a request that arrived whole: the 429 of a
    standing queue, as :func:`shed` would answer it, in bytes; None for anything it would pass on, and
    for a request that wants the connection closed after it (aiohttp's to answer)."""
    def answer(message: RawRequestMessage, payload: StreamReader, protocol: Any) -> bytes | None:
        model = _standing(app)  # (first: the check every request pays at other times)
        if model is None:
            return None
        if message.method != "POST" or message.should_close or message.upgrade \
                or message.version != HttpVersion11 or tracing.active is not None \
                or message.path not in app[QUEUED_PATHS]:
            return None
        try:
            length = int(message.headers.get("Content-Length", ""))
        except ValueError:
            return None
        if length <= 0:
            return None
        judged = _judge(_Head(app, message, protocol), model, length, message.path)
        if isinstance(judged, Hold):
            protocol.head_held = judged  # (the middleware's to read: aiohttp handles this request next)
            return None
        if judged is None:
            return None
        rendered, rid = judged
        return raw_response(rendered.status, encoder.encode(rendered.body),
                            {**rendered.headers, "x-request-id": rid}, close=False)

    return answer


def _standing(app: web.Application) -> ServedModel | None:
    """The one served model while its queue stands, the only time a request is judged from its head;
    None otherwise (or with several models: the body names which)."""
    models = app[MODELS].models
    return models[0] if len(models) == 1 and models[0].standing else None


class _Head(dict[Any, Any]):
    """A request as the checks read it (its app, path, headers, connection, and the values they record
    on it), for one answered before aiohttp made a request of it."""

    __slots__ = ("app", "headers", "path", "protocol")

    def __init__(self, app: web.Application, message: RawRequestMessage, protocol: Any) -> None:
        super().__init__()
        self.app, self.path, self.headers, self.protocol = app, message.path, message.headers, protocol


def _judge(request: web.Request | _Head, model: ServedModel, length: int, route: str
           ) -> tuple[Rendered, str] | Hold | None:
    """The 429 for this request, rendered, and its request id, if the standing queue refuses it (counted
    and logged as ``app.front`` would). A :class:`Hold`: it passed, and its room is held from now until
    it is admitted, which ends the hold (the route does not check again: ``admission.HELD``). Checked
    once, at the head: checked again before tokenising, against a queue that each batch drains and
    each admission fills, it was a second toss of the coin that a queue held at its bound tosses at
    every check (most of the heads passed here unheld were refused there or at admission, after their
    bodies were read and tokenised). None: not judged here (a missing key or a malformed header, which
    the middlewares answer)."""
    t0 = time.perf_counter()
    req: web.Request = request  # type: ignore[assignment]  # (a _Head has all that the checks read)
    keys = req.app[KEYS]
    if keys is not None:
        key = bearer_key(req, keys)
        if key is None:
            return None
        req[TENANT] = (key.tenant, key.weight)
    try:
        adm = admission(req)
    except InvalidRequest:
        return None
    total = max(1, length // BODY_BYTES_PER_TOKEN)
    try:
        # The first input's length is unknown: the smallest it can be (a decision that errs towards
        # admitting; admission decides again on the real counts).
        held = model.check_room(adm, min(total, model.specials + 1), total, 1)
    except CoalesceError as err:
        rendered = render(err, dialect_of(req))
        rid = request_id(req)
        elapsed = time.perf_counter() - t0
        req.app[METRICS].request_done(route, rendered.status, elapsed)
        log.debug("request", request_id=rid, method="POST", route=route, status=rendered.status,
                  ms=round(elapsed * 1e3, 3))
        return rendered, rid
    return held
