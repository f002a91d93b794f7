"""The model worker's hand-off: a batch's rows, or the exception its runner raised while preparing or
running it, come back to the event loop, whether the batch is prepared beside the device (pipelined)
or on it; and batches run in the order they were handed over. And the CPU forward's thread count
against the event loop's busy share (``LoopShare``, ``--loop-core-share``)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from coalesce.kernels.protocol import OutputKind
from coalesce.kernels.worker import (
    BatchOutput,
    DeviceThread,
    LoopShare,
    ModelWorker,
    cpu_forwards,
    loop_share,
    side_by_side,
    torch_device,
)

from ..fakes import Clocks, FakeRunner


class _BadPrepare(FakeRunner):
    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        raise ValueError("cannot pad this")


@pytest.mark.parametrize("overlap", [True, False])
async def test_rows_and_failures_come_back_to_the_loop_in_order(overlap: bool) -> None:
    runner = FakeRunner(fail_token=666)
    device = DeviceThread("test")
    worker = ModelWorker(runner, device, overlap=overlap)
    try:
        got: list[BatchOutput | Exception] = []
        done = asyncio.Event()
        batches = [[[1, 5, 2]], [[1, 666, 2]], [[1, 7, 2], [1, 8, 9, 2]]]

        def collect(outcome: BatchOutput | Exception) -> None:
            got.append(outcome)
            if len(got) == len(batches):
                done.set()

        for batch in batches:
            worker.start(batch, OutputKind.POOLED, collect)
        await asyncio.wait_for(done.wait(), 10)
        first, failed, last = got
        assert isinstance(first, BatchOutput) and isinstance(last, BatchOutput)
        np.testing.assert_array_equal(first.rows, [runner.vector([1, 5, 2])])
        np.testing.assert_array_equal(last.rows, [runner.vector([1, 7, 2]), runner.vector([1, 8, 9, 2])])
        assert isinstance(failed, RuntimeError) and "injected" in str(failed)
        assert runner.batches == [1, 1, 2], "every batch reached the runner, in the order handed over"

        bad = ModelWorker(_BadPrepare(), device, overlap=overlap)
        with pytest.raises(ValueError, match="cannot pad"):
            await bad.run([[1, 2]])
        bad.close()
    finally:
        worker.close()
        device.close()


class _Held(FakeRunner):
    """Records which thread prepared each batch; a forward waits for ``release`` while ``hold`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared_on: list[str] = []
        self.hold = threading.Event()
        self.release = threading.Event()
        self.running = threading.Event()

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        self.prepared_on.append(threading.current_thread().name)
        return super().prepare(batch)

    def forward(self, prepared: list[list[int]]) -> list[list[int]]:
        if self.hold.is_set():
            self.running.set()
            assert self.release.wait(10)
        return super().forward(prepared)


async def test_a_batch_is_prepared_beside_the_device_only_when_the_device_is_busy() -> None:
    """Pipelined (a GPU): a batch handed over while another runs is padded on the CPU thread, beside
    that forward; one handed to an idle device is prepared on the device thread, with one thread
    wake-up less before its forward, and so is the next one once the device is idle again."""
    runner = _Held()
    device = DeviceThread("test")
    worker = ModelWorker(runner, device, overlap=True)
    try:
        await worker.run([[1, 5, 2]])  # alone: the device was idle
        runner.hold.set()
        first = asyncio.ensure_future(worker.run([[1, 6, 2]]))
        assert await asyncio.to_thread(runner.running.wait, 10)  # its forward is running now
        runner.hold.clear()
        second = asyncio.ensure_future(worker.run([[1, 7, 2]]))
        await asyncio.sleep(0)
        for _ in range(200):  # the second is padded while the first's forward still runs
            if len(runner.prepared_on) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(runner.prepared_on) == 3, "the busy device's next batch was prepared beside it"
        runner.release.set()
        rows = await asyncio.wait_for(asyncio.gather(first, second), 10)
        np.testing.assert_array_equal(rows[1].rows, [runner.vector([1, 7, 2])])
        await worker.run([[1, 8, 2]])  # idle again
        device_thread, prep_thread = "coalesce-test", "coalesce-prep-fake"
        assert runner.prepared_on == [device_thread, device_thread, prep_thread, device_thread]
        assert device.in_flight == 0
    finally:
        runner.release.set()
        worker.close()
        device.close()


# -- the forward's CPU threads against the event loop's busy share ---------------------------------------
def test_the_forward_leaves_the_loop_a_core_while_the_loop_is_busy_most_of_the_time() -> None:
    clocks, set_threads, changes = Clocks(), [], []
    share = LoopShare(4, 0.5, set_threads.append, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu)
    share.on_change = changes.append
    clocks.spend(0.6, busy=0.9)
    share.on_loop()
    share.on_device()
    assert (share.threads, set_threads) == (4, []), "judged over a whole window, not a moment"
    clocks.spend(0.6, busy=0.9)
    share.on_loop()
    assert share.busy == pytest.approx(0.9) and share.threads == 4, "one busy second: an overload's onset"
    clocks.spend(1.0, busy=0.3)
    share.on_loop()
    clocks.spend(1.0, busy=0.9)
    share.on_loop()
    assert share.threads == 4, "busy windows apart are not an overload"
    clocks.spend(1.0, busy=0.8)
    share.on_loop()
    assert share.busy == pytest.approx(0.8) and share.threads == 3, "two busy windows in a row"
    share.on_device()
    share.on_device()
    assert set_threads == [3], "set once, when it changed"
    clocks.spend(1.0, busy=0.4)  # the flood is over: the loop needs less than half a core
    share.on_loop()
    share.on_device()
    assert set_threads == [3, 4], "given back after one quiet window"
    clocks.spend(1.0, busy=0.5)  # (at the bound: all of them)
    share.on_loop()
    share.on_device()
    assert set_threads == [3, 4] and changes == [3, 4]


def test_only_torch_s_cpu_forward_on_several_threads_gets_one(monkeypatch: pytest.MonkeyPatch) -> None:
    set_threads: list[int] = []
    torch = SimpleNamespace(get_num_threads=lambda: 4, set_num_threads=set_threads.append)
    monkeypatch.setitem(sys.modules, "torch", torch)
    share = loop_share("cpu", 0.5)
    assert share is not None and (share.cores, share.above, share.threads) == (4, 0.5, 4)
    assert loop_share("cuda:0", 0.5) is None
    assert loop_share("cpu", 0.0) is None, "0 turns it off"
    own = SimpleNamespace(device="cpu", own_threads=True)  # (ONNX Runtime, OpenVINO: a pool of their own)
    assert loop_share(torch_device(own), 0.5) is None, "torch imported, but not what runs the forward"
    assert side_by_side(torch_device(own), 2) is None and cpu_forwards(torch_device(own), 0, own) == 1
    assert torch_device(FakeRunner()) == "cpu"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert loop_share("cpu", 0.5) is None, "a forward on one thread has none to spare"
    monkeypatch.delitem(sys.modules, "torch")
    assert loop_share("cpu", 0.5) is None, "a torch-free process (ONNX Runtime, OpenVINO) is left alone"


class _Threads(FakeRunner):
    """Records torch's thread count as each forward sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, prepared: object) -> object:
        import torch

        self.seen.append(torch.get_num_threads())
        return super().forward(prepared)


async def test_the_device_thread_s_forwards_run_on_fewer_threads_and_no_other_thread_s_do() -> None:
    import torch

    clocks = Clocks()
    share = LoopShare(2, 0.5, torch.set_num_threads, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu)
    runner, device = _Threads(), DeviceThread("test")
    worker = ModelWorker(runner, device, overlap=False, share=share)
    main_threads = torch.get_num_threads()
    try:
        for _ in range(LoopShare.ABOVE_WINDOWS):
            clocks.spend(1.0, busy=1.0)
            await worker.run([[1, 5, 2]])
        clocks.spend(1.0, busy=0.1)
        await worker.run([[1, 6, 2]])
        assert runner.seen[-2:] == [1, 2]
        assert torch.get_num_threads() == main_threads, "torch's count is the device thread's own"
    finally:
        worker.close()
        device.close()
        torch.set_num_threads(main_threads)  # (the count new threads start from is process-wide)


async def test_every_model_s_cpu_forward_shares_the_engine_s_count_and_its_gauge_shows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from coalesce.service.engine import core
    from coalesce.service.metrics import Metrics
    from coalesce.service.settings import build

    clocks, set_threads, judged = Clocks(), [], []

    def loop_share(device: object, above: float, *, judge_forward: bool = False) -> LoopShare:
        judged.append(judge_forward)
        return LoopShare(4, above, set_threads.append, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu)

    monkeypatch.setattr(core, "loop_share", loop_share)
    s = build(["--model", "a=/models/a", "--model", "b=/models/b", "--loop-core-share", "0.6"], environ={})
    metrics = Metrics()
    engine = core.Engine(s, metrics, lambda spec: FakeRunner(info=replace(FakeRunner().info, name=spec.name)))
    await engine.load()
    try:
        share = engine.share
        assert share is not None and share.above == 0.6
        assert [m.worker.share for m in engine.models] == [share, share], "one device thread, one count"

        def threads() -> float | None:
            return metrics.registry.get_sample_value("coalesce_forward_threads")

        assert threads() == 4
        # Each model's cost model was seeded on one thread fewer too (engine/threads.py): its seeds ran
        # there and the count came back for the next forward.
        assert set_threads == [3, 4, 3, 4]
        del set_threads[:]
        clocks.spend(1.0, busy=0.7)
        await engine.models[0].worker.run([[1, 5, 2]])
        clocks.spend(1.0, busy=0.7)
        await engine.models[1].worker.run([[1, 5, 2]])
        assert threads() == 3 and set_threads == [3], "the two models' batches judged as one loop's"
        clocks.spend(1.0, busy=0.2)
        await engine.models[0].worker.run([[1, 5, 2]])
        assert threads() == 4 and set_threads == [3, 4]
        assert judged == [False], "one process judges its loop"
    finally:
        await engine.close()
    engine = core.Engine(build(["--role", "engine", "--model", "a=/models/a"], environ={}), Metrics(),
                         lambda spec: FakeRunner())
    await engine.load()
    await engine.close()
    assert judged == [False, True], "the engine process of --workers judges its forwards"


def test_the_engine_s_forward_leaves_the_gateways_a_core_while_it_runs_most_of_the_time() -> None:
    clocks, set_threads = Clocks(), []
    share = LoopShare(4, 0.5, set_threads.append, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu,
                      judge_forward=True)
    for _ in range(LoopShare.ABOVE_WINDOWS):
        clocks.spend(1.0, busy=0.1)  # (the engine's loop: hardly busy, and not what is judged)
        share.forwarded(0.4)
        share.forwarded(0.4)
        share.on_loop()
    share.on_device()
    assert share.busy == pytest.approx(0.8) and set_threads == [3], "saturated: one thread fewer"
    clocks.spend(1.0, busy=0.9)  # a busy loop alone does not take a thread here
    share.forwarded(0.3)
    share.on_loop()
    share.on_device()
    assert share.busy == pytest.approx(0.3) and set_threads == [3, 4], "a lighter load: every core"


class _Slow(FakeRunner):
    """A forward that takes at least ``seconds``."""

    seconds = 0.02

    def forward(self, prepared: object) -> object:
        time.sleep(self.seconds)
        return super().forward(prepared)


async def test_the_device_thread_counts_its_forwards_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LoopShare, "WINDOW_S", 0.1)
    clocks, set_threads = Clocks(), []
    share = LoopShare(2, 0.5, set_threads.append, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu,
                      judge_forward=True)
    device = DeviceThread("test")
    worker = ModelWorker(_Slow(), device, overlap=False, share=share)
    try:
        for _ in range(12):  # each forward busy at least two thirds of the (virtual) time between them
            await worker.run([[1, 5, 2]])
            clocks.spend(0.03, busy=0.0)
        assert share.threads == 1 and share.busy >= 0.6
        for _ in range(3):
            await worker.run([[1, 5, 2]])
            clocks.spend(1.0, busy=0.0)
        assert share.threads == 2, "idle between forwards: every core again"
    finally:
        worker.close()
        device.close()


# -- forwards side by side (--cpu-forwards) ---------------------------------------------------------------
class _Meeting(FakeRunner):
    """A forward that returns only once ``parties`` forwards are running at once (or fails after 10 s),
    recording torch's thread count where it runs."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=10)
        self.seen: list[int] = []

    def forward(self, prepared: object) -> object:
        import torch

        self.seen.append(torch.get_num_threads())
        self.barrier.wait()
        return super().forward(prepared)


async def test_forwards_side_by_side_run_at_once_each_on_one_core() -> None:
    import torch

    main_threads = torch.get_num_threads()
    runner, device = _Meeting(2), DeviceThread("test")
    device.side_by_side(2, torch.set_num_threads)
    worker = ModelWorker(runner, device, overlap=False)
    try:
        first, second = await asyncio.gather(worker.run([[1, 5, 2]]), worker.run([[1, 6, 2]]))
        assert first.rows.shape[0] == second.rows.shape[0] == 1, "both met: they ran at once"
        assert runner.seen == [1, 1], "each on one thread"
        assert device.busy == [0, 0] and device.in_flight == 0
        assert torch.get_num_threads() == main_threads, "the count is each lane's own"
        runner.barrier = threading.Barrier(1)
        await worker.run([[1, 7, 2]])  # an idle device's batch goes to the first lane
        assert len(runner.seen) == 3
    finally:
        worker.close()
        device.close()


def test_only_torch_s_cpu_forward_runs_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = SimpleNamespace(set_num_threads=lambda n: None)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert side_by_side("cpu", 2) is torch.set_num_threads
    assert side_by_side("cpu", 1) is None, "one at a time: as before"
    assert side_by_side("cuda:0", 2) is None
    monkeypatch.delitem(sys.modules, "torch")
    assert side_by_side("cpu", 2) is None, "a torch-free process (ONNX Runtime, OpenVINO) is left alone"


def test_auto_cpu_forwards_are_two_only_for_a_lock_free_forward_on_two_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--cpu-forwards 0`` (auto, the default): two forwards side by side where torch's CPU forward has
    exactly two cores and its forward releases the interpreter lock (traced), else one at a time; a
    number given is kept. (The core count is mocked: any machine runs this.)"""
    cores = [2]
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(get_num_threads=lambda: cores[0]))
    traced, python = SimpleNamespace(forward_releases_lock=True), SimpleNamespace(forward_releases_lock=False)
    assert cpu_forwards("cpu", 0, traced) == 2
    assert cpu_forwards("cpu", 0, python) == 1, "forwards that take the lock back wait for each other"
    assert cpu_forwards("cpu", 0, FakeRunner()) == 1, "a runner that says nothing: one"
    assert cpu_forwards("cuda:0", 0, traced) == 1, "a GPU's forward"
    assert (cpu_forwards("cpu", 1, traced), cpu_forwards("cpu", 3, python)) == (1, 3), "as given"
    for n in (1, 4, 16):
        cores[0] = n
        assert cpu_forwards("cpu", 0, traced) == 1, f"{n} cores: not measured, one at a time"
    cores[0] = 2
    assert cpu_forwards("cpu", 0, traced, beside_gateways=True) == 1, "the engine of --workers: one at a time"
    assert cpu_forwards("cpu", 2, traced, beside_gateways=True) == 2, "as given"
    monkeypatch.delitem(sys.modules, "torch")
    assert cpu_forwards("cpu", 0, traced) == 1, "a torch-free process"


def test_the_traced_cpu_forward_says_it_releases_the_interpreter_lock() -> None:
    import torch
    from coalesce.kernels.encoder_runner import EncoderEngine

    model = SimpleNamespace(pool=lambda ids, lengths: ids)
    engine = EncoderEngine(model, device=torch.device("cpu"), max_tokens=8, pad_id=0,  # type: ignore[arg-type]
                           graphs=SimpleNamespace(enabled=False), cpu_pool=lambda ids, lengths: ids)  # type: ignore[arg-type]
    assert engine.forward_releases_lock
    engine = EncoderEngine(model, device=torch.device("cpu"), max_tokens=8, pad_id=0,  # type: ignore[arg-type]
                           graphs=SimpleNamespace(enabled=False))  # type: ignore[arg-type]
    assert not engine.forward_releases_lock, "the Python forward takes the lock back after every operator"
    copy = EncoderEngine(model, device=torch.device("cpu"), max_tokens=8, pad_id=0,  # type: ignore[arg-type]
                         graphs=SimpleNamespace(enabled=False), cpu_pool=lambda ids, lengths: ids)  # type: ignore[arg-type]
    assert copy.forward_releases_lock
    copy.cpu_pool = None  # (lock_contention's Python side: a copy with the trace dropped)
    assert not copy.forward_releases_lock


async def test_the_engine_resolves_auto_cpu_forwards_from_its_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    from coalesce.service.engine import core
    from coalesce.service.metrics import Metrics
    from coalesce.service.settings import build

    threads: list[int] = []
    # torch's CPU forward on two cores, mocked: what auto reads (any machine runs this)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(get_num_threads=lambda: 2,
                                                              set_num_threads=threads.append))
    for releases, role, lanes in ((True, "all", 2), (False, "all", 1), (True, "engine", 1)):
        runner = replace(FakeRunner(), device="cpu")
        runner.forward_releases_lock = releases  # type: ignore[attr-defined]
        settings = build(["--model", "a=/models/a", "--loop-core-share", "0", "--role", role], environ={})
        assert settings.cpu_forwards == 0, "auto by default"
        engine = core.Engine(settings, Metrics(), lambda spec, r=runner: r)
        await engine.load()
        try:
            assert len(engine.device.lanes) == lanes
            assert engine.models[0].batcher.scheduler.config.forwards == lanes
        finally:
            await engine.close()
    assert threads == [1, 1], "the traced forward's two lanes, each on one thread"


async def test_an_engine_of_cpu_forwards_side_by_side_schedules_that_many_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from coalesce.service.engine import core
    from coalesce.service.metrics import Metrics
    from coalesce.service.settings import build

    threads: list[int] = []
    monkeypatch.setattr(core, "side_by_side",
                        lambda device, forwards: threads.append if forwards > 1 else None)
    metrics = Metrics()
    engine = core.Engine(build(["--model", "a=/models/a", "--cpu-forwards", "2"], environ={}), metrics,
                         lambda spec: FakeRunner())
    await engine.load()
    try:
        sched = engine.models[0].batcher.scheduler
        assert len(engine.device.lanes) == 2
        assert (sched.config.forwards, sched.config.pipeline_depth) == (2, 2)
        assert engine.share is None, "no thread to give back: each forward has one"
        assert metrics.registry.get_sample_value("coalesce_forward_threads") == 1
    finally:
        await engine.close()  # (the lanes' threads joined: what was handed to them has run)
    assert threads == [1, 1], "each lane set to one thread"
