"""``create_app(settings)``: the whole HTTP surface composed in one place.

One middleware, ``front``, runs every request's steps in one coroutine, in this order: ``shed``
(``shed.py``) answers a queued route's request 429 from its head under a standing queue; then it binds
the request id, counts in-flight requests and records metrics and the per-request log line; turns every
failure into the error shape of the dialect its route speaks (``routing``: OpenAI's, TEI's or
Cohere's), rendered by ``dialects.render``, the one mapping in the service; checks API keys
(``auth.check_key``); and reads the body within its deadline and size limit (``guard.read_body``).
They were five middlewares (``shed``, ``observe``, ``errors``, ``authenticate``, ``read_body``); as one,
a request no longer passes through four more coroutines (each resumed at every wake-up of the request),
four wrappers and as many lookups of the app's state. With tracing on, ``traced``
(``service/tracing.py``) runs outside it and opens the request's span in the caller's trace.
Connection-level limits (head deadline, connection cap, 431) live in ``guard.GuardedSite``, which
``server.serve`` listens with. Models load in the background (see ``models.load_models``) so the
listener answers ``/health`` at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .. import tracing
from ..engine.core import RunnerFactory, default_factory
from ..errors import (
    CoalesceError,
    InvalidRequest,
    MethodNotAllowed,
    RequestTimeout,
    RouteNotFound,
)
from ..logs import REQUEST_ID, get_logger
from ..metrics import Metrics
from ..schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    Health,
    ModelCard,
    ModelList,
    PhaseName,
    Readiness,
)
from ..settings import Settings
from . import classify, docs, embed_v2, openapi, rerank, sparse, tei, tei_meta
from .answers import error_response, request_id
from .auth import KEYS, KeyRing, check_key
from .contract import MODEL_ROUTE, TOKEN_IDS, Doc, Text
from .embeddings import create_embeddings
from .facade import BACKEND, LocalBackend
from .guard import HEAD_ANSWER, OWN_ANSWER, body_too_large, read_body
from .llm_pairs import check_instructions
from .models import MODELS, ModelRegistry
from .plain import plain_answer
from .responses import json_response
from .routing import ROUTES, add_route, dialect_of
from .shed import QUEUED_PATHS, head_refusal, shed
from .state import LIFECYCLE, METRICS, SETTINGS, Handler, Lifecycle, Phase

log = get_logger("coalesce.gateway")


@web.middleware
async def front(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request's steps (the module's docstring): ``shed``, then the rest observed and its failures
    answered in the route's dialect."""
    app = request.app
    refused = shed(request, app)
    if refused is not None:
        return refused
    metrics = app[METRICS]
    rid = request_id(request)
    bound = REQUEST_ID.set(rid)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    metrics.request_started()
    t0 = time.perf_counter()
    status = 499  # the client went away unless we get further
    try:
        try:
            check_key(request, app)
            await read_body(request, app)
            resp = await handler(request)
        except CoalesceError as err:
            resp = _failed(err, request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            resp = error_response(_from_http(exc, request), dialect_of(request))
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except Exception:
            # A broken invariant: loud in the log, a plain 500 to the client.
            log.exception("unhandled_error", route=request.path)
            internal = CoalesceError("Internal server error.", code="internal_error")
            resp = error_response(internal, dialect_of(request))
        status = resp.status
        resp.headers["x-request-id"] = rid
        resp.headers["x-total-time"] = f"{(time.perf_counter() - t0) * 1e3:.3f}"
        return resp
    finally:
        elapsed = time.perf_counter() - t0
        metrics.request_done(route, status, elapsed, started=True)
        log.debug("request", method=request.method, route=route, status=status, ms=round(elapsed * 1e3, 3))
        REQUEST_ID.reset(bound)


def _failed(err: CoalesceError, request: web.Request) -> web.Response:
    """A request's :class:`CoalesceError`, answered in its route's dialect."""
    if err.status >= 500:
        log.warning("request_failed", status=err.status, code=err.code, error=err.message)
    resp = error_response(err, dialect_of(request))
    if isinstance(err, RequestTimeout):
        resp.force_close()  # the rest of a late body will not be read: the connection ends here
    # Answered: its traceback goes, since the frames it holds hold what raised it (the future a refused
    # request awaited holds the error): a cycle the collector would trace, per refusal.
    err.__traceback__ = None
    return resp


_UNTRACED = frozenset({"/health", "/ready", "/metrics"})


@web.middleware
async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With tracing on (outermost): the request's server span, in the caller's trace when it sent
    ``traceparent``; its trace id is on every log line of the request, ``front``'s included."""
    tracer = tracing.active
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    if tracer is None or route in _UNTRACED:  # probes and scrapes would bury the requests' traces
        return await handler(request)
    with tracer.request(request.method, route, request.path, request.headers) as trace:
        status, rid = 499, request.headers.get("X-Request-ID", "")  # the client left, unless answered
        try:
            resp = await handler(request)
            status, rid = resp.status, resp.headers.get("x-request-id", rid)
            return resp
        finally:
            tracer.answered(trace, status, rid)


def _from_http(exc: web.HTTPException, request: web.Request) -> CoalesceError:
    if exc.status == 404:
        return RouteNotFound(f"No route {request.method} {request.path}.")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(
            f"Method {request.method} is not allowed on {request.path}.", allowed=exc.allowed_methods
        )
    if exc.status == 413:
        return body_too_large(request.app[SETTINGS].max_body_bytes)
    err = InvalidRequest(exc.reason or "Bad request.", code=f"http_{exc.status}")
    err.status = exc.status
    return err


async def health(request: web.Request) -> web.Response:
    """Liveness: the event loop answers. Cheap on purpose."""
    return json_response(Health())


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 once every model is loaded and warmed; 503 while starting, draining or failed."""
    life = request.app[LIFECYCLE]
    if life.phase is Phase.READY:
        return json_response(Readiness(status="ready", models=request.app[MODELS].names()))
    phase = cast(PhaseName, life.phase.value)
    return json_response(Readiness(status=phase, error=life.error or None), status=503)


async def metrics_route(request: web.Request) -> web.Response:
    """Every metric in Prometheus' text format: queue, batches, latency, cache, per model and route."""
    request.app[BACKEND].record()
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_models(request: web.Request) -> web.Response:
    """The served models, as OpenAI lists its own (``created``: when this process started)."""
    created = int(time.time() - (time.monotonic() - request.app[LIFECYCLE].started))
    cards = [ModelCard(id=name, created=created) for name in request.app[MODELS].names()]
    return json_response(ModelList(data=cards))


def create_app(settings: Settings, runner_factory: RunnerFactory | None = None) -> web.Application:
    """The application for ``settings``: in one process (the engine in it), or as one of ``--workers``
    gateways in front of the engine process. ``runner_factory`` replaces model loading (tests)."""
    metrics = Metrics()
    # Tracing adds its middleware only when on: off, the request path has no trace of it.
    middlewares = [front] if tracing.active is None else [traced, front]
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    registry = ModelRegistry()
    life = Lifecycle(metrics)
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[MODELS] = registry
    app[LIFECYCLE] = life
    app[KEYS] = KeyRing.load(settings.api_keys_file) if settings.api_keys_file else None
    if settings.role == "gateway":
        from .remote import RemoteBackend  # (the engine link: imported only by the processes that use it)

        app[BACKEND] = RemoteBackend(settings, metrics, registry, life)
    else:
        app[BACKEND] = LocalBackend(settings, metrics, registry, runner_factory or default_factory(settings))
    app.cleanup_ctx.append(_models)
    embeddings = Doc("Create embeddings (OpenAI)", "OpenAI", EmbeddingResponse, EmbeddingRequest,
                     fails=(*MODEL_ROUTE, *TOKEN_IDS), queued=True)
    add_route(app, "POST", "/v1/embeddings", create_embeddings, doc=embeddings)
    add_route(app, "POST", "/embeddings", create_embeddings, doc=embeddings)
    models = Doc("List the served models (OpenAI)", "OpenAI", ModelList)
    add_route(app, "GET", "/v1/models", list_models, doc=models)
    add_route(app, "GET", "/models", list_models, doc=models)
    add_route(app, "GET", "/health", health, doc=Doc("Liveness", "Service", Health))
    add_route(app, "GET", "/ready", ready, doc=Doc(
        "Readiness", "Service", Readiness, answers=((503, Readiness, "Starting, draining or failed."),)
    ))
    add_route(app, "GET", "/metrics", metrics_route, doc=Doc(
        "Prometheus metrics", "Service", Text("Prometheus' text exposition format.", ("text/plain",))
    ))
    classify.add_routes(app)  # /classify (OpenAI's errors), /predict (TEI's)
    rerank.add_routes(app)  # /rerank (TEI's or Cohere's errors, by shape), /v1/rerank, /v2/rerank (Cohere's)
    embed_v2.add_routes(app)  # /v2/embed (Cohere's errors)
    sparse.add_routes(app)  # /embed_sparse (TEI's errors)
    tei.add_routes(app)  # /embed, /embed_all, /similarity, / (TEI's errors)
    tei_meta.add_routes(app)  # /info, /tokenize, /decode (TEI's errors)
    docs.add_routes(app)  # /docs and its assets
    app[QUEUED_PATHS] = frozenset(d.path for d in app[ROUTES] if d.doc.queued and d.method == "POST")
    app[HEAD_ANSWER] = head_refusal(app)  # (the connection's own refusals: guard.GuardedSite)
    # The model routes' plain requests, answered by the connection below aiohttp's request path (plain.py).
    posted = {route.resource.canonical: route.handler for route in app.router.routes()
              if route.method == "POST" and route.resource is not None}
    app[OWN_ANSWER] = plain_answer(app, {path: posted[path] for path in app[QUEUED_PATHS]}, front)
    openapi.publish(app)  # /openapi.json, built from every route above: keep it last
    return app


async def _models(app: web.Application) -> AsyncIterator[None]:
    """Bring the models up in the background (the listener answers /health at once); on the way out,
    let admitted work finish, then answer what is left and stop."""
    loading = asyncio.get_running_loop().create_task(_start(app))
    yield
    if not loading.done():
        loading.cancel()
    backend = app[BACKEND]
    await backend.drain(app[SETTINGS].drain_timeout_s)
    await backend.close()
    app[MODELS].close()


async def _start(app: web.Application) -> None:
    life = app[LIFECYCLE]
    try:
        await app[BACKEND].start()
        check_instructions(app[MODELS].models, app[SETTINGS])
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        life.set(Phase.FAILED, f"{type(exc).__name__}: {exc}")
        log.exception("model_load_failed")
        return
    app[METRICS].startup_seconds.labels("ready").set(time.monotonic() - life.started)
    app[BACKEND].record()
    if life.phase is Phase.STARTING:
        life.set(Phase.READY)
        log.info("ready", models=app[MODELS].names(), seconds=round(time.monotonic() - life.started, 3))


async def drain(app: web.Application) -> bool:
    """Let every admitted request finish within the drain timeout; True if all did."""
    return await app[BACKEND].drain(app[SETTINGS].drain_timeout_s)
