"""The end-to-end row of ``gpu_check``: closed-loop load on a running service, standard library only.

``kernels/`` never imports aiohttp, and the GPU machine lacks the load generator's dependencies, so
this drives the service with ``http.client`` keep-alive connections: one thread per concurrent client,
spread over several processes so the client's GIL is not the bottleneck. Each request embeds one short
input (``/v1/embeddings``, base64, the official client's default). Closed loop measures throughput;
latency figures here hide queueing (use the open-loop load generator for latency).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

_TEXT = "the quick brown fox jumps over the lazy dog"
_SERVICE_DEPS = ("aiohttp", "msgspec", "structlog", "prometheus_client")


def run_service_load(args: argparse.Namespace) -> list[str]:
    """Lines of rows per service: one per concurrency level of ``args.concurrency``, under a header per
    ``--service-cmd`` when there are several; or one line saying why it was skipped."""
    if args.service_url is None and not args.service_cmd:
        return ["skipped: pass --service-cmd 'coalesce serve --port {port} ...' or --service-url URL"]
    missing = [m for m in _SERVICE_DEPS if importlib.util.find_spec(m) is None]
    if args.service_cmd and missing:
        return [f"skipped: the service needs {', '.join(missing)}, not installed here"]
    if args.service_url is not None:
        return _measure(args.service_url, None, args)
    lines = []
    for cmd in args.service_cmd:
        if len(args.service_cmd) > 1:
            lines.append(f"$ {cmd}")
        lines += _measure(None, cmd, args)
    return lines


def _measure(url: str | None, cmd: str | None, args: argparse.Namespace) -> list[str]:
    proc = None
    if url is None:
        assert cmd is not None
        port = _free_port()
        proc = subprocess.Popen(cmd.format(port=port), shell=True, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
    try:
        if not _wait_ready(url, proc, timeout_s=240):
            return [f"skipped: the service at {url} did not become ready"]
        model = _first_model(url)
        lines = []
        for clients in args.concurrency:
            done, errors, latencies = _load(url, model, clients, args.service_seconds)
            p50, p99 = _percentile(latencies, 50), _percentile(latencies, 99)
            lines.append(f"{clients:>4} clients: {done / args.service_seconds:>9,.0f} embeddings/s  "
                         f"p50 {p50:6.1f} ms  p99 {p99:6.1f} ms  errors {errors}")
        return lines
    finally:
        if proc is not None:
            _stop(proc)


def _load(url: str, model: str, clients: int, seconds: float) -> tuple[int, int, list[float]]:
    procs = max(1, min(clients, (os.cpu_count() or 2) // 2))
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 3.0  # every process starts together, after spawning
    workers = [
        ctx.Process(target=_client_process, args=(url, model, n, start_at, seconds, queue)) for n in shares
    ]
    for w in workers:
        w.start()
    done = errors = 0
    latencies: list[float] = []
    for _ in workers:
        d, e, lat = queue.get(timeout=seconds + 120)
        done, errors = done + d, errors + e
        latencies += lat
    for w in workers:
        w.join()
    return done, errors, latencies


def _client_process(
    url: str, model: str, threads: int, start_at: float, seconds: float, queue: mp.Queue
) -> None:
    body = json.dumps({"model": model, "input": _TEXT, "encoding_format": "base64"}).encode()
    results: list[tuple[int, int, list[float]]] = []
    lock = threading.Lock()

    def client() -> None:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=60)
        done = errors = 0
        lat: list[float] = []
        time.sleep(max(0.0, start_at - time.time()))
        end = start_at + seconds
        while (t0 := time.time()) < end:
            try:
                if conn.sock is None:  # first request, or reconnecting after an error
                    conn.connect()
                    _no_delay(conn)
                conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
            if ok:
                done += 1
                lat.append((time.time() - t0) * 1000)
            else:
                errors += 1
        conn.close()
        with lock:
            results.append((done, errors, lat))

    pool = [threading.Thread(target=client) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    queue.put((sum(r[0] for r in results), sum(r[1] for r in results), [x for r in results for x in r[2]]))


def _no_delay(conn: http.client.HTTPConnection) -> None:
    """Send each small request at once, not after a delayed ACK (Nagle)."""
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    """/ready answers 200, and where /metrics exports ``coalesce_ready`` it reads 1: with ``--workers``
    the first worker listens while its siblings still load, and the gauge is their minimum."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                ready = resp.status == 200
            if ready and _every_worker_ready(url):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    return False


def _every_worker_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError:
        return True  # no metrics route: /ready is all there is to go by
    gauges = [ln for ln in text.splitlines() if ln.startswith("coalesce_ready ")]
    return all(float(ln.split()[1]) == 1.0 for ln in gauges)


def _first_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[q - 1]
