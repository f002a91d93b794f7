"""Process trees from /proc (Linux; no psutil here): a ``coalesce serve`` process and, under
``--workers N``, its engine and gateway children. Used by the benches and by the tests that start
servers as a user would."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(pid: int | str, thread: int | None = None) -> list[str]:
    """The fields of ``/proc/PID/stat`` (or of one of its threads, ``/proc/PID/task/TID/stat``) after
    the command name (state first, parent second)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    return Path(path).read_text().rsplit(")", 1)[1].split()


def _cpu(fields: list[str]) -> float:
    """User plus system CPU seconds in a stat line's fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has spent."""
    return _cpu(_stat(pid))


def main_thread_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of ``pid``'s main thread alone (a server's event loop; its other
    threads run forwards, tokenisers and the allocator's)."""
    return _cpu(_stat(pid, pid))


def _parents() -> dict[int, tuple[int, str]]:
    """Every live process's parent and state."""
    out: dict[int, tuple[int, str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat(stat.parent.name)
            out[int(stat.parent.name)] = (int(fields[1]), fields[0])
        except (OSError, ValueError, IndexError):
            continue  # it exited between the listing and the read
    return out


def children(pid: int) -> list[int]:
    """``pid``'s live child processes (zombies excluded)."""
    return [child for child, (parent, state) in _parents().items() if parent == pid and state != "Z"]


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    parents = _parents()
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, (parent, _) in parents.items() if parent in frontier]
        found += frontier
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants that are still alive."""
    total = 0.0
    for p in tree(pid):
        try:
            total += cpu_seconds(p)
        except OSError:
            continue
    return total


def role(pid: int) -> str:
    """A ``coalesce serve`` process's ``--role`` (engine, gateway), or ``all`` for a single process."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--role") + 1].decode() if b"--role" in args else "all"
