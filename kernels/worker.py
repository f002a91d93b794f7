"""The threads that run models. Exactly one thread per device touches the accelerator.

``DeviceThread`` is that thread (shared by every model on the device, so models take turns rather than
contend). ``ModelWorker`` adds, per model, a CPU thread that pads the next batch while the current one
runs. Callers on the event loop await coroutines; the threads never touch asyncio state.

Each of these threads is a :class:`Lane`: one thread that runs what it is handed, in order. Handing work
to a thread is paid on the event loop for every batch (and, in the gateway, for every turn's
tokenising), so a lane takes a call without the executor's future, work item, locks and idle semaphore:
the caller says how the outcome comes back (``loop.call_soon_threadsafe``). It is still an
``Executor`` (``submit``, ``run_in_executor``) for the calls that want a future.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from queue import Empty, SimpleQueue
from typing import Any, TypeVar, cast

import numpy as np

from .protocol import OutputKind, Runner, TokenRunner

T = TypeVar("T")
# A lane's item: (what to run, its arguments, what to call instead when it is dropped unrun), or None:
# stop once what came before has run.
_Item = tuple[Callable[..., object], tuple[Any, ...], Callable[[], object] | None] | None

_live: weakref.WeakSet[Lane] = weakref.WeakSet()
_exiting = False


def _at_exit() -> None:
    # As ThreadPoolExecutor's threads are at interpreter exit: what was handed over runs, then they end.
    global _exiting
    _exiting = True
    lanes = list(_live)
    for lane in lanes:
        lane._queue.put(None)
    for lane in lanes:
        if lane._thread is not None:
            lane._thread.join()


threading._register_atexit(_at_exit)  # type: ignore[attr-defined]  # before joining, as the pool's


def _lane_thread(queue: SimpleQueue[_Item]) -> None:
    # (Holds the queue, not the lane: a lane nobody holds any more is collected, and its finaliser
    # stops this thread.)
    while True:
        item = queue.get()
        if item is None:
            return
        fn, args, _ = item
        try:
            fn(*args)
        except BaseException:  # a call answers its own failures; nothing may end the lane
            traceback.print_exc()
        del item, fn, args


class Lane(Executor):
    """One thread that runs the calls handed to it, in the order they came (an executor of one worker).

    :meth:`call` hands a call over without a future: the cheapest hand-off to a thread, for callers that
    deliver the outcome themselves (a call must not raise: what it raises is printed and dropped).
    ``submit`` returns a future, for ``run_in_executor``. After :meth:`shutdown` both raise RuntimeError,
    as ThreadPoolExecutor's ``submit`` does. The thread starts with the first call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: SimpleQueue[_Item] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        weakref.finalize(self, self._queue.put, None)

    def call(self, fn: Callable[..., object], *args: Any,
             dropped: Callable[[], object] | None = None) -> None:
        """Run ``fn(*args)`` on the lane's thread after what was handed over before; ``dropped`` (when
        given) is called instead, on the thread that shuts the lane down, if it never runs
        (``shutdown(cancel_futures=True)``)."""
        if self._closed or _exiting:
            raise RuntimeError(f"lane {self.name} is shut down")
        if self._thread is None:
            self._start()
        self._queue.put((fn, args, dropped))

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=_lane_thread, args=(self._queue,), name=self.name)
                thread.start()
                self._thread = thread
                _live.add(self)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # the future carries it, as the pool's does
                future.set_exception(exc)
            else:
                future.set_result(result)

        self.call(run, dropped=future.cancel)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; with ``cancel_futures``, drop those not started (their ``dropped`` is
        called); the thread ends once the rest has run (``wait``: wait for that)."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except Empty:
                    break
                if item is not None and item[2] is not None:
                    try:
                        item[2]()
                    except Exception:  # one caller's cleanup must not stop the others'
                        traceback.print_exc()
        self._queue.put(None)
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


def _hand(lane: Lane, reply: Callable[[BatchOutput | Exception], None],
          fn: Callable[..., BatchOutput | None], *args: object) -> None:
    """Run ``fn(*args)`` on ``lane``'s thread; ``reply`` gets what it returns (unless None: it handed
    the batch on) or what it raised, including a lane that no longer takes work (shutdown)."""
    try:
        lane.call(_answer, reply, fn, args)
    except RuntimeError as exc:
        reply(exc)


def _answer(reply: Callable[[BatchOutput | Exception], None], fn: Callable[..., BatchOutput | None],
            args: tuple[object, ...]) -> None:
    try:
        out = fn(*args)
    except Exception as exc:
        reply(exc)
    else:
        if out is not None:
            reply(out)


def _settle(fut: asyncio.Future[BatchOutput], outcome: BatchOutput | Exception) -> None:
    if fut.done():
        return  # the caller stopped waiting
    if isinstance(outcome, Exception):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


class DeviceThread:
    """The single thread that owns a device: every forward, finish and warm-up runs here.

    ``after_batch``, when given, is called on this thread after every batch's forward (it must be quick:
    the next batch waits for it); the engine passes the allocator's trimmer here.

    On the CPU it may be several (:meth:`side_by_side`): one forward per thread at once, each on one
    core, instead of one forward at a time on every core."""

    def __init__(self, name: str = "device", after_batch: Callable[[], None] | None = None) -> None:
        self._name = name
        self._pool = Lane(f"coalesce-{name}")
        self.lanes = [self._pool]  # the threads that run forwards (one, but on the CPU by side_by_side)
        self.busy = [0]  # batches handed to each lane and not yet answered (counted on the event loop)
        self.after_batch = after_batch
        # Batches of every model on this device handed over and not yet answered: counted on the event
        # loop (``ModelWorker.start``), which reads it to tell an idle device from a busy one.
        self.in_flight = 0

    @property
    def executor(self) -> Lane:
        return self._pool

    def side_by_side(self, forwards: int, set_threads: Callable[[int], object]) -> None:
        """Run up to ``forwards`` forwards at once, each on a thread of its own whose operators run on
        one core (``set_threads(1)`` on each, torch's count being each thread's own), before any
        forward. Why: ``python -m coalesce.loadtests.forward_lanes``."""
        for k in range(len(self.lanes), forwards):
            self.lanes.append(Lane(f"coalesce-{self._name}-{k}"))
            self.busy.append(0)
        for lane in self.lanes:
            lane.call(set_threads, 1)

    def pick(self) -> int:
        """The lane the next batch goes to: the least busy, the first of those (the event loop)."""
        busy = self.busy
        return 0 if len(busy) == 1 else busy.index(min(busy))

    def close(self) -> None:
        for lane in self.lanes:
            lane.shutdown(wait=True, cancel_futures=False)


@dataclass(frozen=True, slots=True)
class BatchOutput:
    rows: np.ndarray  # float32, in batch order: a row per input (pooled) or per token (tokens)
    prepare_s: float
    forward_s: float  # forward + finish on the device thread
    threads: int = 0  # the threads its CPU forward ran on, where a LoopShare sets them (else 0)


class LoopShare:
    """How many threads a torch CPU forward runs on: all of them, or one fewer while the event loop's own
    thread has been busy more than ``above`` of the time.

    Why: on the CPU the forward's operators run on OpenMP threads, one per core by default, beside the
    event loop's thread (which reads, answers and, under overload, refuses every request). While that
    thread is busy most of the time the forward's threads and it want more cores than there are: the
    kernel keeps taking one of the forward's threads off its core, every operator waits at its end for
    that one, and the threads that wait spin on the cores the event loop needs. Under an overload four
    times the capacity of a 2-core machine, where the event loop was busy 0.52-0.62 of the time, a
    server whose forwards ran on one thread served more than one on two, within its latency target
    (BENCHMARKS.md, issue 23); at half that load, with the loop busy 0.4 of the time, two threads
    served more. So the forward leaves the loop a core only while the loop needs most of one.

    :meth:`on_loop` runs on the event loop once a batch (it reads the loop thread's CPU clock) and judges
    the share over windows of at least :data:`WINDOW_S`, calling ``on_change`` (on the loop) with a new
    count; :meth:`on_device` runs on the device thread before each forward and sets torch's thread count
    there when it changed (the count is the calling thread's own: no other thread's forwards or
    operators change).

    A thread is taken only after :data:`ABOVE_WINDOWS` whole windows in a row above the share, and given
    back after the first window at or under it. The onset of an overload is one busy window: the queue
    fills before it stands, and every request of that second is read, checked and tokenised before the
    head check refuses the next ones. A forward on one thread fewer there runs slower just when the queue
    is longest, which is what the admitted requests of that moment wait on; a sustained overload keeps
    the loop busy window after window. Giving back at once costs nothing: the forward runs on every
    core, as it does at any lighter load.

    The service may hold the count lower still (:meth:`limit`: the forward's own measured speed, which a
    core busy with another program slows however light the load — ``service/engine/threads.py``), and
    run one forward on another count to measure it (:meth:`probe`); a batch's :attr:`BatchOutput.threads`
    says what it ran on.

    With ``judge_forward`` (the engine process of ``--workers N``) the share judged is the forward's own:
    seconds of forwards per second, as :meth:`forwarded` adds them. The requests are read, tokenised and
    answered by the gateway processes there, so the engine's loop is never busy; but each request and
    each answer wakes a gateway and the engine's loop, and every such wake-up takes a forward thread off
    its core for a moment, while the operator waits for it. Under 32 clients on 2 cores ``--workers 2``
    with its forward on both threads served two thirds of the requests it served with the forward on
    one (BENCHMARKS.md, engine section). So there the forward leaves the gateways a core while it runs
    most of the time: when the replica is saturated, not for a lone request."""

    WINDOW_S = 1.0
    ABOVE_WINDOWS = 2

    def __init__(self, cores: int, above: float, set_threads: Callable[[int], object],
                 clock: Callable[[], float] = time.monotonic,
                 loop_cpu: Callable[[], float] = time.thread_time, *, judge_forward: bool = False) -> None:
        self.cores = cores
        self.above = above
        self.threads = cores  # what the next forward runs on (written on the loop, read on the device thread)
        self.busy = 0.0  # the judged busy share (the loop's, or the forward's) over the last whole window
        self.judged = "forward" if judge_forward else "loop"
        self._forward_s = 0.0  # seconds of forwards so far (added on the device thread; judge_forward only)
        self._set_threads = set_threads
        self._clock = clock
        self._spent = (lambda: self._forward_s) if judge_forward else loop_cpu
        self._start, self._start_cpu = clock(), self._spent()
        self._applied = cores
        self._above = 0  # whole windows in a row the loop was busy more than ``above``
        self._judged = cores  # what the busy share says (threads: at most that and :attr:`cap`)
        self.cap = cores  # the most the forward's measured speed allows (:meth:`limit`)
        self._probe = 0  # the next forward's count instead of :attr:`threads`, once (:meth:`probe`)
        self.on_change: Callable[[int], object] | None = None

    def on_loop(self) -> None:
        """The event loop's thread, once a batch: close the window once it is long enough."""
        now = self._clock()
        elapsed = now - self._start
        if elapsed < self.WINDOW_S:
            return
        cpu = self._spent()
        self.busy = (cpu - self._start_cpu) / elapsed
        self._start, self._start_cpu = now, cpu
        self._above = self._above + 1 if self.busy > self.above else 0
        self._judged = self.cores - 1 if self._above >= self.ABOVE_WINDOWS else self.cores
        self._settle()

    def limit(self, cap: int) -> None:
        """The event loop: the forward's measured speed allows at most ``cap`` threads (the service's
        ``engine/threads.py`` measures it: a forward on every core whose cores are not all free runs
        slower than on fewer)."""
        self.cap = max(1, min(cap, self.cores))
        self._settle()

    def probe(self, threads: int) -> None:
        """The event loop: run the next forward handed to the device thread on ``threads``, once, whatever
        :attr:`threads` says (a measurement; a batch's :attr:`BatchOutput.threads` says what it ran on)."""
        self._probe = threads

    def _settle(self) -> None:
        threads = min(self._judged, self.cap)
        if threads != self.threads:
            self.threads = threads
            if self.on_change is not None:
                self.on_change(threads)

    def forwarded(self, seconds: float) -> None:
        """The device thread, after each forward (counted when the forward's share is judged)."""
        self._forward_s += seconds

    def on_device(self) -> int:
        """The device thread, before a forward: run it on :attr:`threads` (or once on a probe's count);
        that count."""
        threads = self._probe or self.threads
        self._probe = 0
        if threads != self._applied:
            self._set_threads(threads)
            self._applied = threads
        return threads


def torch_device(runner: object) -> object:
    """Where torch's threads run ``runner``'s forward, for :func:`cpu_forwards`, :func:`side_by_side` and
    :func:`loop_share`: its device, or None for a runner whose forward runs on its runtime's own thread
    pool (``own_threads``: ONNX Runtime, OpenVINO), whatever torch's count, even where torch is imported."""
    return None if getattr(runner, "own_threads", False) else getattr(runner, "device", None)


def _cpu_torch(device: object) -> Any:
    """torch, for a runner whose forward runs on ``device`` when that is torch's CPU forward; None for a
    GPU's forward, or in a process that has not imported torch (the torch-free runners' thread pools are
    their own)."""
    return sys.modules.get("torch") if str(device) == "cpu" else None


def loop_share(device: object, above: float, *, judge_forward: bool = False) -> LoopShare | None:
    """The :class:`LoopShare` for a runner whose forward runs on ``device``: only torch's CPU forward on
    more than one thread (:func:`_cpu_torch`), with ``above`` > 0 (0 turns it off); else None.
    ``judge_forward``: the forward's busy share, not the loop's (the engine process of ``--workers``)."""
    torch = _cpu_torch(device)
    if above <= 0 or torch is None:
        return None
    cores = torch.get_num_threads()
    return LoopShare(cores, above, torch.set_num_threads, judge_forward=judge_forward) if cores > 1 else None


# ``--cpu-forwards 0`` (auto) runs this many forwards side by side where torch's CPU forward has exactly
# this many cores and runs without the interpreter lock (a traced forward), in one process: measured on a
# 2-core machine (BENCHMARKS.md, overload section); one forward at a time elsewhere until larger hosts are
# measured, and in the engine process of ``--workers``, whose gateways share those cores (measured there
# too: one at a time kept the tail under an open-loop overload and served more in a closed loop).
AUTO_FORWARDS = 2


def cpu_forwards(device: object, forwards: int, runner: object, *, beside_gateways: bool = False) -> int:
    """``--cpu-forwards`` for a runner whose forward runs on ``device``: ``forwards`` as given, or for 0
    (auto) :data:`AUTO_FORWARDS` where torch's CPU forward (:func:`_cpu_torch`) has exactly that many
    threads and ``runner`` says its forward releases the interpreter lock (``forward_releases_lock``),
    else 1. Forwards side by side that each take the lock back after every operator wait for each other
    and for the event loop (lock_contention.py): one forward on every core served more there.
    ``beside_gateways`` (the engine process of ``--workers``): auto is 1. There the gateway processes
    share the forwards' cores, and on two cores two forwards side by side answered a 2× open-loop
    overload's admitted requests at a p99 of 0.77–1.47 s against 0.49–0.50 s one at a time (serving more
    of it), a cold 4× flood's at 2.3–6.0 s against 0.7–0.9 s, and 32 closed-loop clients at 0.81–1.00×
    the rate (BENCHMARKS.md, the session of 2026-12-06 19:57)."""
    if forwards > 0:
        return forwards
    torch = _cpu_torch(device)
    if beside_gateways or torch is None or not getattr(runner, "forward_releases_lock", False):
        return 1
    return AUTO_FORWARDS if torch.get_num_threads() == AUTO_FORWARDS else 1


def side_by_side(device: object, forwards: int) -> Callable[[int], object] | None:
    """How to put a forward's operators on one core (torch's ``set_num_threads``), for a runner whose
    forward runs on ``device``, when ``forwards`` > 1 of them are to run side by side: only torch's CPU
    forward (:func:`_cpu_torch`); else None, and for ``forwards`` of 1."""
    torch = _cpu_torch(device)
    if forwards <= 1 or torch is None:
        return None
    return cast(Callable[[int], object], torch.set_num_threads)


class ModelWorker:
    """Drives one runner: prepare on a CPU thread, forward and finish on the device thread.

    A batch is prepared on the CPU thread only when that overlaps something: with ``overlap`` on (a GPU)
    and a batch already in flight on the device, the next one is padded while the device runs it. With
    ``overlap`` off (one batch in flight at a time, as on CPU), or when the device has nothing in flight
    (a lone request, a light load), there is nothing to prepare beside, so the batch is prepared on the
    device thread too: one thread hand-off per batch instead of two, and one thread wake-up less before
    its forward starts.
    """

    def __init__(self, runner: Runner, device: DeviceThread, *, overlap: bool = True,
                 share: LoopShare | None = None) -> None:
        self.runner = runner
        self._device = device
        self._overlap = overlap
        self.share = share  # (None: the forward's threads are left as they are)
        self._cpu = Lane(f"coalesce-prep-{runner.info.name}")

    async def run(self, batch: Sequence[Sequence[int]], kind: OutputKind = OutputKind.POOLED) -> BatchOutput:
        """Run one batch of complete id sequences, all of one output ``kind``. Raises whatever the
        runner raised (a runner without token output asked for tokens raises TypeError)."""
        fut: asyncio.Future[BatchOutput] = asyncio.get_running_loop().create_future()
        self.start(batch, kind, partial(_settle, fut))
        return await fut

    def start(self, batch: Sequence[Sequence[int]], kind: OutputKind,
              done: Callable[[BatchOutput | Exception], None]) -> None:
        """Run one batch as :meth:`run` does and call ``done`` with its output, or the exception it
        raised, on the calling event loop. No future: the batch goes from the preparing thread
        straight to the device thread, and comes back to the loop once (the batcher's hand-off)."""
        loop = asyncio.get_running_loop()
        answered = self._answered
        if self.share is not None:
            self.share.on_loop()
        device = self._device
        lane = device.pick()

        def reply(outcome: BatchOutput | Exception) -> None:  # any thread
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
                loop.call_soon_threadsafe(answered, done, outcome, lane)

        device.in_flight += 1
        device.busy[lane] += 1
        if not self._overlap or device.in_flight == 1:  # nothing in flight to prepare beside
            _hand(device.lanes[lane], reply, self._prepare_and_forward, batch, kind)
        else:
            _hand(self._cpu, reply, self._prepare_then_forward, batch, kind, reply)

    def _answered(self, done: Callable[[BatchOutput | Exception], None], outcome: BatchOutput | Exception,
                  lane: int) -> None:
        # The event loop: a batch's outcome is back, so it is no longer in flight.
        self._device.in_flight -= 1
        self._device.busy[lane] -= 1
        done(outcome)

    def _prepare_then_forward(self, batch: Sequence[Sequence[int]], kind: OutputKind,
                              reply: Callable[[BatchOutput | Exception], None]) -> None:
        # The CPU thread: pad this batch while the device runs the previous one, then queue its forward.
        t0 = time.perf_counter()
        prepared = self.runner.prepare(batch)
        prepare_s = time.perf_counter() - t0
        _hand(self._device.executor, reply, self._forward_output, prepared, kind, prepare_s)

    def _forward_output(self, prepared: object, kind: OutputKind, prepare_s: float) -> BatchOutput:
        # Device thread only.
        rows, forward_s, threads = self._forward(prepared, kind)
        return BatchOutput(rows=rows, prepare_s=prepare_s, forward_s=forward_s, threads=threads)

    def _forward(self, prepared: object, kind: OutputKind) -> tuple[np.ndarray, float, int]:
        # Device thread only.
        threads = self.share.on_device() if self.share is not None else 0
        t0 = time.perf_counter()
        if kind is OutputKind.TOKENS:
            if not self.runner.info.token_embeddings:
                raise TypeError(f"model {self.runner.info.name} does not return token embeddings")
            runner = cast(TokenRunner, self.runner)
            rows = runner.finish_tokens(runner.forward_tokens(prepared), prepared)
        else:
            rows = self.runner.finish(self.runner.forward(prepared), prepared)
        if self._device.after_batch is not None:
            self._device.after_batch()
        seconds = time.perf_counter() - t0
        if self.share is not None:
            self.share.forwarded(seconds)
        return rows, seconds, threads

    def _prepare_and_forward(self, batch: Sequence[Sequence[int]], kind: OutputKind) -> BatchOutput:
        # Device thread only.
        t0 = time.perf_counter()
        prepared = self.runner.prepare(batch)
        rows, forward_s, threads = self._forward(prepared, kind)
        return BatchOutput(rows=rows, prepare_s=time.perf_counter() - t0 - forward_s, forward_s=forward_s,
                           threads=threads)

    async def warmup(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._device.executor, self.runner.warmup)

    def close(self) -> None:
        self._cpu.shutdown(wait=True, cancel_futures=False)
