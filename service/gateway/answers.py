"""What a request is answered with outside its route: an error in its dialect, and its request id.

Shared by the middlewares that answer a request themselves: ``errors`` and ``observe`` (``app``) for
every request, ``shed`` for a refusal decided from the head before either runs.
"""

from __future__ import annotations

import itertools
import os

from aiohttp import web

from ..dialects import Dialect, render
from ..errors import CoalesceError
from .responses import json_response

# Request ids: a random per-process prefix and a counter: unique across replicas in practice, and
# a fraction of uuid4's cost on a path every request takes.
_RID_PREFIX = os.urandom(6).hex()
_rid_counter = itertools.count(1)


def request_id(request: web.Request) -> str:
    """The caller's ``X-Request-ID``, else a new one."""
    return request.headers.get("X-Request-ID") or f"{_RID_PREFIX}{next(_rid_counter):010x}"


def error_response(err: CoalesceError, dialect: Dialect) -> web.Response:
    """``err`` answered as ``dialect``'s clients expect it."""
    rendered = render(err, dialect)
    return json_response(rendered.body, status=rendered.status, headers=rendered.headers)
