"""gpu_check's service step against a stand-in service on loopback (``stub_service.py``): rows land in
the out directory as levels complete, the clients start together, the service's output goes to its
log, and a SIGTERM to gpu_check stops the service it started (in its own session, out of reach of the
signal ``timeout`` sends to gpu_check's process group)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from coalesce.loadtests.gpu import service_load

STUB = Path(__file__).with_name("stub_service.py")
STUB_CLIENT = Path(__file__).with_name("stub_load_client.py")


def _gpu_check(out: Path, events: Path, *flags: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "coalesce.loadtests.gpu.check", "--sections", "service", "--device", "cpu",
           "--out", str(out), "--service-cmd", f"{sys.executable} {STUB} --port {{port}}", *flags]
    return subprocess.Popen(cmd, env={**os.environ, "STUB_EVENTS": str(events)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def _events(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaped by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and not _gone(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_service_rows_come_from_clients_started_together(tmp_path: Path) -> None:
    out, events = tmp_path / "out", tmp_path / "events"
    proc = _gpu_check(out, events, "--service-seconds", "1", "--concurrency", "1,3")
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output
    rows = (out / "service.txt").read_text().splitlines()
    assert rows[0].startswith("service throughput")
    assert [row.split(":")[0].strip() for row in rows[1:]] == [
        "1 clients", "CPU per request", "3 clients", "CPU per request", "GPU memory used"]
    for row in rows[1:5:2]:
        rate = float(re.search(r"([\d,]+) embeddings/s", row).group(1).replace(",", ""))  # type: ignore[union-attr]
        assert rate > 0 and row.endswith("errors 0"), row
    for row in rows[2:5:2]:
        # One service process (the stub) and the client processes (as many as half the cores), each
        # with the CPU it spent.
        found = re.fullmatch(r"CPU per request: service ([\d,]+) µs \(([\d.]+) cores; event loop ([\d.]+)\), "
                             r"clients(?: ×\d)? ([\d,]+) µs \(([\d.]+) cores\)", row.strip())
        assert found, row
        assert int(found.group(4).replace(",", "")) > 0  # the clients spend CPU on every request
    assert rows[5].endswith("- (no nvidia-smi)") or "MiB" in rows[5]
    assert (out / "status.txt").read_text().strip() == "complete: exit 0"
    assert "stub service listening" in (out / "service-1.log").read_text()  # not in gpu_check's output
    assert "stub service listening" not in output
    assert not (out / "service.pgid").exists()
    assert _gone(int(_events(events)[0].split()[1]))


def test_the_clock_starts_when_every_client_is_connected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client processes that get ready at different times (``stub_load_client.py`` sleeps a random
    while first) are all told to go only once the last is ready, and the throughput is the sum of each
    client's own requests over its own run time."""
    events = tmp_path / "events"
    monkeypatch.setenv("STUB_EVENTS", str(events))
    monkeypatch.setattr(service_load, "_client_command",
                        lambda url, model, threads, seconds: [sys.executable, str(STUB_CLIENT), str(threads)])
    result = service_load._load("http://127.0.0.1:9", "stub", clients=3, seconds=1.0, procs=3)
    seen = [line.split() for line in _events(events)]
    ready = [float(t) for word, t, *_ in seen if word == "ready"]
    went = [float(t) for word, t, *_ in seen if word == "go"]
    assert len(ready) == len(went) == 3
    assert min(went) >= max(ready)
    # Each stub client reports its own count of requests over its own 2 s (see the stub).
    done = [int(parts[2]) for parts in seen if parts[0] == "go"]
    assert result.rate == pytest.approx(sum(d / 2.0 for d in done))
    assert (result.errors, len(result.latencies_ms)) == (0, sum(done))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_sigterm_during_the_service_step_stops_the_service_it_started(tmp_path: Path) -> None:
    out, events = tmp_path / "out", tmp_path / "events"
    proc = _gpu_check(out, events, "--service-seconds", "120", "--concurrency", "2")
    try:
        _wait_until(lambda: any(e.endswith("POST /v1/embeddings") for e in _events(events)), "the load")
        pid = int(_events(events)[0].split()[1])
        pgid = int((out / "service.pgid").read_text())
        assert pgid != os.getpgid(proc.pid)  # its own process group: a signal to gpu_check's misses it
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, output
    _wait_until(lambda: _gone(pid), "the stub service to go", timeout=10)
    assert not (out / "service.pgid").exists()
    assert (out / "status.txt").read_text().startswith("stopped in service: SystemExit")
    assert _processes_mentioning(f"service_load client http://127.0.0.1:{pgid}") == []  # no client left
    assert "stub service listening" in (out / "service-1.log").read_text()


def test_the_cpu_line_names_what_a_row_spent_by_role() -> None:
    """A split service: the engine's and the gateways' CPU per request answered and in cores over the
    clients' run, and each event loop's share (the one at 1.00 caps the row)."""
    result = service_load.LoadResult(
        rate=1000.0, errors=0, latencies_ms=[1.0] * 1000, window_s=2.0,
        cpu_s={"engine": (1, 2.5), "engine loop": (1, 2.0), "gateway": (4, 1.6), "gateway loop": (4, 1.2),
               "all": (2, 0.01), "all loop": (2, 0.01), "clients": (8, 0.4)})
    assert service_load.cpu_split(result) == (
        "engine 2,500 µs (1.25 cores; event loop 1.00), "
        "gateways ×4 1,600 µs (0.80 cores; event loop 0.15 each), clients ×8 400 µs (0.20 cores)")
