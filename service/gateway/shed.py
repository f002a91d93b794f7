"""Refusing from the head alone: under a standing queue, a queued route's request is answered 429
before its body is read, decoded or tokenised, and before the other middlewares run.

While the queue stands (:mod:`..batching.overload`) most arrivals are refused, and each refusal's CPU
is taken from the batches the admitted requests wait for. A route's own check (``check_room``) runs
after the body is read and decoded: cheap for a one-text query, not for a bulk body of megabytes. This
middleware decides first, on an estimate from the head: the tenant, priority and deadline headers
(:func:`.admission.admission`) and ``Content-Length`` at :data:`BODY_BYTES_PER_TOKEN` bytes a token (a
low estimate: JSON's quoting and keys count as text). Only while the one served model's queue stands:
otherwise, or with several models (the body names which), the route decides after decoding, on the
real counts, as before. A request it lets through is decided again on those.

It is the outermost middleware (tracing aside), and answers a refusal itself as ``observe`` and
``errors`` would have — the route's error dialect, ``x-request-id``, the request counted in the metrics
and logged at debug — without their per-request work (log context, in-flight gauge, an exception
through three middlewares), which is most of what a refusal cost beyond aiohttp's own handling. With
API keys configured it checks the key first, as ``authenticate`` does (and records the tenant, so
``authenticate`` does not hash it again); a request without a valid key, or with a malformed header,
goes on to the middlewares that answer it (401, 400).

An invalid request refused here is answered 429, not its 4xx: the 4xx comes once the overload passes
(a body is not validated unread).
"""

from __future__ import annotations

import time

from aiohttp import web

from ..errors import CoalesceError, InvalidRequest
from ..logs import get_logger
from .admission import admission
from .answers import error_response, request_id
from .auth import KEYS, TENANT, bearer_key
from .facade import ServedModel
from .models import MODELS
from .routing import dialect_of
from .state import METRICS, Handler

log = get_logger("coalesce.gateway")

# Routes whose body is a model's inputs (``contract.Doc.queued``): filled by ``create_app``.
QUEUED_PATHS: web.AppKey[frozenset[str]] = web.AppKey("queued_paths")

BODY_BYTES_PER_TOKEN = 5  # JSON of English text: ~4 characters a word piece, plus quotes and keys


@web.middleware
async def shed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer a queued route's request 429 from its head while the queue stands; else pass it on."""
    if request.method == "POST" and request.path in request.app[QUEUED_PATHS]:
        models = request.app[MODELS].models
        length = request.content_length
        if len(models) == 1 and length and models[0].standing:
            refused = _refusal(request, models[0], length)
            if refused is not None:
                return refused
    return await handler(request)


def _refusal(request: web.Request, model: ServedModel, length: int) -> web.Response | None:
    """The 429 for this request if the standing queue refuses it; None to let the middlewares and the
    route decide (including for a missing key or a malformed header, which they answer)."""
    t0 = time.perf_counter()
    keys = request.app[KEYS]
    if keys is not None:
        key = bearer_key(request, keys)
        if key is None:
            return None
        request[TENANT] = (key.tenant, key.weight)
    try:
        adm = admission(request)
    except InvalidRequest:
        return None
    total = max(1, length // BODY_BYTES_PER_TOKEN)
    try:
        # The first input's length is unknown: the smallest it can be (a decision that errs towards
        # admitting; the route decides again on the real counts).
        model.check_room(adm, min(total, model.specials + 1), total, 1, hold=False)  # the route holds
    except CoalesceError as err:
        resp = error_response(err, dialect_of(request))
        rid = request_id(request)
        resp.headers["x-request-id"] = rid
        elapsed = time.perf_counter() - t0
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].request_done(route, resp.status, elapsed)
        log.debug("request", request_id=rid, method=request.method, route=route, status=resp.status,
                  ms=round(elapsed * 1e3, 3))
        return resp
    return None
