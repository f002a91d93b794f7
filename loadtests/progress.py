"""A one-line progress bar on stderr while a step runs."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TextIO

from coalesce.loadtests.engine import Recorder, alongside

_WIDTH = 24


def render(label: str, elapsed: float, total: float, rec: Recorder, rps: float, p99_ms: float | None) -> str:
    frac = min(1.0, elapsed / total) if total > 0 else 1.0
    bar = "#" * int(frac * _WIDTH) + "." * (_WIDTH - int(frac * _WIDTH))
    inflight = rec.dispatched - rec.finished
    p99 = f"{p99_ms:7.1f}ms" if p99_ms is not None else "      -  "
    return (
        f"{label:<14.14} [{bar}] {elapsed:5.1f}/{total:.0f}s"
        f"  sent {rec.dispatched:>7}  done {rec.finished:>7}"
        f"  inflight {inflight:>5}  failed {rec.failed:>5}  {rps:8.1f} req/s  p99 {p99}"
    )


class Progress:
    """Redraws the line every ``interval`` seconds while the step runs; a no-op when disabled."""

    def __init__(self, enabled: bool, stream: TextIO = sys.stderr, interval: float = 0.5) -> None:
        self._enabled = enabled
        self._stream = stream
        self._interval = interval

    @contextlib.asynccontextmanager
    async def show(self, label: str, rec: Recorder, t0: float, total: float) -> AsyncIterator[None]:
        if not self._enabled:
            yield
            return
        try:
            async with alongside(self._draw(label, rec, t0, total)):
                yield
        finally:
            self._stream.write("\n")
            self._stream.flush()

    async def _draw(self, label: str, rec: Recorder, t0: float, total: float) -> None:
        loop = asyncio.get_running_loop()
        seen = 0
        last = loop.time()
        while True:
            await asyncio.sleep(self._interval)
            now = loop.time()
            n = rec.finished
            recent = sorted(
                d - s
                for d, s, st in zip(rec.done[seen:n], rec.sched[seen:n], rec.status[seen:n], strict=True)
                if st == 200
            )
            p99 = recent[min(len(recent) - 1, int(0.99 * len(recent)))] * 1000 if recent else None
            rps = (n - seen) / (now - last) if now > last else 0.0
            seen, last = n, now
            self._stream.write("\r" + render(label, max(0.0, now - t0), total, rec, rps, p99))
            self._stream.flush()
