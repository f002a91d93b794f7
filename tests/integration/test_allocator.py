"""The allocator real `coalesce serve` processes run on (service/allocator.py), read from what cannot be
faked: their memory maps, their environment and their start-up log, while a short alternating load runs.

Where jemalloc is installed (CI installs Debian's libjemalloc2 in .ci/run), the default server must have
re-executed itself onto it; where it is not, it must run on glibc, tuned, and say which package is
missing. Memory growth itself is not asserted here (it takes minutes and depends on the machine): the
bench's ``memory`` and ``soak`` sections measure it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coalesce.loadtests.scenario import Mode, Runner, Scenario, Target
from coalesce.loadtests.workload import Mix
from coalesce.service.allocator import (
    JEMALLOC_CONF,
    KERNEL_CACHE_VARIABLES,
    REEXEC_MARKER,
    find_jemalloc,
    mapped,
)

from ..conftest import REPO, free_port, metric, metrics_text, roles, wait_all_gateways, wait_ready

JEMALLOC = find_jemalloc()
NULL_MODEL = ["--runner-factory", "coalesce.loadtests.nullmodel:factory"]


class Server:
    """One `coalesce serve` on loopback, its log in a file (read after it stops)."""

    def __init__(self, log: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coalesce.service.cli", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port), "--shutdown-grace-s", "0", "--log-level", "info", *args],
                env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=REPO,
                stdout=subprocess.DEVNULL, stderr=out, start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def allocator_lines(self) -> list[dict[str, Any]]:
        """The start-up log's ``allocator`` lines (one per process)."""
        return self.lines("allocator")

    def lines(self, event: str) -> list[dict[str, Any]]:
        """The log's JSON lines of ``event``."""
        lines = []
        for raw in self.log.read_text(errors="replace").splitlines():
            if raw.startswith("{") and f'"{event}"' in raw:
                line = json.loads(raw)
                if line.get("event") == event:
                    lines.append(line)
        return lines


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Server:
        s = Server(tmp_path / f"server-{len(started)}.log", args, env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").partition("=")[::2] for p in pairs if p)


async def test_the_default_server_runs_on_jemalloc_where_installed_else_on_tuned_glibc(server: Any) -> None:
    s = server(["--cache-mb", "0"])
    await wait_ready(s.url, s.proc)
    # A short alternating load, bounded in count and time: the allocator must hold under it.
    scenario = Scenario(mode=Mode.ALTERNATE, rates=(10.0, 40.0), step_duration=2.0, duration=8.0, warmup=0.0,
                        mix=Mix.SHORT, timeout=30.0, seed=24)
    result = await Runner(Target(s.url + "/v1/embeddings"), scenario).run("allocator")
    assert sum(st.ok for st in result.steps) > 0
    found = mapped(maps(s.proc.pid))  # the pid the test started: exec keeps it
    resident = metric(await metrics_text(s.url), "process_resident_memory_bytes")
    s.stop()
    (line,) = s.allocator_lines()
    (returned,) = s.lines("memory_return")  # the engine hands freed memory back after batches
    if JEMALLOC is not None:
        assert found == ("jemalloc", JEMALLOC)
        assert (line["allocator"], line["how"], line["malloc_conf"]) == ("jemalloc", "re-exec", JEMALLOC_CONF)
        # its forwards' freed pages kept between batches, every arena purged every 10 s under load
        assert (returned["how"], returned["kept_between_batches"]) == ("jemalloc_purge", True)
    else:
        assert found is None
        assert (line["allocator"], line["how"]) == ("glibc", "tuned") and "libjemalloc2" in line["note"]
        assert (returned["how"], returned["kept_between_batches"]) == ("malloc_trim", False)
    assert resident > 50 << 20  # torch and the model: tens of MiB at least
    # oneDNN's kernel caches bounded before the model's first forward (--cpu-kernel-cache, default 64)
    assert line["kernel_caches"] == {name: os.environ.get(name, "64") for name in KERNEL_CACHE_VARIABLES}
    # Once ready, what start-up built (torch, the model: far more than 10,000 objects) is out of the
    # collector's full walks (allocator.freeze_startup_heap), once.
    (frozen,) = s.lines("heap_frozen")
    assert frozen["objects"] > 10_000


async def test_every_process_of_a_replica_runs_on_it_and_reports_its_memory(replica: Any) -> None:
    r = replica(2, NULL_MODEL)
    await wait_all_gateways(r)
    children = roles(r.proc.pid)
    pids = [r.proc.pid, *children["engine"], *children["gateway"]]
    for pid in pids:
        found = mapped(maps(pid))
        assert (found[0] if found else "glibc") == ("jemalloc" if JEMALLOC else "glibc"), pid
        if JEMALLOC:
            assert environ(pid)[REEXEC_MARKER] == JEMALLOC  # inherited, not re-executed again
    text = await metrics_text(r.url)
    for name in ("supervisor", "engine", "gateway-0", "gateway-1"):
        assert metric(text, "process_resident_memory_bytes", process=name) > 10 << 20, name


async def test_the_variable_turns_it_off(server: Any) -> None:
    s = server([*NULL_MODEL, "--cpu-kernel-cache", "0"], env={"COALESCE_ALLOCATOR": "system"})
    await wait_ready(s.url, s.proc)
    found = mapped(maps(s.proc.pid))
    env = environ(s.proc.pid)
    s.stop()
    assert found is None and REEXEC_MARKER not in env and "LD_PRELOAD" not in env
    (line,) = s.allocator_lines()
    assert (line["allocator"], line["how"]) == ("glibc", "untouched")
    assert line["kernel_caches"] == {n: os.environ[n] for n in KERNEL_CACHE_VARIABLES if n in os.environ}
