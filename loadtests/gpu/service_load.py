"""The end-to-end rows of ``gpu_check``: closed-loop load on a running service, standard library only.

``kernels/`` never imports aiohttp, and the GPU machine lacks the load generator's dependencies, so
this drives the service with ``http.client`` keep-alive connections: one thread per concurrent client,
spread over several client processes so the client's GIL is not the bottleneck. Each request embeds
one short input, a different one each time (``/v1/embeddings``, base64, the official client's
default). Closed loop measures throughput; latency figures here hide queueing (use the open-loop load
generator for latency).

A client process is ``python -m coalesce.loadtests.gpu.service_load client ...``: standard library only, so
it starts in tens of milliseconds (a multiprocessing child would re-import ``gpu_check``, torch
included, and start seconds late). The clock starts at a barrier: every client process connects all
its clients and says ``ready``, and only then are all told ``go``. Each client then runs for the
level's seconds and reports its requests and its own run time (its start to its last response); the
throughput is the sum of the clients' rates, so a client that started or finished a little apart from
the others cannot bend the figure.

A service started here (``--service-cmd``) runs in its own session, so its process group (workers
included) is stopped as one, and its output goes to a log file rather than to ours: it holds none of
our pipes, and it leaves our process group, which ``timeout`` signals. So it is stopped here on every
exit: normal, exception, and SIGTERM (a handler kills its process group, then unwinds). Its process
group id sits in ``service.pgid`` in the log directory while it runs, for a caller to kill if this
process itself is killed outright.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import importlib.util
import json
import os
import queue
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO
from urllib.parse import urlsplit

from ..procs import cpu_seconds, main_thread_cpu_seconds, role, tree
from .report import HandlerSwap

_TEXT = "the quick brown fox jumps over the lazy dog"
_SERVICE_DEPS = ("aiohttp", "msgspec", "structlog", "prometheus_client")
_CLIENT_MODULE = f"{__package__}.service_load"
_REQUEST_TIMEOUT_S = 10.0  # one request; a client's last one ends at most this long after its time is up
_CLIENTS_READY_S = 30.0  # client processes started and connected
_STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL for the service's process group (3 s from a signal handler)


def run_service_load(
    args: argparse.Namespace, emit: Callable[[str], None], log_dir: Path, deadline: float
) -> None:
    """``emit`` a row per concurrency level of ``args.concurrency`` as each completes, under a header
    per ``--service-cmd`` when there are several; or one line saying why it was skipped. Levels that
    could not finish before ``deadline`` (``time.monotonic()``) are skipped, saying so."""
    if args.service_url is None and not args.service_cmd:
        emit("skipped: pass --service-cmd 'coalesce serve --port {port} ...' or --service-url URL")
        return
    missing = [m for m in _SERVICE_DEPS if importlib.util.find_spec(m) is None]
    if args.service_cmd and missing:
        emit(f"skipped: the service needs {', '.join(missing)}, not installed here")
        return
    if args.service_url is not None:
        ready_by = min(time.monotonic() + args.service_ready_s, deadline)
        if not _wait_ready(args.service_url, None, ready_by):
            emit(f"skipped: the service at {args.service_url} did not become ready")
            return
        _measure(args.service_url, args, emit, deadline)
        return
    for i, cmd in enumerate(args.service_cmd, start=1):
        if len(args.service_cmd) > 1:
            emit(f"$ {cmd}")
        log_path = log_dir / f"service-{i}.log"
        port = _free_port()
        ready_by = min(time.monotonic() + args.service_ready_s, deadline)
        with _Service(cmd.format(port=port), log_path, log_dir / "service.pgid") as service:
            url = f"http://127.0.0.1:{port}"
            if not _wait_ready(url, service.proc, ready_by):
                emit(f"skipped: the service did not become ready; the end of {log_path}:")
                for line in _tail(log_path, 15):
                    emit(f"  | {line}")
                continue
            _measure(url, args, emit, deadline, service.proc.pid)


def _measure(
    url: str, args: argparse.Namespace, emit: Callable[[str], None], deadline: float, pid: int | None = None
) -> None:
    try:
        model = _first_model(url)
    except (OSError, ValueError, LookupError) as exc:
        emit(f"failed: no model listed at {url}/v1/models: {exc}")
        return
    for clients in args.concurrency:
        if time.monotonic() + args.service_seconds + _CLIENTS_READY_S / 3 > deadline:
            emit(f"{clients:>4} clients: skipped, the time limit is near")
            continue
        before = _batches(url)
        sample = functools.partial(_cpu_by_role, pid) if pid is not None else None
        try:
            result = _load(url, model, clients, args.service_seconds, sample=sample)
        except (RuntimeError, TimeoutError) as exc:
            emit(f"{clients:>4} clients: failed: {exc}")
            continue
        after = _batches(url)
        batches = after[1] - before[1]
        batch = f"{(after[0] - before[0]) / batches:6.1f}" if batches > 0 else "     -"
        p50, p99 = _percentile(result.latencies_ms, 50), _percentile(result.latencies_ms, 99)
        emit(f"{clients:>4} clients: {result.rate:>9,.0f} embeddings/s  p50 {p50:6.1f} ms  "
             f"p99 {p99:6.1f} ms  mean batch {batch}  errors {result.errors}")
        if result.cpu_s:
            emit(f"      CPU per request: {cpu_split(result)}")
    emit(f"     GPU memory used: {_gpu_memory()}")


def _cpu_by_role(pid: int) -> dict[str, tuple[int, float]]:
    """The service's process tree's CPU seconds by role: ``engine``, ``gateway``, and ``all`` for a
    single process (a shell, a supervisor); each as (processes, CPU seconds); and the same of their
    main threads alone (``engine loop``, ...: the event loop, where a server's Python runs; the other
    threads run forwards, tokenisers, and on a GPU may spin waiting for the device)."""
    out: dict[str, tuple[int, float]] = {}
    for p in tree(pid):
        try:
            kind, cpu, loop = role(p), cpu_seconds(p), main_thread_cpu_seconds(p)
        except (OSError, ValueError):
            continue  # it exited meanwhile
        for key, seconds in ((kind, cpu), (f"{kind} loop", loop)):
            n, total = out.get(key, (0, 0.0))
            out[key] = (n + 1, total + seconds)
    return out


def cpu_split(result: LoadResult) -> str:
    """Where the CPU of a row went, per request answered and in cores busy over the clients' run:
    the service's engine and gateways (or its one process) and the load clients themselves. A process
    at about 1.00 cores is saturated: it caps the row, whatever the GPU could do."""
    requests = max(1, len(result.latencies_ms) + result.errors)
    spent = result.cpu_s
    engine, gateways = spent.get("engine"), spent.get("gateway")

    def part(name: str, cpu: float, n: int = 1, loop: tuple[int, float] | None = None) -> str:
        who = f"{name} ×{n}" if n > 1 else name
        loop_part = f"; event loop {loop[1] / result.window_s / loop[0]:.2f} each" if n > 1 and loop else (
            f"; event loop {loop[1] / result.window_s:.2f}" if loop else "")
        return f"{who} {cpu / requests * 1e6:,.0f} µs ({cpu / result.window_s:.2f} cores{loop_part})"

    if engine is not None and gateways is not None:
        parts = [part("engine", engine[1], loop=spent.get("engine loop")),
                 part("gateways", gateways[1], gateways[0], spent.get("gateway loop"))]
    else:  # one process (with whatever shell started it: its loop figure is the busiest main thread's)
        total = sum(cpu for kind, (_, cpu) in spent.items() if kind in ("all", "engine", "gateway"))
        loops = [cpu for kind, (_, cpu) in spent.items() if kind.endswith(" loop")]
        parts = [part("service", total, loop=(1, max(loops)) if loops else None)]
    clients = spent.get("clients")
    if clients is not None:
        parts.append(part("clients", clients[1], clients[0]))
    return ", ".join(parts)


def _batches(url: str) -> tuple[float, float]:
    """(inputs batched, batches) so far, summed over the service's models, from its /metrics."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return 0.0, 0.0
    total = {"coalesce_batch_size_sum": 0.0, "coalesce_batch_size_count": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in total:
            total[name] += float(line.rsplit(" ", 1)[1])
    return total["coalesce_batch_size_sum"], total["coalesce_batch_size_count"]


def _gpu_memory() -> str:
    """What ``nvidia-smi`` reports in use on the GPU(s) now (the service still running)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "- (no nvidia-smi)"
    return "; ".join(line.strip() for line in out.splitlines() if line.strip())


class _Service:
    """A service command started in its own session with its output in ``log_path``; stopped (its
    whole process group) on leaving the ``with`` block and on SIGTERM meanwhile."""

    def __init__(self, cmd: str, log_path: Path, pgid_path: Path) -> None:
        self._cmd = cmd
        self._log_path = log_path
        self._pgid_path = pgid_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, "not started"
        return self._proc

    def __enter__(self) -> _Service:
        self._handler = HandlerSwap(signal.SIGTERM, self._on_sigterm)  # first: no window without it
        try:
            with open(self._log_path, "ab") as log:  # the child has its own descriptor; ours closes here
                self._proc = subprocess.Popen(self._cmd, shell=True, start_new_session=True,
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            self._pgid_path.write_text(f"{self._proc.pid}\n")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(_STOP_GRACE_S)  # with the handler still in place: a SIGTERM meanwhile stops it too
        self._handler.restore()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.stop(3.0)  # before anything else: nothing of ours reaches its process group otherwise
        raise SystemExit(128 + signum)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the service's process group, SIGKILL to whatever is left of it ``grace_s`` later."""
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # a session leader: its pid is its process group's id
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # workers that outlived their supervisor, or one that hangs
        proc.wait()
        self._pgid_path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class LoadResult:
    rate: float  # requests answered per second: the sum of each client's own rate
    errors: int
    latencies_ms: list[float]
    # CPU seconds by role over the run, each as (processes, seconds): the service's (from the clients'
    # "go" to their results) and the client processes' own ("clients", their whole lives); and that window
    cpu_s: dict[str, tuple[int, float]] = field(default_factory=dict)
    window_s: float = 0.0


def throughput(done: Sequence[int], elapsed_s: Sequence[float]) -> float:
    """The service's rate under closed-loop clients: the sum of each client's requests over its own
    run time (clients that ran together at the same pace each add their share)."""
    return sum(d / e for d, e in zip(done, elapsed_s, strict=True) if e > 0)


def _load(
    url: str, model: str, clients: int, seconds: float, procs: int | None = None,
    sample: Callable[[], dict[str, tuple[int, float]]] | None = None,
) -> LoadResult:
    """``clients`` closed-loop clients for ``seconds``, in ``procs`` processes (default: half the cores);
    with ``sample`` (the service's CPU by role), the service's CPU from "go" to the results."""
    procs = max(1, min(clients, procs or (os.cpu_count() or 2) // 2))
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    children_before = _children_cpu_s()
    before: dict[str, tuple[int, float]] = {}
    after: dict[str, tuple[int, float]] = {}
    went = ended = 0.0
    lines: queue.Queue[tuple[int, str]] = queue.Queue()
    children: list[subprocess.Popen[str]] = []
    try:
        for i, n in enumerate(shares):
            child = subprocess.Popen(_client_command(url, model, n, seconds), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            children.append(child)
            threading.Thread(target=_pump, args=(i, child.stdout, lines), daemon=True).start()
        _collect(lines, "ready", len(children), time.monotonic() + _CLIENTS_READY_S)
        for child in children:  # the barrier: every client is connected; start them all now
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        went = time.monotonic()
        before = sample() if sample is not None else {}
        reports = _collect(lines, "result", len(children),
                           time.monotonic() + seconds + _REQUEST_TIMEOUT_S + _CLIENTS_READY_S)
        after = sample() if sample is not None else {}
        ended = time.monotonic()
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    parsed = [json.loads(r) for r in reports]
    cpu = {kind: (n, spent - before.get(kind, (0, 0.0))[1]) for kind, (n, spent) in after.items()}
    if sample is not None:
        cpu["clients"] = (len(children), _children_cpu_s() - children_before)
    return LoadResult(
        rate=throughput([d for p in parsed for d in p["done"]], [e for p in parsed for e in p["elapsed"]]),
        errors=sum(e for p in parsed for e in p["errors"]),
        latencies_ms=[x for p in parsed for x in p["latencies_ms"]],
        cpu_s=cpu,
        window_s=ended - went,
    )


def _children_cpu_s() -> float:
    """User plus system CPU seconds of this process's reaped children (the client processes, once
    waited for; the service is reaped only when it stops, after every row)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _client_command(url: str, model: str, threads: int, seconds: float) -> list[str]:
    return [sys.executable, "-m", _CLIENT_MODULE, "client", url, model, str(threads), str(seconds)]


def _pump(index: int, stream: IO[str] | None, lines: queue.Queue[tuple[int, str]]) -> None:
    """Forward a client process's stdout lines; an empty line means it closed its stdout."""
    assert stream is not None
    for line in stream:
        lines.put((index, line.rstrip("\n")))
    lines.put((index, ""))


def _collect(lines: queue.Queue[tuple[int, str]], word: str, count: int, deadline: float) -> list[str]:
    """The rest of the ``word ...`` line from each of ``count`` client processes."""
    got: dict[int, str] = {}
    while len(got) < count:
        try:
            index, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{count - len(got)} client processes did not say {word!r} in time") from None
        if not line:
            if index in got:
                continue  # it said its piece, then closed its output: a clean exit
            raise RuntimeError(f"client process {index} exited before saying {word!r}")
        if line.split(" ", 1)[0] == word:
            got[index] = line[len(word) + 1 :]
    return list(got.values())


def _client_process(url: str, model: str, threads: int, seconds: float) -> int:
    """One client process: connect ``threads`` clients, say ``ready``, wait for ``go`` on stdin, run
    them for ``seconds``, print ``result`` and a JSON object of per-client lists."""
    head = json.dumps({"model": model, "encoding_format": "base64"})[:-1].encode()  # '{...' without '}'
    parts = urlsplit(url)
    conns = [http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                        timeout=_REQUEST_TIMEOUT_S) for _ in range(threads)]
    for conn in conns:
        try:
            _connect(conn)
        except OSError:
            conn.close()  # counted as errors in the run, which reconnects
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1  # the parent went away
    done = [0] * threads
    errors = [0] * threads
    elapsed = [0.0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def client(i: int) -> None:
        conn = conns[i]
        start = time.perf_counter()
        end = start + seconds
        while (t0 := time.perf_counter()) < end:
            try:
                if conn.sock is None:  # reconnecting after an error
                    _connect(conn)
                # A different text each time (the service caches results and computes identical
                # inputs in flight once: repeating one text would measure the cache, not the model).
                body = head + f', "input": "{_TEXT} {os.getpid()} {i} {done[i] + errors[i]}"}}'.encode()
                conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
            if ok:
                done[i] += 1
                latencies[i].append(round((time.perf_counter() - t0) * 1000, 3))
            else:
                errors[i] += 1
        elapsed[i] = time.perf_counter() - start  # to this client's last response
        conn.close()

    pool = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    flat = [x for lat in latencies for x in lat]
    print("result " + json.dumps({"done": done, "errors": errors, "elapsed": elapsed, "latencies_ms": flat}),
          flush=True)
    return 0


def _connect(conn: http.client.HTTPConnection) -> None:
    """Connect, and send each small request at once, not after a delayed ACK (Nagle)."""
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _wait_ready(url: str, proc: subprocess.Popen[bytes] | None, deadline: float) -> bool:
    """/ready answers 200, and where /metrics exports ``coalesce_ready`` it reads 1: with ``--workers``
    the first worker listens while its siblings still load, and the gauge is their minimum."""
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
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
        return str(json.load(resp)["data"][0]["id"])


def _tail(path: Path, lines: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100)[q - 1]


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 5 and argv[0] == "client":
        return _client_process(argv[1], argv[2], int(argv[3]), float(argv[4]))
    print("usage: python -m coalesce.loadtests.gpu.service_load client URL MODEL THREADS SECONDS "
          "(started by gpu_check)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
