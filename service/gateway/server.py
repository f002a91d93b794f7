"""Run the app: listen, and on SIGTERM/SIGINT drain so that nothing accepted is lost.

Shutdown sequence: readiness turns 503 at once; the listener keeps accepting for ``shutdown_grace_s``
(the platform is still removing this replica from its endpoints); then admitted work gets up to
``drain_timeout_s`` to finish; whatever is still waiting is answered 503; the listener closes and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

from ..logs import get_logger
from ..settings import Settings
from .app import create_app, drain
from .state import LIFECYCLE, MODELS, Phase

log = get_logger("coalesce.server")


async def serve(settings: Settings) -> None:
    app = create_app(settings)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=2048, reuse_address=True)
    await site.start()
    log.info("listening", host=settings.host, port=settings.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    life = app[LIFECYCLE]
    life.set(Phase.DRAINING)
    log.info("draining", grace_s=settings.shutdown_grace_s, timeout_s=settings.drain_timeout_s)
    # A second signal skips the grace delay.
    stop.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), settings.shutdown_grace_s)
    finished = await drain(app)
    for served in app[MODELS].models:
        await served.batcher.close()  # answers anything left with 503
    log.info("drained", complete=finished)
    await runner.cleanup()
    log.info("stopped")


def run(settings: Settings) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        asyncio.run(serve(settings))
    else:
        uvloop.run(serve(settings))
