"""Python's switch interval (``--switch-interval-ms``): the forward's thread takes the interpreter lock
back between operators, and while the event loop runs Python it waited up to Python's 5 ms each time.
The server sets a shorter one before any thread starts; ``loadtests/lock_contention.py`` measures it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from coalesce.loadtests.lock_contention import forwards_beside
from coalesce.service.cli import set_switch_interval
from coalesce.service.settings import build


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    was = sys.getswitchinterval()
    yield
    sys.setswitchinterval(was)


def test_the_server_sets_its_switch_interval_and_zero_leaves_python_s() -> None:
    assert build([], environ={}).switch_interval_ms == 0.5
    assert set_switch_interval(build(["--switch-interval-ms", "0.5"], environ={}).switch_interval_ms) == 0.5
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    sys.setswitchinterval(0.005)
    python_s = build([], environ={"COALESCE_SWITCH_INTERVAL_MS": "0"}).switch_interval_ms
    assert set_switch_interval(python_s) == 5.0
    with pytest.raises(SystemExit, match="switch_interval_ms"):
        build(["--switch-interval-ms", "-1"], environ={})


def test_the_contention_probe_times_each_forward_and_puts_the_interval_back() -> None:
    sys.setswitchinterval(0.005)
    ran: list[str] = []

    def forward() -> None:
        ran.append(threading.current_thread().name)

    times = forwards_beside(forward, busy=1.0, interval_s=0.0005, n=4)
    assert len(times) == 4 and all(t >= 0 for t in times)
    assert ran == ["forward"] * 4  # on a thread of its own, beside the busy one
    assert sys.getswitchinterval() == pytest.approx(0.005)
