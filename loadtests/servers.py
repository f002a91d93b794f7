"""Servers under test as subprocesses on loopback: start, wait until ready, stop (SIGTERM, then kill).

Used by ``coalesce loadtest compare``, ``coalesce plan`` calibration, the bench script and the real
integration test. Each server runs in its own process group, so stopping it ends whatever it spawned
and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# `coalesce serve` exits with argparse's status 2 on flags it does not know.
USAGE_ERROR = 2


class ServerError(RuntimeError):
    """A server under test failed to start or died."""


class ServerUnsupported(ServerError):
    """The server rejected its command line (for example a flag from a later version)."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server; ``{port}`` in ``argv`` is replaced by the port it gets."""

    name: str
    argv: Sequence[str]
    ready_path: str = "/ready"
    embeddings_path: str = "/v1/embeddings"
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def coalesce_command() -> list[str]:
    """The ``coalesce`` console script of this environment (or the one on PATH)."""
    here = Path(sys.executable).parent / "coalesce"
    if here.exists():
        return [str(here)]
    found = shutil.which("coalesce")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from coalesce.service.cli import main; sys.exit(main())"]


def coalesce_spec(name: str, args: Sequence[str] = (), command: Sequence[str] | None = None) -> ServerSpec:
    """``coalesce serve`` on 127.0.0.1 with extra ``args``."""
    argv = [*(command or coalesce_command()), "serve", "--host", "127.0.0.1", "--port", "{port}", *args]
    # No shutdown grace: nothing routes to a loopback server, so it need not wait before draining.
    return ServerSpec(name=name, argv=argv, env={"HF_HUB_OFFLINE": "1", "COALESCE_SHUTDOWN_GRACE_S": "0"})


def stub_spec(name: str = "stub", *args: str) -> ServerSpec:
    """The aiohttp stub (``coalesce.loadtests.stub``) answering 384-wide vectors, as the CPU sections'
    control, with extra ``args`` (``--raw``: the same answers without aiohttp)."""
    argv = [sys.executable, "-m", "coalesce.loadtests.stub", "--port", "{port}", "--dim", "384", *args]
    return ServerSpec(name, argv)


def infinity_spec(binary: str, model_dir: str, served_name: str, name: str = "infinity") -> ServerSpec:
    """Infinity (``infinity_emb v2``) on CPU serving ``model_dir``; it answers ``POST /embeddings``."""
    argv = [
        binary,
        "v2",
        "--model-id",
        model_dir,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--device",
        "cpu",
        "--no-bettertransformer",
    ]
    return ServerSpec(
        name=name,
        argv=argv,
        ready_path="/health",
        embeddings_path="/embeddings",
        env={"DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1"},
    )


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class RunningServer:
    """A started server process; ``base_url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, spec: ServerSpec, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.spec, self.proc, self.port, self.log = spec, proc, port, log
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def url(self) -> str:
        """The embeddings URL."""
        return self.base_url + self.spec.embeddings_path

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                kind = ServerUnsupported if code == USAGE_ERROR else ServerError
                raise kind(f"{self.spec.name} exited with status {code}:\n{_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.base_url + self.spec.ready_path, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise ServerError(f"{self.spec.name} not ready after {timeout_s:g} s:\n{_tail(self.log)}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While a server runs, SIGTERM to us raises SystemExit, so the server is stopped on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running(spec: ServerSpec, log_dir: Path, ready_timeout_s: float = 300.0) -> Iterator[RunningServer]:
    """Start ``spec`` on a free port, wait for its ready route, and stop it on exit."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{spec.name}.log"
    argv = [a.replace("{port}", str(port)) for a in spec.argv]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **spec.env},
            start_new_session=True,
        )
    server = RunningServer(spec, proc, port, log)
    with _sigterm_as_exit():
        try:
            server.wait_ready(ready_timeout_s)
            yield server
        finally:
            server.stop()
