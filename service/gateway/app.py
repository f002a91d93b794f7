"""``create_app(settings)``: the whole HTTP surface composed in one place.

Middlewares (outermost first): ``observe`` binds the request id, counts in-flight requests and records
metrics and the per-request log line; ``errors`` turns every failure into the OpenAI error shape, the
one mapping in the service. Models load in the background (see ``models.load_models``) so the
listener answers ``/health`` at once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable

import structlog
from aiohttp import web
from coalesce.kernels.worker import DeviceThread
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import (
    CoalesceError,
    InvalidRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
    to_body,
)
from ..logs import get_logger
from ..metrics import Metrics
from ..schemas import ModelCard, ModelList, encoder
from ..settings import Settings
from . import classify, rerank, tei
from .admission import KEYS, KeyRing, authenticate
from .embeddings import create_embeddings
from .models import ModelRegistry, RunnerFactory, load_models
from .state import LIFECYCLE, METRICS, MODELS, SETTINGS, Handler, Lifecycle, Phase

log = get_logger("coalesce.gateway")


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=encoder.encode(body), status=status, content_type="application/json", headers=headers
    )


def error_response(err: CoalesceError) -> web.Response:
    return json_response(to_body(err), status=err.status, headers=err.headers())


# Request ids: a random per-process prefix and a counter: unique across replicas in practice, and
# a fraction of uuid4's cost on a path every request takes.
_RID_PREFIX = os.urandom(6).hex()
_rid_counter = itertools.count(1)


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS]
    rid = request.headers.get("X-Request-ID") or f"{_RID_PREFIX}{next(_rid_counter):010x}"
    structlog.contextvars.bind_contextvars(request_id=rid)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    metrics.inflight.inc()
    t0 = time.perf_counter()
    status = 499  # the client went away unless we get further
    try:
        resp = await handler(request)
        status = resp.status
        resp.headers["x-request-id"] = rid
        resp.headers["x-total-time"] = f"{(time.perf_counter() - t0) * 1e3:.3f}"
        return resp
    finally:
        elapsed = time.perf_counter() - t0
        metrics.inflight.dec()
        metrics.request_done(route, status, elapsed)
        log.debug("request", method=request.method, route=route, status=status, ms=round(elapsed * 1e3, 3))
        structlog.contextvars.unbind_contextvars("request_id")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except CoalesceError as err:
        if err.status >= 500:
            log.warning("request_failed", status=err.status, code=err.code, error=err.message)
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http(exc, request))
    except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
        raise
    except Exception:
        # A broken invariant: loud in the log, a plain 500 to the client.
        log.exception("unhandled_error", route=request.path)
        return error_response(CoalesceError("Internal server error.", code="internal_error"))


def _from_http(exc: web.HTTPException, request: web.Request) -> CoalesceError:
    if exc.status == 404:
        return RouteNotFound(f"No route {request.method} {request.path}.")
    if exc.status == 405:
        return MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
    if exc.status == 413:
        limit = request.app[SETTINGS].max_body_bytes
        return PayloadTooLarge(f"The request body exceeds this server's limit of {limit} bytes.")
    err = InvalidRequest(exc.reason or "Bad request.", code=f"http_{exc.status}")
    err.status = exc.status
    return err


async def health(request: web.Request) -> web.Response:
    """Liveness: the event loop answers. Cheap on purpose."""
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 once every model is loaded and warmed; 503 while starting, draining or failed."""
    life = request.app[LIFECYCLE]
    if life.phase is Phase.READY:
        return json_response({"status": "ready", "models": request.app[MODELS].names()})
    body: dict[str, object] = {"status": life.phase.value}
    if life.error:
        body["error"] = life.error
    return json_response(body, status=503)


async def metrics_route(request: web.Request) -> web.Response:
    _record_capture(request.app)
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _record_capture(app: web.Application) -> None:
    """Graph runners' capture statistics into the gauges (at start-up and at each scrape)."""
    for served in app[MODELS].models:
        stats = getattr(served.runner, "capture_stats", None)
        if stats is not None:
            app[METRICS].record_capture(served.info.name, stats)


async def list_models(request: web.Request) -> web.Response:
    created = int(time.time() - (time.monotonic() - request.app[LIFECYCLE].started))
    cards = [ModelCard(id=name, created=created) for name in request.app[MODELS].names()]
    return json_response(ModelList(data=cards))


def create_app(settings: Settings, runner_factory: RunnerFactory | None = None) -> web.Application:
    """The application for ``settings``. ``runner_factory`` replaces model loading (tests pass fakes)."""
    metrics = Metrics()
    app = web.Application(
        client_max_size=settings.max_body_bytes, middlewares=[observe, errors, authenticate]
    )
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[MODELS] = ModelRegistry()
    app[LIFECYCLE] = Lifecycle(metrics)
    app[KEYS] = KeyRing.load(settings.api_keys_file) if settings.api_keys_file else None
    app.cleanup_ctx.append(_model_context(runner_factory or _default_factory(settings)))
    app.router.add_post("/v1/embeddings", create_embeddings)
    app.router.add_post("/embeddings", create_embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_route)
    classify.add_routes(app)  # /classify, /predict
    rerank.add_routes(app)  # /rerank
    tei.add_routes(app)  # /embed, /info, /tokenize, /
    return app


def _default_factory(settings: Settings) -> RunnerFactory:
    from coalesce.kernels.buckets import GraphOptions
    from coalesce.kernels.loader import RunnerOptions, load_runner

    graphs = GraphOptions(
        enabled=settings.cuda_graphs,
        batch_sizes=settings.graph_batch_sizes,
        seq_lens=settings.graph_seq_lens,
        budget_s=settings.graph_capture_budget_s,
        budget_bytes=settings.graph_memory_budget_mb << 20,
    )
    options = RunnerOptions(
        device=settings.device, dtype=settings.dtype, graphs=graphs, backend=settings.backend
    )
    return lambda spec: load_runner(spec.path, spec.name, options, task=spec.task)


def _model_context(factory: RunnerFactory) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        device = DeviceThread()
        loading = asyncio.get_running_loop().create_task(_load(app, device, factory))
        yield
        if not loading.done():
            loading.cancel()
        await drain(app)
        for served in app[MODELS].models:
            await served.batcher.close()
            served.worker.close()
        await asyncio.get_running_loop().run_in_executor(None, device.close)

    return context


async def _load(app: web.Application, device: DeviceThread, factory: RunnerFactory) -> None:
    life = app[LIFECYCLE]
    try:
        await load_models(app[SETTINGS], app[MODELS], app[METRICS], device, factory)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        life.set(Phase.FAILED, f"{type(exc).__name__}: {exc}")
        log.exception("model_load_failed")
        return
    app[METRICS].startup_seconds.labels("ready").set(time.monotonic() - life.started)
    _record_capture(app)
    if life.phase is Phase.STARTING:
        life.set(Phase.READY)
        log.info("ready", models=app[MODELS].names(), seconds=round(time.monotonic() - life.started, 3))


async def drain(app: web.Application) -> bool:
    """Let every admitted request finish within the drain timeout; True if all did."""
    timeout = app[SETTINGS].drain_timeout_s
    results = await asyncio.gather(*(m.batcher.drain(timeout) for m in app[MODELS].models))
    return all(results)
