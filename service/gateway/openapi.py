"""``GET /openapi.json``: the published contract (OpenAPI 3.1), built from what the server runs on.

Built once, when the application is composed, from the routes as registered (``routing.ROUTES``:
each with its ``contract.Doc``) and from the msgspec Structs the server decodes requests into and
encodes answers from (``msgspec.json.schema_components``): no schema is written twice. Each route's
error statuses come from rendering its sample errors through ``dialects.render`` in every dialect the
route can speak, so a status, its body schema (OpenAI's, TEI's or Cohere's; ``oneOf`` where the body
decides) and its ``Retry-After`` follow the one mapping the error middleware uses. The document also
reflects this server's configuration: with ``--api-keys-file`` it declares the bearer scheme (open
routes excepted, see ``auth.is_open``), and ``X-Tenant`` only without keys, as only then is it read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from http import HTTPStatus
from typing import Any

import msgspec
from aiohttp import web

from ..dialects import Dialect, render
from ..errors import CoalesceError
from ..schemas import CohereError, ErrorResponse, TeiError, encoder
from .auth import KEYS, is_open
from .contract import QUEUE, UNAUTHORIZED, Doc, Text
from .routing import ROUTES, Declared, add_route

Json = dict[str, Any]
_REF = "#/components/schemas/{name}"
_ERROR_BODY = {Dialect.OPENAI: ErrorResponse, Dialect.TEI: TeiError, Dialect.COHERE: CohereError}
_MS = {"type": "string", "pattern": r"^[0-9]+\.[0-9]{3}$"}

# Response headers, by component name: (wire name, description, schema).
_HEADERS: dict[str, tuple[str, str, Json]] = {
    "RequestId": ("x-request-id", "The request's id: the caller's X-Request-ID, or one made here.",
                  {"type": "string"}),
    "TotalTime": ("x-total-time", "Milliseconds from the request's arrival to this response.", _MS),
    "QueueTime": ("x-queue-time", "Milliseconds the slowest of the request's inputs waited for a batch.",
                  _MS),
    "InferenceTime": ("x-inference-time", "Milliseconds of the longest forward pass among the request's "
                      "inputs (0 when every input came from the cache).", _MS),
    "ComputeTokens": ("x-compute-tokens", "Tokens the request's inputs counted, special tokens and "
                      "prompt included.", {"type": "string", "pattern": "^[0-9]+$"}),
    "ErrorCode": ("x-error-code", "The stable error code (the `code` of OpenAI's body), whatever the "
                  "dialect of the body.", {"type": "string", "pattern": "^[a-z0-9_]+$"}),
    "RetryAfter": ("Retry-After", "Whole seconds to wait before retrying (at least 1).",
                   {"type": "string", "pattern": "^[1-9][0-9]*$"}),
}
# Request headers, by component name: (wire name, description, schema).
_PARAMETERS: dict[str, tuple[str, str, Json]] = {
    "XRequestID": ("X-Request-ID", "An id for this request, echoed in `x-request-id` and the logs (empty: "
                   "one is made here).", {"type": "string"}),
    "XRequestTimeout": ("X-Request-Timeout", "The request's deadline in milliseconds, capped by the "
                        "server's --request-timeout-ms; a request that cannot meet it is refused (503), "
                        "one whose deadline passes while queued answers 504.",
                        {"type": "number", "exclusiveMinimum": 0}),
    "XPriority": ("X-Priority", "Order within the caller's tenant (case-insensitive); tenants share "
                  "the model by weight whatever their priorities.",
                  {"type": "string", "enum": ["high", "normal", "low"], "default": "normal"}),
    "XTenant": ("X-Tenant", "Whose work this is, for fair sharing between tenants (without API keys; "
                "with them the key names the tenant).",
                {"type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,64}$", "default": "default"}),
}


def _version() -> str:
    # Imported here: the document is built at its first request, and a start need not import this.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("coalesce")
    except PackageNotFoundError:
        return "unknown"


def _header_refs(*names: str) -> Json:
    return {_HEADERS[n][0]: {"$ref": f"#/components/headers/{n}"} for n in names}


def _alternatives(described: object) -> tuple[object, ...]:
    """A ``Doc`` type, or each of a tuple of them (a body or an answer of any of several shapes)."""
    return described if isinstance(described, tuple) else (described,)


def _schema(described: object, schemas: dict[int, Json]) -> Json:
    found = [schemas[id(t)] for t in _alternatives(described)]
    return found[0] if len(found) == 1 else {"anyOf": found}


def _content(answer: object, schemas: dict[int, Json]) -> Json:
    if isinstance(answer, Text):
        return {media: {"schema": {"type": "string"}} for media in answer.media_types}
    return {"application/json": {"schema": _schema(answer, schemas)}}


def _slug(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", path).rstrip("_") or "_root"


def _one_of(schemas: list[Json]) -> Json:
    return schemas[0] if len(schemas) == 1 else {"oneOf": schemas}


def _errors(route: Declared, fails: tuple[CoalesceError, ...], error_refs: dict[Dialect, Json]) -> Json:
    """Every error status ``route`` can answer: its body schema per dialect, the codes, the headers."""
    dialects = dict.fromkeys((route.dialect, *route.doc.speaks))
    bodies: dict[int, dict[Dialect, None]] = defaultdict(dict)
    codes: dict[int, dict[str, None]] = defaultdict(dict)
    retry: dict[int, set[bool]] = defaultdict(set)
    for err in fails:
        for dialect in dialects:
            rendered = render(err, dialect)
            bodies[rendered.status][dialect] = None
            codes[rendered.status][err.code or ""] = None
            retry[rendered.status].add("Retry-After" in rendered.headers)
    out: Json = {}
    for status in sorted(bodies):
        headers = _header_refs("ErrorCode", "RequestId", "TotalTime")
        if retry[status] == {True}:
            headers |= _header_refs("RetryAfter")
        elif True in retry[status]:  # some of this status's errors carry it, some do not
            _, description, schema = _HEADERS["RetryAfter"]
            headers["Retry-After"] = {"description": description, "required": False, "schema": schema}
        names = ", ".join(f"`{c}`" for c in codes[status])
        out[str(status)] = {
            "description": f"{HTTPStatus(status).phrase}. Codes in `x-error-code` include {names}.",
            "headers": headers,
            "content": {"application/json": {"schema": _one_of([error_refs[d] for d in bodies[status]])}},
        }
    return out


def _operation(route: Declared, schemas: dict[int, Json], error_refs: dict[Dialect, Json],
               keys_on: bool) -> Json:
    doc = route.doc
    secured = keys_on and not is_open(route.path)
    params: list[Json] = [{"$ref": "#/components/parameters/XRequestID"}]
    if doc.queued:
        params += [{"$ref": f"#/components/parameters/{n}"} for n in ("XRequestTimeout", "XPriority")]
        if not keys_on:
            params.append({"$ref": "#/components/parameters/XTenant"})
    params += [{"name": n, "in": "query", "required": False, "description": d, "schema": {"type": "string"}}
               for n, d in doc.query]
    for name in re.findall(r"{(\w+)}", route.path):
        schema: Json = {"type": "string"}
        if doc.path_enum:
            schema["enum"] = list(doc.path_enum)
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    ok_headers = _header_refs("RequestId", "TotalTime")
    if doc.queued:
        ok_headers |= _header_refs("QueueTime", "InferenceTime", "ComputeTokens")
    responses: Json = {"200": {"description": "OK", "headers": ok_headers,
                               "content": _content(doc.answer, schemas)}}
    for status, answer, description in doc.answers:
        responses[str(status)] = {"description": description, "content": _content(answer, schemas),
                                  "headers": _header_refs("RequestId", "TotalTime")}
    fails = (*doc.fails, *(QUEUE if doc.queued else ()), *((UNAUTHORIZED,) if secured else ()))
    responses |= {k: v for k, v in _errors(route, fails, error_refs).items() if k not in responses}
    op: Json = {
        "tags": [doc.tag],
        "summary": doc.summary,
        "description": doc.description or doc.summary,
        "operationId": route.method.lower() + _slug(route.path),
        "parameters": params,
    }
    if doc.body is not None:
        body = {"schema": _schema(doc.body, schemas)}
        op["requestBody"] = {"required": True, "content": {"application/json": body}}
    op["responses"] = responses
    if keys_on and not secured:
        op["security"] = []
    return op


def build(app: web.Application) -> Json:
    """The OpenAPI 3.1 document of ``app``'s routes (call once every route is registered)."""
    routes = app[ROUTES]
    keys_on = app[KEYS] is not None
    described: list[object] = [*_ERROR_BODY.values()]
    for route in routes:
        doc = route.doc
        for given in (doc.body, doc.answer, *(a for _, a, _ in doc.answers)):
            described += [t for t in _alternatives(given) if t is not None and not isinstance(t, Text)]
    found, components = msgspec.json.schema_components(described, ref_template=_REF)
    schemas = {id(t): s for t, s in zip(described, found, strict=True)}
    error_refs = {d: schemas[id(t)] for d, t in _ERROR_BODY.items()}
    paths: dict[str, Json] = defaultdict(dict)
    for route in routes:
        paths[route.path][route.method.lower()] = _operation(route, schemas, error_refs, keys_on)
    document: Json = {
        "openapi": "3.1.0",
        "info": {
            "title": "Coalesce",
            "version": _version(),
            "description": "Embedding micro-batching service: OpenAI's, TEI's and Cohere's routes, each "
            "answering errors in its own clients' shape. Every error response carries `x-error-code`; "
            "429 and 503 carry `Retry-After`.",
        },
        "tags": [{"name": t} for t in dict.fromkeys(r.doc.tag for r in routes)],
        "paths": dict(paths),
        "components": {
            "schemas": components,
            "headers": {n: {"description": d, "required": True, "schema": s}
                        for n, (_, d, s) in _HEADERS.items()},
            "parameters": {n: {"name": h, "in": "header", "required": False, "description": d, "schema": s}
                           for n, (h, d, s) in _PARAMETERS.items()},
        },
    }
    if keys_on:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "A key from --api-keys-file."}
        }
        document["security"] = [{"bearer": []}]
    return document


DOCUMENT: web.AppKey[list[bytes]] = web.AppKey("openapi_document")  # the encoded document, once built


async def openapi_json(request: web.Request) -> web.Response:
    """This document: every route, its request and response schemas, errors and headers."""
    document = request.app[DOCUMENT]
    if not document:  # built at the first request, not at start-up: a cold start does not wait for it
        document.append(encoder.encode(build(request.app)))
    return web.Response(body=document[0], content_type="application/json")


def publish(app: web.Application) -> None:
    """Register ``/openapi.json``; call after every other route (the document describes them all)."""
    add_route(app, "GET", "/openapi.json", openapi_json, doc=Doc(
        "This OpenAPI document", "Service", msgspec.Raw,
        description="The OpenAPI 3.1 document of this server, generated from its route table and wire "
        "schemas.",
    ))
    app[DOCUMENT] = []
