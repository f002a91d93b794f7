"""Run the app: listen, and on SIGTERM/SIGINT drain so that nothing accepted is lost.

Shutdown sequence: readiness turns 503 at once; the listener keeps accepting for ``shutdown_grace_s``
(the platform is still removing this replica from its endpoints); then admitted work gets up to
``drain_timeout_s`` to finish; whatever is still waiting is answered 503; the listener closes, the
spans still buffered (tracing on) are exported, and the process exits 0.

A process whose models cannot be served exits 1 so the platform restarts it: at once when they never
loaded; when a gateway loses its engine, it keeps answering 503 (``engine_unavailable``) until the
supervisor, which has seen the engine die, stops it.

The listener is a ``guard.GuardedSite``: head and body deadlines, the connection cap and the
file-descriptor limit apply here, in one process and in each ``--workers`` gateway alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence

from aiohttp import web

from .. import tracing
from ..allocator import freeze_startup_heap
from ..engine.core import RunnerFactory
from ..logs import get_logger
from ..settings import Settings
from .app import create_app, drain
from .facade import BACKEND
from .guard import GuardedSite, handler_kwargs
from .state import LIFECYCLE, Lifecycle, Phase

log = get_logger("coalesce.server")


async def serve(settings: Settings, runner_factory: RunnerFactory | None = None) -> int:
    """Serve until SIGTERM/SIGINT (then drain; 0), or until the models cannot be served (1).

    ``runner_factory`` replaces model loading (the gateway benchmark serves a null model)."""
    tracing.start(settings, f"gateway-{settings.worker_id}" if settings.role == "gateway" else "server")
    try:
        return await _serve(settings, runner_factory)
    finally:
        tracing.stop()  # the drain's last spans go out before the process does


async def _freeze_when_ready(life: Lifecycle) -> None:
    """Once the models are up, take what start-up built out of the collector's walks
    (``allocator.freeze_startup_heap``)."""
    await life.ready.wait()
    log.info("heap_frozen", **freeze_startup_heap())


async def _serve(settings: Settings, runner_factory: RunnerFactory | None) -> int:
    app = create_app(settings, runner_factory)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0, **handler_kwargs(settings))
    await runner.setup()  # starts loading the models
    life = app[LIFECYCLE]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.ensure_future(stop.wait())
    failing = asyncio.ensure_future(life.failed.wait())
    freezing = asyncio.ensure_future(_freeze_when_ready(life))
    if settings.reuse_port:
        # One of several processes on the port: the kernel hands connections to any listening one,
        # so listen only once ready (a loading sibling answers nothing rather than 503).
        readying = asyncio.ensure_future(life.ready.wait())
        await asyncio.wait({stopping, failing, readying}, return_when=asyncio.FIRST_COMPLETED)
        readying.cancel()
    listening = not (stopping.done() or failing.done())
    if listening:
        site = GuardedSite(runner, settings.host, settings.port, backlog=2048, reuse_port=settings.reuse_port)
        await site.start()
        log.info("listening", host=settings.host, port=settings.port, max_connections=site.connections.cap)
        await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    if failing.done():
        if life.ready.is_set():
            # Served, then lost its engine: answer 503 until told to stop (the supervisor is on it).
            log.error("serving_failed", error=life.error)
            await stopping
        else:
            # Nothing can be served: exit non-zero so the platform restarts us and shows the error,
            # rather than sit live but never ready.
            log.error("exiting", reason="model_load_failed", error=life.error)
        stopping.cancel()
        freezing.cancel()
        await runner.cleanup()
        return 1
    failing.cancel()
    freezing.cancel()  # (done, once ready)
    if not listening:  # stopped while loading: nobody was ever handed a connection
        await runner.cleanup()
        log.info("stopped", before="ready")
        return 0

    life.set(Phase.DRAINING)
    log.info("draining", grace_s=settings.shutdown_grace_s, timeout_s=settings.drain_timeout_s)
    # A second signal skips the grace delay.
    stop.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), settings.shutdown_grace_s)
    finished = await drain(app)
    await app[BACKEND].close()  # answers anything left with 503
    log.info("drained", complete=finished)
    await runner.cleanup()
    log.info("stopped")
    return 0


def run(settings: Settings, argv: Sequence[str] = (), runner_factory: RunnerFactory | None = None) -> int:
    """Serve ``settings``: one process, one of ``--workers``' processes (by ``role``), or, with
    ``workers`` > 1 in the top process, the supervisor of those processes, started from ``argv``."""
    if settings.workers < 1:  # auto, not decided: `coalesce serve` decides it before anything starts
        raise ValueError("--workers auto is decided at start-up (settings.auto_workers): pass run() a count")
    if settings.role == "all" and settings.workers > 1:
        from .workers import supervise

        return supervise(settings, argv)
    if settings.role == "engine":
        from ..engine.server import serve_engine

        return _run_loop(serve_engine(settings, runner_factory))
    return _run_loop(serve(settings, runner_factory))


def _run_loop(main: object) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]
