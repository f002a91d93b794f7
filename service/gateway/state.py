"""Application state: typed keys, set once in ``create_app`` and frozen after start-up."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from ..errors import Unavailable
from ..metrics import Metrics
from ..settings import Settings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Phase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """Where the process is between start and exit; drives /ready and admission."""

    def __init__(self, metrics: Metrics) -> None:
        self.phase = Phase.STARTING
        self.started = time.monotonic()
        self.error: str | None = None
        self.code = "load_failed"  # what a model route answers once FAILED
        self.failed = asyncio.Event()  # set when the models cannot be served: the process should exit
        self.ready = asyncio.Event()  # set once every model is loaded and warmed
        self._metrics = metrics

    def set(self, phase: Phase, error: str | None = None, code: str = "load_failed") -> None:
        self.phase = phase
        self.error = error
        self.code = code
        self._metrics.ready.set(1 if phase is Phase.READY else 0)
        if phase is Phase.FAILED:
            self.failed.set()
        elif phase is Phase.READY:
            self.ready.set()

    @property
    def serving(self) -> bool:
        """Whether model routes take work: when ready, and while draining (in-flight callers, grace)."""
        return self.phase in (Phase.READY, Phase.DRAINING)


SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)


def require_ready(request: web.Request) -> None:
    life = request.app[LIFECYCLE]
    if not life.serving:
        if life.phase is Phase.FAILED:
            raise Unavailable(f"The models cannot be served: {life.error}", retry_after=30, code=life.code)
        raise Unavailable("The model is still loading; retry shortly.", retry_after=2, code="loading")
