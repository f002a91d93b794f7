"""Where the engine's CPU per request goes, without sockets, HTTP or a model.

    python -m coalesce.loadtests.engine_ops [--jobs 1,4,16] [--gateways G] [--rounds 2000] [--profile N]
                                            [--ops] [--cache-mb MB] [--shared-metrics] [--pipeline-depth N]
                                            [--forward-us F] [--in-flight K] [--wakes] [--json]

The engine process's own path (``engine/server.py``'s ``GatewayLink`` and everything behind it: the
``Submit`` decode, admission, the fair queue, the scheduler, the batcher, metrics, the ``Results``
message) driven in one process: each round hands the link one ``Submit`` of ``--jobs`` one-sentence
requests (distinct inputs, the packaged model's tokenizer and facts, the forward a constant —
``coalesce.loadtests.nullmodel``; no result cache and this process's own metrics unless
``--cache-mb`` and ``--shared-metrics`` make it the service's case), and the next round starts when
the answers of all of them have been "sent" (encoded, then dropped). With ``--gateways G``, G links
share the engine's ``Turn`` as in the engine process, and each round each of them hands over its message
in the same event-loop turn (many gateways' small messages, what a loaded GPU replica sees). CPU per
request (every thread of the process), two ways:

* **threaded**: the batch goes to the device thread and back, as in ``coalesce serve``;
* **inline**: the same batch run on the event loop's thread, its answer scheduled with ``call_soon``:
  the engine's Python alone, so the difference is what the hand-off to the device thread and back
  costs per batch on this machine.

Also the bare cost of that hand-off: a call handed to a Python thread that answers the event loop with
``call_soon_threadsafe`` (what ``ModelWorker`` does), CPU per round trip; and what a message between
two processes costs: a small message (a 200-byte head and a 1,536-byte frame, four 384-wide rows) sent
to a process that sends it back, CPU per round trip of each side, over the engine's link
(``engine/channel.py``: a Unix socket on the event loop) and, when pyzmq is installed, over a ZeroMQ
DEALER pair on ``ipc://`` read the way the link read it before (the link's previous transport).
``--profile N``: cProfile's top ``N`` functions (own time) of the inline path at the last ``--jobs``
value, in a run of its own. ``--ops``: the Python bytecodes the engine's thread executes per request on
that path, and the Python function calls (frames entered), counted by ``sys.settrace`` in a run of its
own (tens of times slower): unlike CPU time they barely move with the machine's load or speed, so a
change to the per-request path reads the same on a noisy 2-core VM as on the GPU host (only the cost
model's refits follow measured times: at a few requests a batch they move the count by a percent or
two; at 16 or more by a fraction of a percent). A proxy — a bytecode that calls into C counts once
however long the call takes. With it, the objects the path leaves in reference cycles per request (the
collector off for a run, then what ``gc.collect()`` finds): those only the garbage collector frees, each
traced by its collections on the engine's loop; none is the mark of a path that frees what it made.
``--wakes``: the system calls that wake or put to sleep a thread, per batch of the threaded path at the
last ``--jobs`` value, on the event loop's thread and on the others (the device thread's), counted by
``strace -f`` around the measured rounds only (a run of its own, in a child process; strace must be
installed): futex wakes and waits, the loop's polls, reads and writes. Unlike CPU time they tell a
hand-off that wakes the device thread once a batch from one that wakes it again for the interpreter lock
the loop still holds (woken on another core, it runs at once and finds the lock taken; on the loop's own
core it waits for the loop to sleep). Which of the two a run gets follows where the kernel puts the
threads, so a run tends to read one way throughout: run it more than once.

``--forward-us F`` gives the constant forward F µs of waiting without the interpreter lock (a sleep,
as a GPU's forward mostly is: the device thread waits for its result), and ``--in-flight K`` keeps K
rounds handed over before the first of them is answered (1, the default: each round waits for the
one before), so the next batch reaches the engine while one runs: with ``--pipeline-depth 2``, what a
loaded GPU replica's engine does — a batch handed over to a device still busy with the one before it.
Each row then says what share of its batches were handed to a busy device (the instant forward of the
default hands every batch to an idle, sleeping device thread, which a loaded GPU seldom has) and how many
requests the threaded path answered a second of wall time: with rounds in flight, what the engine's loop
keeps up with. ``--no-round-trips`` leaves out the bare thread and message round trips.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import gc
import importlib.util
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from typing import Any


class _OpCounter:
    """Python bytecodes executed and Python frames entered on this thread while entered (``sys.settrace``
    with opcode events: every frame it sees, coroutines resumed included)."""

    def __init__(self) -> None:
        self.ops = 0
        self.calls = 0
        self.by_code: collections.Counter[Any] = collections.Counter()  # bytecodes per code object

    def _call(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        self.calls += 1
        frame.f_trace_opcodes = True
        return self._step

    def _step(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.ops += 1
            self.by_code[frame.f_code] += 1
        return self._step

    def top(self, n: int, per: float) -> list[tuple[str, float]]:
        """The ``n`` functions that executed the most bytecodes, as ``(where, bytecodes / per)``."""
        from coalesce.loadtests.pyspy_summary import short_path

        return [(f"{code.co_qualname} ({short_path(code.co_filename)}:{code.co_firstlineno})", count / per)
                for code, count in self.by_code.most_common(n)]

    def __enter__(self) -> _OpCounter:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


_MARKS = ("coalesce-wakes-start", "coalesce-wakes-end")
# What --wakes counts, by strace's name for the call (futex by its operation, below).
_WAKE_CALLS = ("futex", "epoll_wait", "epoll_pwait", "read", "write")
_WAKE_KEYS = ("futex_wake", "futex_wait", "poll", "read", "write")


class _WakeMarks:
    """Marks where the measured rounds start and end in an strace log: a write of a marker each."""

    def __enter__(self) -> _WakeMarks:
        self._fd = os.open(os.devnull, os.O_WRONLY)
        os.write(self._fd, _MARKS[0].encode())
        return self

    def __exit__(self, *exc: object) -> None:
        os.write(self._fd, _MARKS[1].encode())
        os.close(self._fd)


def count_wakes(log: str) -> dict[str, dict[str, int]]:
    """Calls between the markers of an ``strace -f -o FILE -e trace=...`` log, per thread: ``loop`` (the
    one that wrote the markers) and ``others`` summed: ``futex_wake``, ``futex_wait``, ``poll`` (epoll
    waits), ``read``, ``write`` (the markers excepted). A call strace split (``<unfinished ...>``, then
    ``<... resumed>``) counts once, where it started; a line strace wrote without a thread's id (one
    thread traced) is the loop's."""
    counts: dict[str, dict[str, int]] = {}
    loop_tid: str | None = None
    inside = False
    for line in log.splitlines():
        if line[:1].isdigit():  # "TID call(...)": strace -f writing to a file
            tid, _, rest = line.partition(" ")
        elif line.startswith("[pid "):  # "[pid TID] call(...)": the same, written to a terminal
            head, _, rest = line.partition("]")
            tid = head[5:].strip()
        else:
            tid, rest = "", line
        rest = rest.lstrip()
        if rest[:1].isdigit():  # a time stamp (-t, -tt, -ttt)
            rest = rest.partition(" ")[2]
        if rest.startswith("<..."):
            continue  # (the rest of a call counted where it started)
        name = rest.partition("(")[0]
        if name == "write" and _MARKS[0] in rest:
            loop_tid, inside = tid, True
            continue
        if name == "write" and _MARKS[1] in rest:
            break
        if not inside or name not in _WAKE_CALLS:
            continue
        if name == "futex":
            if "FUTEX_WAKE" in rest:
                key = "futex_wake"
            elif "FUTEX_WAIT" in rest:
                key = "futex_wait"
            else:
                continue
        elif name.startswith("epoll"):
            key = "poll"
        else:
            key = name
        who = counts.setdefault(tid, dict.fromkeys(_WAKE_KEYS, 0))
        who[key] += 1
    loop = counts.pop(loop_tid, None) if loop_tid is not None else None  # (None: no marks found)
    others = dict.fromkeys(_WAKE_KEYS, 0)
    for who in counts.values():
        for key, n in who.items():
            others[key] += n
    return {"loop": loop or dict.fromkeys(_WAKE_KEYS, 0), "others": others}


def _wakes(jobs: int, rounds: int, gateways: int, cache_mb: int, model_dir: str, depth: int,
           forward_us: float = 0.0, in_flight: int = 1) -> dict[str, Any]:
    """``--wakes``: the threaded path's rounds in a child process under strace; calls per batch."""
    strace = shutil.which("strace")
    if strace is None:
        raise SystemExit("--wakes needs strace (not found on PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "strace.log")
        child = [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--wakes-child", "--jobs", str(jobs),
                 "--rounds", str(rounds), "--gateways", str(gateways), "--cache-mb", str(cache_mb),
                 "--model", model_dir, "--pipeline-depth", str(depth), "--forward-us", str(forward_us),
                 "--in-flight", str(in_flight)]
        # --seccomp-bpf (where this strace has it): the child stops only at the calls counted, not at
        # every call of its start-up (imports, the model's load), which took seconds under strace.
        fast = ["--seccomp-bpf"] if subprocess.run([strace, "-f", "--seccomp-bpf", "-o", os.devnull, "true"],
                                                   capture_output=True).returncode == 0 else []
        out = subprocess.run([strace, "-f", *fast, "-o", log, "-e", "trace=" + ",".join(_WAKE_CALLS), *child],
                             capture_output=True, text=True, check=True).stdout
        batches = json.loads(out.strip().splitlines()[-1])["batches"]
        with open(log, encoding="utf-8", errors="replace") as f:
            counts = count_wakes(f.read())
    per = {side: {k: n / max(batches, 1.0) for k, n in c.items()} for side, c in counts.items()}
    return {"jobs": jobs, "batches": batches, **per}


class _CycleCounter:
    """Objects the garbage collector finds in reference cycles, collected only by it, among what was
    made while entered (the collector off meanwhile): what reference counting could not free."""

    def __init__(self) -> None:
        self.left = 0

    def __enter__(self) -> _CycleCounter:
        gc.collect()
        gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.left = gc.collect()
        finally:
            gc.enable()


def _forward_taking(seconds: float) -> Callable[[Any], Any]:
    """The null model's runner factory, its forward ``seconds`` of waiting without the interpreter lock
    first (``--forward-us``; 0: the null model as it is)."""
    from coalesce.loadtests.nullmodel import factory

    if seconds <= 0:
        return factory

    def make(spec: Any) -> Any:
        runner = factory(spec)
        instant = runner.forward

        def forward(prepared: Any) -> Any:
            time.sleep(seconds)  # (releases the lock, as a device thread waiting for a GPU's result does)
            return instant(prepared)

        runner.forward = forward
        return runner

    return make


async def _engine_rounds(
    jobs: int, rounds: int, inline: bool, gateways: int = 1, cache_mb: int = 0, model_dir: str = "default",
    probe: contextlib.AbstractContextManager[Any] | None = None, depth: int = 0, forward_s: float = 0.0,
    in_flight: int = 1,
) -> tuple[float, float, float, float, float]:
    """CPU µs per request over ``rounds`` messages of ``jobs`` requests, batches per message, inputs
    computed per batch (every request's own: no two are the same input), the share of the measured
    batches handed to a device with another still in flight (threaded; 0 inline), and requests answered
    per second of wall time (with rounds in flight and the forward's wait, what the engine's loop keeps
    up with). ``probe`` (a profiler,
    an :class:`_OpCounter`) is entered around the measured rounds only. ``forward_s``, ``in_flight``: see
    ``--forward-us``, ``--in-flight``."""
    from coalesce.kernels.worker import BatchOutput
    from coalesce.service.allocator import freeze_startup_heap
    from coalesce.service.engine import messages as wire
    from coalesce.service.engine.core import Engine
    from coalesce.service.engine.server import GatewayLink, Turn, _offer
    from coalesce.service.metrics import Metrics
    from coalesce.service.settings import Settings, parse_model_spec

    settings = Settings(models=(parse_model_spec(model_dir),), cache_mb=cache_mb, pipeline_depth=depth,
                        runner_factory="coalesce.loadtests.nullmodel:factory")
    metrics = Metrics()
    engine = Engine(settings, metrics, _forward_taking(forward_s))
    await engine.load()
    loop = asyncio.get_running_loop()
    handed = [0, 0]  # batches handed over, and those handed to a device with another in flight
    # Set when what the rounds wait for may have come: the answers they wait for (``state["wake_at"]``),
    # and with more than one round in flight each batch handed over (one wake of the rounds a round, as
    # before there were rounds in flight, when one is: their own work is measured too).
    progress = asyncio.Event()
    if not inline:
        for model in engine.models:
            worker = model.worker
            device, handing = worker._device, worker.start

            def counted_start(batch: Sequence[Sequence[int]], kind: Any, done: Callable[[Any], None],
                              handing: Callable[..., None] = handing, device: Any = device) -> None:
                handed[0] += 1
                handed[1] += device.in_flight > 0
                if in_flight > 1:
                    progress.set()
                handing(batch, kind, done)

            worker.start = counted_start
    else:
        for model in engine.models:
            runner = model.runner

            def start(batch: Sequence[Sequence[int]], kind: object, done: Callable[[Any], None],
                      runner: Any = runner) -> None:
                handed[0] += 1
                if in_flight > 1:
                    progress.set()
                t0 = time.perf_counter()
                rows = runner.finish(runner.forward(runner.prepare(batch)), None)
                loop.call_soon(done, BatchOutput(rows, 0.0, max(time.perf_counter() - t0, 1e-6)))

            model.worker.start = start
    with tempfile.TemporaryDirectory() as tmp:
        # One link per gateway (their sockets are never bound); each round each sends one message.
        turn = Turn(engine)  # shared, as in the engine process
        links = [GatewayLink(g, wire.endpoint(tmp, g), engine, metrics, turn) for g in range(gateways)]
        for link in links:
            link.welcome([_offer(m, settings) for m in engine.models])
        state = {"answered": 0, "target": 0, "wake_at": 0}

        def sent(parts: list[Any]) -> None:
            msg = wire.gateway_decoder.decode(parts[0])
            if isinstance(msg, wire.Results):
                if msg.failed:
                    raise RuntimeError(f"refused in the bench: {msg.failed[0]}")
                state["answered"] += len(msg.done)
                if state["answered"] >= state["wake_at"]:
                    progress.set()

        for link in links:
            link._send = sent
        # One-sentence inputs ([CLS] w w [SEP]), each job's its own across every round, so none is
        # deduplicated against another and, with --cache-mb, every one misses the cache and is kept
        # (the service's case under distinct texts: a lookup, a copy kept, evictions once full).
        sizes = [5] * jobs  # (each sequence's length, then its 4 ids)

        def message(first_id: int) -> list[memoryview]:
            deadline = time.monotonic() + 3600
            batch = [wire.Job(first_id + j, 0, 1, False, "default", 1.0, 1, deadline) for j in range(jobs)]
            frame = array("i")
            for n in range(first_id, first_id + jobs):
                frame.extend([4, 101, 1000 + n % 29000, 1000 + n // 29000 % 29000, 102])
            return [memoryview(wire.encoder.encode(wire.Submit(batch, sizes))), memoryview(frame.tobytes())]

        async def run(msgs: list[list[memoryview]]) -> None:
            # A round is handed over once the round in_flight before it is answered (1: the one before)
            # and, with more than one in flight, once the round before it has a batch on its way (else
            # both would reach the engine in one turn and ride one batch: no batch would find the
            # device busy).
            outstanding: collections.deque[int] = collections.deque()  # each round's answers, in all
            for r in range(0, len(msgs), gateways):
                while len(outstanding) >= in_flight:
                    await answered(outstanding.popleft())
                state["target"] += jobs * gateways
                outstanding.append(state["target"])
                before = handed[0]
                for link, msg in zip(links, msgs[r : r + gateways], strict=True):
                    link._on_message(msg)
                if in_flight > 1:
                    while handed[0] == before and state["answered"] < state["target"]:
                        await moved(state["target"])
            while outstanding:
                await answered(outstanding.popleft())

        async def answered(n: int) -> None:
            while state["answered"] < n:
                await moved(n)

        async def moved(answers: int) -> None:
            state["wake_at"] = answers
            progress.clear()
            await progress.wait()

        def counted(series: str) -> float:
            name = engine.models[0].info.name
            metrics.flush()  # (the batcher's tally, as a scrape would read it)
            return metrics.registry.get_sample_value(series, {"model": name}) or 0.0

        warm = max(rounds // 10, 20) * gateways
        await run([message(r * jobs) for r in range(warm)])  # warm-up: the cost model
        # settles, caches fill. The measured messages are encoded before the clock starts: that is the
        # gateway's work, not the engine's. (Job ids are unique across the gateways, which is more than
        # the engine needs: each link keeps its own.)
        msgs = [message((warm + r) * jobs) for r in range(rounds * gateways)]
        b0, i0 = counted("coalesce_batches_total"), counted("coalesce_inputs_total")
        handed[:] = [0, 0]
        # The heap as it stands, frozen, as the engine process freezes its own once ready
        # (allocator.freeze_startup_heap): a full collection then walks what serving made, not the
        # model's, the tokenizer's and these messages' objects by the hundred thousand, which made one
        # that fell in a run cost it several µs a request, a different run's each time.
        freeze_startup_heap()
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            with probe if probe is not None else contextlib.nullcontext():
                await run(msgs)
        finally:
            gc.unfreeze()  # (the next run's engine starts from a heap of its own)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        ran = counted("coalesce_batches_total") - b0
        per_message = ran / (rounds * gateways)
        per_batch = (counted("coalesce_inputs_total") - i0) / max(ran, 1.0)
        for link in links:
            link.close()
    await engine.close()
    requests = rounds * gateways * jobs
    return cpu / requests * 1e6, per_message, per_batch, handed[1] / max(handed[0], 1), requests / wall


async def _thread_round_trip(rounds: int) -> float:
    """CPU µs of one call handed to a thread that answers the loop with ``call_soon_threadsafe``."""
    loop = asyncio.get_running_loop()
    queue: SimpleQueue[Callable[[], None] | None] = SimpleQueue()

    def lane() -> None:
        while (item := queue.get()) is not None:
            loop.call_soon_threadsafe(item)

    thread = threading.Thread(target=lane)
    thread.start()
    c0 = time.process_time()
    for _ in range(rounds):
        fut = loop.create_future()
        queue.put(lambda fut=fut: fut.set_result(None))  # type: ignore[misc]
        await fut
    cpu = time.process_time() - c0
    queue.put(None)
    thread.join()
    return cpu / rounds * 1e6


_HEAD, _ROWS = b"h" * 200, b"r" * 1536  # a Results head and four 384-wide float32 rows


def _dealer(path: str, *, bind: bool) -> tuple[Any, Any]:
    """A ZeroMQ context and a DEALER socket on ``ipc://path`` (bound, or connected), as the link's
    previous transport set them up."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    (sock.bind if bind else sock.connect)(f"ipc://{path}")
    return ctx, sock


async def _echo(transport: str, path: str) -> None:
    """The far side of :func:`_message_round_trip`: send every message back until one says stop."""
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    if transport == "unix":
        from coalesce.service.engine.channel import Link

        def back(parts: list[memoryview]) -> None:
            if bytes(parts[0]) == b"stop":
                stop.set_result(None)
            else:
                link.send([bytes(p) for p in parts])

        link = Link("echo", back)
        await link.listen(path)
        print("ready", flush=True)
        await stop
        link.close()
        return
    import zmq

    ctx, sock = _dealer(path, bind=True)

    def read() -> None:
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            if bytes(parts[0].buffer) == b"stop":
                stop.set_result(None)
                return
            sock.send_multipart(parts, zmq.NOBLOCK, copy=False)

    loop.add_reader(sock.FD, read)
    print("ready", flush=True)
    read()
    await stop
    sock.close(linger=0)
    ctx.term()


async def _message_round_trip(transport: str, rounds: int) -> tuple[float, float]:
    """CPU µs per round trip of a small message to another process and back: (this side, the far side)."""
    import subprocess
    import sys

    from coalesce.loadtests import procs

    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "echo.sock")
        far = subprocess.Popen([sys.executable, "-m", "coalesce.loadtests.engine_ops", "--echo", transport,
                                path], stdout=subprocess.PIPE)
        assert far.stdout is not None
        await loop.run_in_executor(None, far.stdout.readline)  # "ready"
        back: asyncio.Future[None] | None = None
        if transport == "unix":
            from coalesce.service.engine.channel import Link

            def answered(parts: list[memoryview]) -> None:
                assert back is not None
                back.set_result(None)

            link = Link("bench", answered)
            link.connect(path)
            send: Callable[[], object] = lambda: link.send([_HEAD, _ROWS])  # noqa: E731
            stop: Callable[[], object] = lambda: link.send([b"stop"])  # noqa: E731
        else:
            import zmq

            ctx, sock = _dealer(path, bind=False)

            def read() -> None:
                while sock.get(zmq.EVENTS) & zmq.POLLIN:
                    sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    if back is not None and not back.done():
                        back.set_result(None)

            loop.add_reader(sock.FD, read)

            def send() -> None:
                sock.send_multipart([_HEAD, _ROWS], zmq.NOBLOCK, copy=False)
                loop.call_soon(read)  # (the descriptor is edge-triggered: a reply may already wait)

            stop = lambda: sock.send(b"stop")  # noqa: E731
        for measured in (False, True):  # a warm-up, then the measured rounds
            c0, f0 = time.process_time(), procs.cpu_seconds(far.pid)
            for _ in range(rounds if measured else rounds // 10):
                back = loop.create_future()
                send()
                await back
            mine, theirs = time.process_time() - c0, procs.cpu_seconds(far.pid) - f0
        stop()
        await loop.run_in_executor(None, far.wait)
        if transport == "unix":
            link.close()
        else:
            loop.remove_reader(sock.FD)
            sock.close(linger=0)
            ctx.term()
    return mine / rounds * 1e6, theirs / rounds * 1e6


def measure(jobs: Sequence[int], rounds: int, profile: int = 0, gateways: int = 1,
            cache_mb: int = 0, model_dir: str = "default", count_ops: bool = False, depth: int = 0,
            wakes: bool = False, forward_us: float = 0.0, in_flight: int = 1, round_trips: bool = True
            ) -> dict[str, Any]:
    """Every figure the tool prints, as data (the bench's engine section reads it). Without
    ``round_trips`` the bare thread and message round trips are not measured (None and empty)."""
    import uvloop
    from coalesce.service.logs import configure

    configure("warning")
    rows = []
    text = ""
    timed: dict[str, Any] = {"depth": depth, "forward_s": forward_us / 1e6, "in_flight": in_flight}
    for n in jobs:
        threaded, per_message, per_batch, busy, rate = uvloop.run(
            _engine_rounds(n, rounds, False, gateways, cache_mb, model_dir, **timed))
        inline, *_ = uvloop.run(_engine_rounds(n, rounds, True, gateways, cache_mb, model_dir, **timed))
        rows.append({"jobs": n, "threaded_us": threaded, "inline_us": inline, "batches": per_message,
                     "inputs_per_batch": per_batch, "handed_busy": busy, "threaded_rps": rate,
                     "hand_off_us": (threaded - inline) * n / max(per_message, 1e-9)})
    hop = uvloop.run(_thread_round_trip(max(rounds, 1000))) if round_trips else None
    messages = {"unix": uvloop.run(_message_round_trip("unix", max(rounds, 1000)))} if round_trips else {}
    if round_trips and importlib.util.find_spec("zmq") is not None:
        messages["zeromq"] = uvloop.run(_message_round_trip("zmq", max(rounds, 1000)))
    if profile:  # a run of its own: the profiler slows what it watches several times over
        prof = cProfile.Profile()
        uvloop.run(_engine_rounds(jobs[-1], rounds, True, gateways, cache_mb, model_dir, prof, **timed))
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(profile)
        text = out.getvalue()
    ops = None
    if count_ops:  # a run of its own too: tracing every bytecode slows it tens of times
        counter = _OpCounter()
        uvloop.run(_engine_rounds(jobs[-1], rounds, True, gateways, cache_mb, model_dir, counter, **timed))
        requests = rounds * gateways * jobs[-1]
        cycles = _CycleCounter()
        uvloop.run(_engine_rounds(jobs[-1], rounds, True, gateways, cache_mb, model_dir, cycles, **timed))
        ops = {"jobs": jobs[-1], "bytecodes": counter.ops / requests, "calls": counter.calls / requests,
               "top": counter.top(15, requests), "cycles": cycles.left / requests}
    woke = (_wakes(jobs[-1], rounds, gateways, cache_mb, model_dir, depth, forward_us, in_flight) if wakes
            else None)
    return {"rows": rows, "gateways": gateways, "cache_mb": cache_mb, "wakes_per_batch": woke,
            "forward_us": forward_us, "in_flight": in_flight,
            "shared_metrics": bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")), "thread_round_trip_us": hop,
            "message_round_trip_us": messages, "profile": text, "ops_per_request": ops,
            "cpus": os.cpu_count()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.engine_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="1,4,16", help="requests per Submit message, comma-separated")
    p.add_argument("--rounds", type=int, default=2000,
                   help="rounds measured per row (a message per gateway each)")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateways sending one message each per round, all in one event-loop turn (1)")
    p.add_argument("--cache-mb", type=int, default=0, metavar="MB",
                   help="the engine's result cache (0, the default: off; the service's default is 64)")
    p.add_argument("--shared-metrics", action="store_true",
                   help="metrics in a multiprocess directory, as under --workers (each write a locked "
                        "write to a shared file) rather than in this process alone")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="the model whose tokenizer the engine loads (its forward is skipped); "
                   "default: the embedded all-MiniLM-L6-v2")
    p.add_argument("--pipeline-depth", type=int, default=0, metavar="N",
                   help="the engine's --pipeline-depth (0, the default: as the service picks it, 1 on CPU; "
                   "2 hands batches over as on a GPU: padded beside a running forward)")
    p.add_argument("--forward-us", type=float, default=0.0, metavar="F",
                   help="the forward waits F µs without the interpreter lock, as a GPU's does (0: instant)")
    p.add_argument("--in-flight", type=int, default=1, metavar="K",
                   help="rounds handed over before the first of them is answered (1: one at a time); with "
                   "--pipeline-depth 2 and --forward-us, batches reach a device still busy with one")
    p.add_argument("--no-round-trips", action="store_true",
                   help="leave out the bare thread and message round trips (a second or two of processes)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N functions")
    p.add_argument("--ops", action="store_true",
                   help="Python bytecodes and function calls per request of the inline path at the last "
                   "--jobs (sys.settrace: nearly the same on any machine, unlike CPU time; a run of its "
                   "own), and the objects it leaves in reference cycles per request")
    p.add_argument("--wakes", action="store_true",
                   help="futex wakes and waits, polls, reads and writes per batch of the threaded path at "
                   "the last --jobs, on the loop's thread and the others (strace -f; a run of its own)")
    p.add_argument("--wakes-child", action="store_true", help=argparse.SUPPRESS)  # the traced run
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--echo", nargs=2, metavar=("TRANSPORT", "PATH"), help=argparse.SUPPRESS)  # the far side
    args = p.parse_args(argv)
    if args.echo:
        import uvloop

        uvloop.run(_echo(*args.echo))
        return 0
    if args.wakes_child:
        import uvloop
        from coalesce.service.logs import configure

        configure("warning")
        jobs = int(args.jobs.split(",")[-1])
        _, per_message, *_ = uvloop.run(_engine_rounds(
            jobs, args.rounds, False, args.gateways, args.cache_mb, args.model, _WakeMarks(),
            depth=args.pipeline_depth, forward_s=args.forward_us / 1e6, in_flight=args.in_flight))
        print(json.dumps({"batches": per_message * args.rounds * args.gateways}))
        return 0
    with contextlib.ExitStack() as stack:
        if args.shared_metrics:
            # prometheus_client picks its value storage when first imported: the directory goes first.
            if "prometheus_client" in sys.modules:
                raise SystemExit("--shared-metrics: prometheus_client came before its directory")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = stack.enter_context(tempfile.TemporaryDirectory())
        if args.in_flight < 1 or args.forward_us < 0:
            raise SystemExit("--in-flight is at least 1 and --forward-us at least 0")
        figures = measure([int(j) for j in args.jobs.split(",")], args.rounds, args.profile, args.gateways,
                          args.cache_mb, args.model, args.ops, args.pipeline_depth, args.wakes,
                          args.forward_us, args.in_flight, not args.no_round_trips)
    if args.json:
        print(json.dumps(figures))
        return 0
    if args.gateways > 1:
        print(f"{args.gateways} gateways, one message each per round, in one event-loop turn")
    if args.pipeline_depth:
        print(f"pipeline depth {args.pipeline_depth}")
    if args.forward_us or args.in_flight > 1:
        print(f"the forward {args.forward_us:g} µs without the interpreter lock; {args.in_flight} "
              f"round(s) in flight; each row's batches handed to a busy device: "
              + ", ".join(f"{r['handed_busy']:.0%}" for r in figures["rows"])
              + "; threaded, requests answered a second: "
              + ", ".join(f"{r['threaded_rps']:,.0f}" for r in figures["rows"]))
    if args.cache_mb or args.shared_metrics:
        where = "shared (multiprocess)" if args.shared_metrics else "this process's"
        print(f"result cache {args.cache_mb} MiB; metrics {where}")
    print("requests/message  batches/message  inputs/batch  threaded µs/request  inline µs/request  "
          "hand-off µs/batch")
    for r in figures["rows"]:
        print(f"{r['jobs']:>16}  {r['batches']:>15.2f}  {r['inputs_per_batch']:>12.1f}  "
              f"{r['threaded_us']:>19.1f}  {r['inline_us']:>17.1f}  {r['hand_off_us']:>17.1f}")
    if figures["thread_round_trip_us"] is not None:
        print(f"bare thread round trip (SimpleQueue.put, call_soon_threadsafe): "
              f"{figures['thread_round_trip_us']:.1f} µs CPU")
    for transport, (mine, theirs) in figures["message_round_trip_us"].items():
        print(f"message round trip to another process over {transport}: {mine:.1f} µs CPU here, "
              f"{theirs:.1f} µs there")
    if figures["ops_per_request"] is not None:
        o = figures["ops_per_request"]
        print(f"per request, inline, {o['jobs']} a message: {o['bytecodes']:.0f} Python bytecodes, "
              f"{o['calls']:.1f} Python function calls (sys.settrace); the most, bytecodes per request:")
        for where, count in o["top"]:
            print(f"  {count:8.1f}  {where}")
        print(f"objects left in reference cycles (for the garbage collector), per request: {o['cycles']:.2f}")
    if figures["wakes_per_batch"] is not None:
        w = figures["wakes_per_batch"]
        print(f"per batch, threaded, {w['jobs']} a message ({w['batches']:.0f} batches; strace -f):")
        for side, name in (("loop", "the event loop's thread"), ("others", "the other threads")):
            c = w[side]
            print(f"  {name}: {c['futex_wake']:.2f} futex wakes, {c['futex_wait']:.2f} futex waits, "
                  f"{c['poll']:.2f} polls, {c['read']:.2f} reads, {c['write']:.2f} writes")
    if figures["profile"]:
        print(figures["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
