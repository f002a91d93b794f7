"""Raw HTTP/1.1 over asyncio streams, for clients that misbehave on purpose (tests of ``guard``), and a
bystander that measures how a well-behaved client is served meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Answer:
    """What a raw client read: the status line's code, headers (lower-case names), body, and whether the
    server then closed (EOF) rather than reset the connection."""

    status: int
    headers: dict[str, str]
    body: bytes
    eof: bool = False

    def json(self) -> Any:
        return json.loads(self.body)


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)


async def read_answer(reader: asyncio.StreamReader, timeout: float = 10.0, then_eof: bool = True) -> Answer:
    """One response; with ``then_eof``, also wait (within ``timeout``) for the server to close."""
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        answer = Answer(status, headers, body)
        if then_eof:
            answer.eof = await reader.read(1) == b""
        return answer


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Bystander:
    """A polite client posting one small embedding every ``every`` seconds on fresh connections while a
    hostile one works: its statuses and latencies are what everyone else saw meanwhile."""

    url: str
    model: str = "fake"
    every: float = 0.1
    statuses: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=30)
        for i in range(100_000):  # bounded; stopped long before
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            body = {"model": self.model, "input": f"bystander {i}"}
            async with (
                aiohttp.ClientSession(timeout=timeout) as s,
                s.post(self.url + "/v1/embeddings", json=body) as r,
            ):
                await r.read()
                self.statuses.append(r.status)
            self.latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(self.every)

    def start(self) -> Bystander:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def finish(self) -> None:
        """Stop, and check that every request was answered 200 in normal time."""
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, 60)
        assert self.statuses, "the bystander sent nothing"
        assert set(self.statuses) == {200}, self.statuses
        assert max(self.latencies) < 2.0, f"a bystander waited {max(self.latencies):.2f} s"

    def summary(self) -> str:
        lat = sorted(self.latencies)
        return f"{len(lat)} requests, all {set(self.statuses)}, max {lat[-1] * 1e3:.0f} ms" if lat else "none"


async def trickle(
    port: int, first: bytes, drip: bytes, every: float, seconds: float, warm: bool = False
) -> tuple[Answer, float, float]:
    """Send ``first``, then ``drip`` every ``every`` s for up to ``seconds``, reading meanwhile (after one
    polite request on the same connection if ``warm``). Returns the answer, and the seconds from the
    first byte to the answer and to the server's close."""
    reader, writer = await connect(port)
    if warm:
        writer.write(request("GET", "/health"))
        assert (await read_answer(reader, then_eof=False)).status == 200
    t0 = time.monotonic()
    writer.write(first)
    answer = asyncio.ensure_future(read_answer(reader, timeout=seconds + 10, then_eof=False))
    try:
        for _ in range(int(seconds / every)):
            if answer.done():
                break
            await asyncio.sleep(every)
            if not answer.done():
                writer.write(drip)
        got = await answer
        answered = time.monotonic() - t0
        got.eof = await asyncio.wait_for(reader.read(1), 10) == b""
        return got, answered, time.monotonic() - t0
    finally:
        answer.cancel()
        writer.close()
