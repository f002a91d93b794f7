"""Log lines from several processes share one stderr; each line must reach it in one write."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog
from coalesce.service import logs


class Recorder(io.StringIO):
    """A stream that keeps each write apart, as an unbuffered pipe would see them."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    saved_config, saved_handlers = structlog.get_config(), logging.getLogger().handlers[:]
    saved_level = logging.getLogger().level
    yield
    structlog.configure(**saved_config)
    logging.getLogger().handlers[:] = saved_handlers
    logging.getLogger().setLevel(saved_level)


def test_every_log_line_is_one_whole_write_so_processes_sharing_stderr_never_interleave(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)  # here, not in a fixture: pytest's capture resets it per phase
    logs.configure("info", "json", process="gateway-1")
    logs.get_logger("t").info("listening", port=8080)
    logging.getLogger("some.library").warning("from the stdlib")
    assert len(stderr.writes) == 2, stderr.writes
    for w in stderr.writes:
        assert w.endswith("\n") and w.count("\n") == 1, w
        assert json.loads(w)["process"] == "gateway-1"
    assert json.loads(stderr.writes[0])["event"] == "listening"
