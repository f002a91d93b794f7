"""Routes and the error dialect each one speaks.

Every route is registered through :func:`add_route`, which records its dialect (OpenAI's unless told
otherwise) by path; the error middleware asks :func:`dialect_of` how to answer a failed request and
renders it through ``dialects.render``. A handler never formats an error: it raises, and, where the
body decides the dialect (``/rerank``: ``texts`` is TEI's shape, ``documents`` Cohere's), it says so
with :func:`speak` before anything can fail on that shape. Dialects are kept by path, not by handler,
so aiohttp's own refusals on a known path (405 for a wrong method, 413 for a body over the limit) are
answered in that path's dialect too; a path nobody serves gets OpenAI's 404.

Each route also comes with its contract (``contract.Doc``), recorded here in registration order for
the published OpenAPI document (``openapi.py``): a route cannot be served without being described.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

from aiohttp import web

from ..dialects import Dialect
from .contract import Doc
from .state import Handler

DIALECTS: web.AppKey[dict[str, Dialect]] = web.AppKey("dialects")
SPOKEN: web.RequestKey[Dialect] = web.RequestKey("dialect")  # a handler's choice for this request


@dataclass(frozen=True, slots=True)
class Declared:
    """A registered route and its contract."""

    method: str
    path: str
    dialect: Dialect
    doc: Doc


ROUTES: web.AppKey[list[Declared]] = web.AppKey("routes")


def add_route(
    app: web.Application,
    method: str,
    path: str,
    handler: Handler,
    dialect: Dialect = Dialect.OPENAI,
    *,
    doc: Doc,
) -> None:
    """Serve ``method path`` with ``handler``; its errors (and aiohttp's on ``path``) in ``dialect``;
    ``doc`` is what the OpenAPI document says of it (its description, when ``doc`` has none, is the
    handler's docstring).

    Every method on one path speaks one dialect."""
    if DIALECTS not in app:
        app[DIALECTS] = {}
        app[ROUTES] = []
    known = app[DIALECTS].setdefault(path, dialect)
    if known is not dialect:
        raise ValueError(f"{path} already speaks {known}, not {dialect}")
    app.router.add_route(method, path, handler)
    if doc.description is None:
        doc = replace(doc, description=inspect.getdoc(handler) or doc.summary)
    app[ROUTES].append(Declared(method, path, dialect, doc))


def speak(request: web.Request, dialect: Dialect) -> None:
    """Answer this request's errors in ``dialect`` (a route whose shape the body tells)."""
    request[SPOKEN] = dialect


def dialect_of(request: web.Request) -> Dialect:
    """The dialect to answer ``request``'s error in: the handler's choice, else its path's."""
    chosen = request.get(SPOKEN)
    if chosen is not None:
        return chosen
    return request.app.get(DIALECTS, {}).get(request.path, Dialect.OPENAI)
