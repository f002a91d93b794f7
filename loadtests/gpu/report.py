"""A check run's output, made to survive the run being stopped (standard library only).

``Report`` writes each line as soon as it is known, to stdout and (with an out directory) to one file
per section, and records at the end how the run ended; ``sigterm_exits`` turns SIGTERM (what
``timeout`` sends) into ``SystemExit``, so ``finally`` blocks run and the end is recorded.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType


class Report:
    """Where the check's output goes: stdout, and with ``--out DIR`` one file per section (header,
    correctness, capture, latency, service; ``status.txt`` last), each line written and flushed as
    soon as it is known. A run stopped by its time limit keeps everything it finished."""

    def __init__(self, out: Path | None) -> None:
        self.out = out
        self.current: str | None = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "status.txt").write_text("running\n")

    def section(self, name: str, lines: Sequence[str]) -> None:
        """Start section ``name`` (``name``.txt under the out directory) with ``lines``."""
        if self.current is not None:
            print(flush=True)
        self.current = name
        if self.out is not None:
            (self.out / f"{name}.txt").write_text("")
        for line in lines:
            self.line(line)

    def line(self, text: str) -> None:
        """Add a line to the current section."""
        print(text, flush=True)
        if self.out is not None and self.current is not None:
            with open(self.out / f"{self.current}.txt", "a") as f:
                f.write(text + "\n")

    def status(self, text: str) -> None:
        """How the run ended (``status.txt``): ``complete: exit N``, or where it stopped and why."""
        print(f"gpu_check: {text}", file=sys.stderr, flush=True)
        if self.out is not None:
            (self.out / "status.txt").write_text(text + "\n")


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Inside, SIGTERM raises ``SystemExit(143)`` (main thread only), so ``finally`` blocks and context
    managers run: a process stopped by ``timeout`` still stops what it started and says where it was."""

    def exit_now(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    swap = HandlerSwap(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        swap.restore()


class HandlerSwap:
    """Install a signal handler (main thread only: elsewhere Python refuses, and this does nothing);
    ``restore`` puts the previous one back."""

    def __init__(self, signum: int, handler: Callable[[int, FrameType | None], None]) -> None:
        self._signum = signum
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signum, handler)

    def restore(self) -> None:
        if self._installed:
            signal.signal(self._signum, self._previous)
            self._installed = False
