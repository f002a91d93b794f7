"""`coalesce serve --workers 2`: two real processes share the port, every answer is right whichever
worker gives it, one scrape reports the whole replica, SIGTERM stops both cleanly, and a worker that
dies takes the replica down instead of leaving it half-served."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from ..conftest import free_port
from .test_shutdown import wait_ready

MODEL = "all-MiniLM-L6-v2"


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc; no psutil here)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.fixture
def supervisor() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    exe = Path(sys.executable).parent / "coalesce"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # the supervisor splits the cores between its workers
    proc = subprocess.Popen(
        [str(exe), "serve", "--workers", "2", "--host", "127.0.0.1", "--port", str(port),
         "--shutdown-grace-s", "0.5", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    yield proc, f"http://127.0.0.1:{port}"
    for child in children_of(proc.pid):
        os.kill(child, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


async def wait_all_workers(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """Ready means at least one worker listens; wait until two distinct workers have answered."""
    await wait_ready(url, proc, timeout)
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        while len(seen) < 2 and time.monotonic() < deadline:
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    seen.add(r.headers["x-request-id"][:12])  # the per-process id prefix
            await asyncio.sleep(0.05)
    assert len(seen) == 2, "the second worker never started listening"


async def test_two_workers_share_the_port_and_answer_as_one(supervisor: Any, st_model: Any) -> None:
    proc, url = supervisor
    await wait_all_workers(url, proc)
    assert len(children_of(proc.pid)) == 2

    texts = [f"worker test sentence number {i}" for i in range(24)]
    workers: set[str] = set()
    rows = []
    # A fresh connection per request, so the kernel spreads them over both workers' sockets.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for text in texts:
            async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": text}) as r:
                assert r.status == 200
                workers.add(r.headers["x-request-id"][:12])
                rows.append((await r.json())["data"][0]["embedding"])
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    assert len(workers) == 2, "both workers must have served"
    want = st_model.encode(texts, normalize_embeddings=True)
    cos = np.sum(np.asarray(rows) * want, axis=1)
    assert cos.min() > 0.9999

    def value(line_start: str) -> float:
        lines = [ln for ln in metrics.splitlines() if ln.startswith(line_start)]
        assert len(lines) == 1, line_start
        return float(lines[0].rsplit(" ", 1)[1])

    # One scrape, whichever worker answered it, counts what both served.
    assert value('coalesce_requests_total{route="/v1/embeddings",status="200"}') == 24
    assert value('coalesce_inputs_total{model="all-MiniLM-L6-v2"}') == 24
    assert value("coalesce_ready ") == 1

    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 60) == 0
    assert children_of(proc.pid) == []


async def test_a_worker_that_dies_takes_the_replica_down(supervisor: Any) -> None:
    proc, url = supervisor
    await wait_all_workers(url, proc)
    victim, survivor = children_of(proc.pid)
    os.kill(victim, signal.SIGKILL)
    assert await asyncio.to_thread(proc.wait, 60) == 1, "the platform must see the failure"
    assert not Path(f"/proc/{survivor}").exists(), "the surviving worker must be stopped too"
