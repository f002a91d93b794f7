"""What a request is answered with outside its route: an error in its dialect, and its request id.

Shared by the steps that answer a request themselves: the app's middleware (``app.front``) for every
request, ``shed`` for a refusal decided from the head before the rest of it runs; and, as whole HTTP
responses in bytes (:func:`raw_response`), by the connection's own answers (``guard``), written before
aiohttp makes a request of what arrived.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from email.utils import formatdate
from http import HTTPStatus

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


_date: tuple[int, str] = (0, "")


def http_date() -> str:
    """Now, as a ``Date`` header writes it (formatted once a second, as aiohttp does)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


def raw_response(status: int, body: bytes, headers: Mapping[str, str], *, close: bool,
                 content_type: str | None = "application/json") -> bytes:
    """A whole HTTP/1.1 response: for answers a connection writes itself. ``headers``: all but
    ``Content-Length`` (written from ``body``) and ``Content-Type`` when ``content_type`` is given (None:
    ``headers`` carry their own). ``close``: the connection ends after it (``Connection: close``); else
    it is kept alive, and the answer carries the ``Date`` aiohttp's own answers do."""
    head = _STATUS.get(status) or f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    lines = "".join(map(_HEADER.format, headers.items()))  # (no Python frame a header)
    end = "Connection: close\r\n\r\n" if close else f"Date: {http_date()}\r\n\r\n"
    return f"{head}Content-Length: {len(body)}\r\n{lines}{end}".encode("latin-1") + body


_STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_HEADER = "{0[0]}: {0[1]}\r\n"  # one (name, value) pair as a head's line
