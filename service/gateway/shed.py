"""Refusing from the head alone: under a standing queue, a queued route's request is answered 429
before its body is read, decoded or tokenised.

While the queue stands (:mod:`..batching.overload`) most arrivals are refused, and each refusal's CPU
is taken from the batches the admitted requests wait for. A route's own check (``check_room``) runs
after the body is read and decoded: cheap for a one-text query, not for a bulk body of megabytes. This
middleware decides first, on an estimate from the head: the tenant, priority and deadline headers
(:func:`.admission.admission`) and ``Content-Length`` at :data:`BODY_BYTES_PER_TOKEN` bytes a token (a
low estimate: JSON's quoting and keys count as text). Only while the one served model's queue stands:
otherwise, or with several models (the body names which), the route decides after decoding, on the
real counts, as before. A request it lets through is decided again on those.

An invalid request refused here is answered 429, not its 4xx: the 4xx comes once the overload passes
(a body is not validated unread).
"""

from __future__ import annotations

from aiohttp import web

from .admission import admission
from .models import MODELS
from .state import Handler

# Routes whose body is a model's inputs (``contract.Doc.queued``): filled by ``create_app``.
QUEUED_PATHS: web.AppKey[frozenset[str]] = web.AppKey("queued_paths")

BODY_BYTES_PER_TOKEN = 5  # JSON of English text: ~4 characters a word piece, plus quotes and keys


@web.middleware
async def shed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Raise the standing queue's refusal for a queued route's request before its body is read."""
    if request.method == "POST" and request.path in request.app[QUEUED_PATHS]:
        models = request.app[MODELS].models
        length = request.content_length
        if len(models) == 1 and length and models[0].standing:
            total = max(1, length // BODY_BYTES_PER_TOKEN)
            model = models[0]
            # The first input's length is unknown: the smallest it can be (a decision that errs towards
            # admitting; the route decides again on the real counts).
            model.check_room(admission(request), min(total, model.specials + 1), total, 1)
    return await handler(request)
