"""The batcher with a fake runner: fan-out, failure isolation, cancellation, backpressure, drain."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace

import numpy as np
import pytest
from coalesce.kernels.protocol import ModelInfo, OutputKind, Task, WindowIds, is_raw
from coalesce.kernels.worker import DeviceThread, ModelWorker
from coalesce.service.batching import batcher as batcher_module
from coalesce.service.batching.batcher import Batcher, Submission
from coalesce.service.batching.cache import ResultCache
from coalesce.service.batching.cost import CostModel
from coalesce.service.batching.policy import Limits
from coalesce.service.batching.scheduler import Scheduler, SchedulerConfig
from coalesce.service.errors import DeadlineExceeded, InferenceFailed, Overloaded, Unavailable
from coalesce.service.metrics import FLUSH_S, Metrics

from ..fakes import FakeRunner, GatedFake


class Rig:
    def __init__(self, runner: FakeRunner, cache: ResultCache | None = None, **kw: object) -> None:
        self.runner = runner
        self.device = DeviceThread("test")
        self.worker = ModelWorker(runner, self.device)
        self.metrics = Metrics()
        config = SchedulerConfig(**{"limits": Limits(64, 16384), **kw})  # type: ignore[arg-type]
        scheduler = Scheduler(config, CostModel(), runner.padded_cost)
        self.batcher = Batcher(
            self.worker, model="fake", scheduler=scheduler, metrics=self.metrics, cache=cache
        )
        self.batcher.start()

    def seqs(self, *texts: str) -> list[list[int]]:
        return [self.runner.with_special_tokens(ids) for ids in self.runner.tokenize(list(texts))]

    async def embed(self, *texts: str) -> list[np.ndarray]:
        result = await self.batcher.submit(self.seqs(*texts))
        return list(result.rows)

    def sample(self, name: str, **labels: str) -> float:
        self.metrics.flush()  # what a scrape reads: the batchers' tallies written first
        value = self.metrics.registry.get_sample_value(name, {"model": "fake", **labels})
        return float(value or 0.0)

    async def aclose(self) -> None:
        await self.batcher.close()
        self.worker.close()
        self.device.close()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(FakeRunner(batch_seconds=0.02))
    yield r
    await r.aclose()


async def test_each_caller_gets_its_own_vector_while_batches_form(rig: Rig) -> None:
    texts = [f"text number {i} with words" for i in range(60)]
    results = await asyncio.gather(*(rig.embed(t) for t in texts))
    for text, (row,) in zip(texts, results, strict=True):
        np.testing.assert_allclose(row, rig.runner.expected(text), rtol=1e-6)
    assert max(rig.runner.batches) > 1, "concurrent requests must share batches"
    distinct = {tuple(seq) for t in texts for seq in rig.seqs(t)}  # the fake tokenizer hashes words
    assert sum(rig.runner.batches) == len(distinct)
    assert rig.sample("coalesce_inputs_total") == len(distinct)


async def test_lone_request_is_dispatched_without_waiting(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # The batcher's clock stands still: a request held for any time at all would never be dispatched,
    # and its queue wait reads exactly 0 only if it went out the moment it arrived.
    now = time.monotonic()
    monkeypatch.setattr(batcher_module, "time", SimpleNamespace(monotonic=lambda: now))
    await asyncio.wait_for(rig.embed("alone"), 10)
    assert rig.runner.batches == [1]
    assert rig.sample("coalesce_queue_wait_seconds_count", priority="normal") == 1
    assert rig.sample("coalesce_queue_wait_seconds_sum", priority="normal") == 0.0


async def test_multi_input_request_keeps_order(rig: Rig) -> None:
    texts = ["a b", "c d e", "f", "g h i j"]
    rows = await rig.embed(*texts)
    for text, row in zip(texts, rows, strict=True):
        np.testing.assert_allclose(row, rig.runner.expected(text), rtol=1e-6)


async def test_token_requests_get_each_tokens_row_and_never_share_a_forward_with_pooled(rig: Rig) -> None:
    texts = [f"text {i} " + "w " * (i % 5) for i in range(30)]

    async def tokens(text: str) -> np.ndarray:
        result = await rig.batcher.submit(rig.seqs(text, text + " x"), kind=OutputKind.TOKENS)
        return result.rows

    results = await asyncio.gather(*(rig.embed(t) for t in texts), *(tokens(t) for t in texts))
    for text, (row,) in zip(texts, results[: len(texts)], strict=True):
        np.testing.assert_allclose(row, rig.runner.expected(text), rtol=1e-6)
    for text, rows in zip(texts, results[len(texts) :], strict=True):
        want = np.concatenate([rig.runner.expected_tokens(text), rig.runner.expected_tokens(text + " x")])
        np.testing.assert_allclose(rows, want, rtol=1e-6)
    # Every pooled input ran in a pooled forward and every token input in a token forward.
    assert sum(rig.runner.batches) == len(texts) and sum(rig.runner.token_batches) == 2 * len(texts)
    assert max(rig.runner.token_batches) > 2, "concurrent token requests must share batches"


async def test_token_request_to_a_runner_without_token_output_fails_alone() -> None:
    runner = FakeRunner(info=ModelInfo(name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8))
    rig = Rig(runner)
    try:
        with pytest.raises(InferenceFailed, match="does not return token embeddings"):
            await rig.batcher.submit(rig.seqs("a b"), kind=OutputKind.TOKENS)
        (row,) = await rig.embed("a b")
        np.testing.assert_allclose(row, runner.expected("a b"), rtol=1e-6)
    finally:
        await rig.aclose()


async def test_runner_failure_fails_only_its_batch_and_service_recovers() -> None:
    runner = FakeRunner(batch_seconds=0.05)
    rig = Rig(runner)
    try:
        poison = runner.tokenize(["poison"])[0][0]
        runner.fail_token = poison
        blocker = asyncio.ensure_future(rig.embed("first batch"))  # occupies the runner
        await asyncio.sleep(0.01)
        bad = asyncio.ensure_future(rig.embed("poison"))
        with pytest.raises(InferenceFailed):
            await bad
        assert (await blocker)[0].shape == (8,)
        runner.fail_token = None
        row = (await rig.embed("after the failure"))[0]
        np.testing.assert_allclose(row, runner.expected("after the failure"), rtol=1e-6)
        assert rig.sample("coalesce_batch_failures_total") == 1
    finally:
        await rig.aclose()


async def _occupy(rig: Rig) -> asyncio.Future[list[np.ndarray]]:
    """A request whose batch is running once this returns (the runner's one forward busy)."""
    blocker = asyncio.ensure_future(rig.embed("keeps the runner busy"))
    while rig.batcher.scheduler.inflight == 0:
        await asyncio.sleep(0.001)
    return blocker


async def test_cancelled_items_are_never_computed() -> None:
    # A blocker long enough that it is still running when the cancelled request arrives, whatever pause
    # the process takes meanwhile: with a 20-ms one, CI's pinned run twice saw the blocker's batch take
    # ~150 ms and the cancelled inputs computed (the pause's cause not established), which a step that
    # dispatched them before the cancellation's callback ran would explain.
    rig = Rig(FakeRunner(batch_seconds=0.5))
    try:
        blocker = await _occupy(rig)
        rig.batcher.submit(rig.seqs("abandoned one", "abandoned two")).cancel()
        await blocker
        await rig.embed("next")
        assert sum(rig.runner.batches) == 2, "the cancelled inputs must not reach the runner"
        assert rig.sample("coalesce_rejected_total", reason="cancelled") == 2
        assert rig.batcher.scheduler.queued_tokens == 0
    finally:
        await rig.aclose()


async def test_a_deadline_that_passes_behind_a_running_batch_is_answered_when_it_ends_not_computed() -> None:
    # While the one forward runs, an arrival does not wake the batcher (it could dispatch nothing): what
    # passed its deadline meanwhile is dropped at the step after the running batch, never computed.
    rig = Rig(FakeRunner(batch_seconds=0.3))
    try:
        blocker = await _occupy(rig)
        doomed = rig.batcher.submit(rig.seqs("too late"), deadline=time.monotonic() + 0.05)
        with pytest.raises(DeadlineExceeded):
            await doomed
        assert blocker.done(), "dropped once the running batch ended, not before"
        assert sum(rig.runner.batches) == 1, "the expired input never reached the runner"
        assert rig.sample("coalesce_rejected_total", reason="expired") == 1
        assert len(await rig.embed("after it")) == 1
    finally:
        await rig.aclose()


async def test_the_queue_depth_gauge_follows_arrivals_while_a_batch_runs() -> None:
    """The queue's gauges as an engine process of ``--workers N`` exports them: written by the batcher
    itself (nothing renders its registry in-process, so no scrape writes them first), within the tally's
    period of work joining the queue — also while the one forward is busy and no step runs until it
    ends. Before, they showed the queue as the last step left it for as long as the batch ran."""
    runner = GatedFake()
    runner.gate.clear()  # (held: its forwards wait until the test opens it)
    rig = Rig(runner)

    def written(name: str) -> float:  # (no flush: what the shared files hold)
        return float(rig.metrics.registry.get_sample_value(name, {"model": "fake"}) or 0.0)

    try:
        blocker = await _occupy(rig)
        await asyncio.sleep(FLUSH_S * 4)  # the dispatching step's write has happened (an empty queue)
        assert written("coalesce_queue_depth") == 0
        waiting = [rig.batcher.submit(rig.seqs(f"waits {i} a", f"waits {i} b")) for i in range(3)]
        await asyncio.sleep(FLUSH_S * 4)  # (a write falls due FLUSH_S after the arrivals)
        assert rig.batcher.scheduler.inflight == 1 and not blocker.done(), "the forward is still busy"
        assert written("coalesce_queue_depth") == 6
        assert written("coalesce_queued_tokens") == rig.batcher.scheduler.queued_tokens > 0
        runner.gate.set()
        await blocker
        for fut in waiting:
            assert len((await fut).rows) == 2
        await asyncio.sleep(FLUSH_S * 4)
        assert written("coalesce_queue_depth") == 0
    finally:
        runner.gate.set()
        await rig.aclose()


async def test_a_refusal_while_a_batch_runs_writes_the_queue_gauges() -> None:
    """A refusal at admission writes the queue's gauges within the tally's period too (the regime it
    observed may have turned), also while the forward is busy and nothing joins the queue: no step would
    write them until the batch ended."""
    runner = GatedFake()
    runner.gate.clear()
    rig = Rig(runner, max_queued_tokens=8)

    def written(name: str) -> float:  # (no flush: what an engine process's shared files hold)
        return float(rig.metrics.registry.get_sample_value(name, {"model": "fake"}) or 0.0)

    try:
        blocker = await _occupy(rig)
        waiting = rig.batcher.submit(rig.seqs("fills the queue up"))  # (six tokens of eight)
        await asyncio.sleep(FLUSH_S * 4)
        assert written("coalesce_queue_depth") == 1 and written("coalesce_queue_standing") == 0
        # The regime as an observation at admission would leave it (turned standing), then a refusal.
        rig.batcher.scheduler.regime.standing = True
        with pytest.raises(Overloaded):
            rig.batcher.submit(rig.seqs("one too many"))
        await asyncio.sleep(FLUSH_S * 4)
        assert not blocker.done(), "the forward is still busy"
        assert written("coalesce_queue_standing") == 1
        runner.gate.set()
        await blocker
        await waiting
    finally:
        runner.gate.set()
        await rig.aclose()


async def test_queue_bound_answers_overloaded_with_retry_after() -> None:
    runner = FakeRunner(batch_seconds=0.05)
    rig = Rig(runner, max_queued_tokens=40)
    try:
        admitted = [asyncio.ensure_future(rig.embed(f"v{i} " + "w " * 7)) for i in range(4)]  # 10 tokens each
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as info:
            rig.batcher.submit(rig.seqs("one too many"))
        assert info.value.status == 429
        assert int(info.value.headers()["Retry-After"]) >= 1
        for fut in admitted:
            assert len(await fut) == 1  # everything admitted is answered
        assert rig.batcher.scheduler.queued_tokens == 0
    finally:
        await rig.aclose()


async def test_drain_finishes_admitted_work_then_refuses_new() -> None:
    runner = FakeRunner(batch_seconds=0.03)
    rig = Rig(runner, limits=Limits(2, 16384))
    try:
        pending = [asyncio.ensure_future(rig.embed(f"item {i}")) for i in range(6)]
        await asyncio.sleep(0)
        assert await rig.batcher.drain(timeout=5)
        assert all(len(p.result()) == 1 for p in pending)
        with pytest.raises(Unavailable):
            rig.batcher.submit(rig.seqs("late"))
    finally:
        await rig.aclose()


async def test_close_answers_what_drain_could_not_finish() -> None:
    runner = FakeRunner(batch_seconds=0.2)
    rig = Rig(runner, limits=Limits(1, 16384))
    try:
        pending = [asyncio.ensure_future(rig.embed(f"item {i}")) for i in range(5)]
        await asyncio.sleep(0)
        assert not await rig.batcher.drain(timeout=0.05)
        await rig.batcher.close()
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(o, list | Unavailable) for o in outcomes)
        assert any(isinstance(o, Unavailable) for o in outcomes), "leftovers get a 503, not silence"
    finally:
        await rig.aclose()


async def test_batch_size_one_turns_batching_off() -> None:
    rig = Rig(FakeRunner(batch_seconds=0.01), limits=Limits(1, 16384))
    try:
        await asyncio.gather(*(rig.embed(f"t {i}") for i in range(10)))
        assert rig.runner.batches == [1] * 10
    finally:
        await rig.aclose()


async def test_a_full_queue_refuses_before_any_tokenising() -> None:
    rig = Rig(FakeRunner(batch_seconds=0.2), max_queued_tokens=20)
    try:
        rig.batcher.check_room()  # empty: room
        first = asyncio.ensure_future(rig.embed("w " * 8))  # 10 tokens: dispatched at once
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(rig.embed("w " * 18))  # 20 tokens: fills the queue
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as info:
            rig.batcher.check_room()
        assert info.value.code == "queue_full"
        await asyncio.gather(first, second)
        rig.batcher.check_room()  # drained: room again
    finally:
        await rig.aclose()


async def test_identical_inputs_in_flight_are_computed_once_for_every_caller() -> None:
    rig = Rig(FakeRunner(batch_seconds=0.05))
    try:
        busy = asyncio.ensure_future(rig.embed("keeps the runner busy"))
        await asyncio.sleep(0.01)
        # Three callers ask for the same text (one of them twice in one request) while it waits.
        same = [asyncio.ensure_future(rig.embed("the same text")) for _ in range(2)]
        twice = asyncio.ensure_future(rig.embed("the same text", "another", "the same text"))
        await busy
        rows = [(await f)[0] for f in same] + list(await twice)
        want = rig.runner.expected("the same text")
        for row in (*rows[:3], rows[4]):
            np.testing.assert_allclose(row, want, rtol=1e-6)
        np.testing.assert_allclose(rows[3], rig.runner.expected("another"), rtol=1e-6)
        assert sum(rig.runner.batches) == 1 + 2, "the same text ran once"
        assert rig.sample("coalesce_deduplicated_inputs_total") == 3
    finally:
        await rig.aclose()


async def test_a_shared_input_still_runs_when_its_first_caller_leaves() -> None:
    rig = Rig(FakeRunner(batch_seconds=0.05))
    try:
        busy = asyncio.ensure_future(rig.embed("keeps the runner busy"))
        await asyncio.sleep(0.01)
        first = rig.batcher.submit(rig.seqs("wanted by two"))
        second = rig.batcher.submit(rig.seqs("wanted by two"))
        first.cancel()
        await busy
        got = await second
        np.testing.assert_allclose(got.rows[0], rig.runner.expected("wanted by two"), rtol=1e-6)
        assert rig.sample("coalesce_rejected_total", reason="cancelled") == 0
    finally:
        await rig.aclose()


async def test_cached_inputs_are_answered_without_queueing_and_memory_stays_bounded() -> None:
    cache = ResultCache(4096)  # a few 8-wide rows
    rig = Rig(FakeRunner(batch_seconds=0.01), cache=cache)
    try:
        first = await rig.embed("asked before", "new one")
        assert sum(rig.runner.batches) == 2
        again = await rig.batcher.submit(rig.seqs("asked before"))
        np.testing.assert_allclose(again.rows[0], first[0], rtol=1e-6)
        assert sum(rig.runner.batches) == 2, "a hit never reaches the runner"
        assert again.queue_s == 0.0
        assert rig.sample("coalesce_cache_hits_total") == 1
        assert rig.sample("coalesce_cache_misses_total") == 2
        for i in range(200):  # a flood of distinct inputs
            await rig.embed(f"distinct input {i}")
        assert cache.bytes <= cache.capacity and 0 < len(cache) < 200
        assert rig.metrics.registry.get_sample_value("coalesce_cache_bytes") == cache.bytes
    finally:
        await rig.aclose()


async def test_a_standing_queue_refuses_at_the_door_and_answers_late_inputs_not_computing_them() -> None:
    # One input per batch, 0.6 s each on a machine twelve times slower than its cost model says: what
    # was admitted under a standing queue and can no longer have its result within the 0.5 s bound once
    # the running batch is over is answered, not computed; what was admitted before the queue stood (a
    # burst) keeps its admission.
    runner = FakeRunner(batch_seconds=0.6)
    rig = Rig(runner, limits=Limits(1, 16384), max_queue_wait_s=0.5, queue_interval_s=0.0)
    regime = rig.batcher.scheduler.regime
    for padded in (4, 16):
        rig.batcher.scheduler.cost.observe(padded, 0.05)
    try:
        first = asyncio.ensure_future(rig.embed("runs at once"))
        await asyncio.sleep(0.01)
        burst = asyncio.ensure_future(rig.embed("admitted as a burst"))
        await asyncio.sleep(0.01)
        # An overload that goes on: arrivals above what the model is taken to serve, from now on.
        regime.standing = True
        rig.batcher.scheduler.admission.capacity = lambda: 1.0  # type: ignore[method-assign]  (tokens/s)
        waiting = [asyncio.ensure_future(rig.embed(f"waits {i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        regime.capacity = 0.0  # (and arrivals go on, however few)
        now = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded) as info:  # before tokenising: it already waited 0.45 s
            rig.batcher.check_room(arrived=now - 0.45, first=4, total=4)
        assert info.value.code == "overloaded" and "retry-after-ms" in info.value.headers()
        assert len(await first) == 1 and len(await burst) == 1
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(o, Overloaded) and o.code == "late" for o in outcomes), outcomes
        assert runner.batches == [1, 1], "the late inputs must never reach the runner"
        assert rig.sample("coalesce_rejected_total", reason="late") == 3
        assert rig.sample("coalesce_rejected_total", reason="overloaded") == 1
        hints = sorted(o.retry_after for o in outcomes if isinstance(o, Overloaded))
        assert hints[0] < hints[1] < hints[2]  # told to come back one after the other
    finally:
        await rig.aclose()


class _WindowRecorder(FakeRunner):
    """Records which batches held windows beside other inputs; a window's row comes back raw (×3)."""

    def __init__(self) -> None:
        super().__init__(batch_seconds=0.02)
        self.mixed = 0

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        raw = [is_raw(s) for s in batch]
        self.mixed += any(raw) and not all(raw)
        return list(batch)  # type: ignore[arg-type]  (marks kept for finish)

    def finish(self, output: list[list[int]], prepared: list[list[int]]) -> np.ndarray:
        return np.stack([self.vector(s) * (3.0 if is_raw(s) else 1.0) for s in output])


async def test_windows_of_a_long_input_share_batches_with_other_callers() -> None:
    rig = Rig(_WindowRecorder())
    try:
        windows = [WindowIds(seq) for seq in rig.seqs(*(f"window {i} of the long text" for i in range(12)))]
        queries = [f"query {i}" for i in range(12)]
        same = list(windows[0])  # the same ids as a window, unmarked: a row of its own, normalised
        long_result, plain, *answers = await asyncio.gather(
            rig.batcher.submit(windows), rig.batcher.submit([same]), *(rig.embed(q) for q in queries)
        )
        assert rig.runner.mixed > 0, "windows must ride in batches with other requests' inputs"
        np.testing.assert_allclose(long_result.rows[0], 3.0 * rig.runner.vector(same), rtol=1e-6)
        np.testing.assert_allclose(plain.rows[0], rig.runner.vector(same), rtol=1e-6)
        for q, (row,) in zip(queries, answers, strict=True):
            np.testing.assert_allclose(row, rig.runner.expected(q), rtol=1e-6)
    finally:
        await rig.aclose()


async def test_a_bug_in_a_step_answers_what_waits_and_refuses_what_comes_after(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The owner's step raises (a bug): the request waiting is answered 503, never left hanging, and the
    # batcher refuses new work rather than queueing it where nothing would ever run it.
    def broken(now: float) -> object:
        raise RuntimeError("a bug")

    monkeypatch.setattr(rig.batcher.scheduler, "next", broken)
    with pytest.raises(Unavailable):
        await asyncio.wait_for(rig.embed("waits"), 10)
    with pytest.raises(Unavailable):
        await asyncio.wait_for(rig.embed("comes after"), 10)
    assert rig.runner.batches == []


class WideRunner(FakeRunner):
    """A runner whose rows come back float64 and column-major (a backend of another precision)."""

    def finish(self, output: list[list[int]], prepared: list[list[int]]) -> np.ndarray:
        return np.asfortranarray(super().finish(output, prepared).astype(np.float64))


async def test_every_answer_holds_float32_rows_in_order_whatever_the_runner_returns() -> None:
    # The rows travel to a gateway as raw float32 bytes (the engine's reply frame): a runner's float64
    # or column-major rows are made float32 and contiguous once for the batch, not per answer.
    r = Rig(WideRunner(), cache=ResultCache(1 << 20))
    try:
        texts = [f"text {i}" for i in range(6)]
        submit = r.batcher.submit
        results = await asyncio.gather(submit(r.seqs(*texts[:4])), submit(r.seqs(texts[4])),
                                       submit(r.seqs(texts[5])))
        cached = await r.batcher.submit(r.seqs(texts[4]))  # a cache hit
        for result in [*results, cached]:
            assert result.rows.dtype == np.float32 and result.rows.flags.c_contiguous
        np.testing.assert_allclose(results[0].rows, [r.runner.expected(t) for t in texts[:4]], rtol=1e-6)
        np.testing.assert_allclose(results[1].rows[0], r.runner.expected(texts[4]), rtol=1e-6)
        np.testing.assert_allclose(cached.rows[0], r.runner.expected(texts[4]), rtol=1e-6)
    finally:
        await r.aclose()


async def test_a_served_request_leaves_nothing_for_the_garbage_collector() -> None:
    """Every object a request's inputs pass through is freed when it is answered, by reference counts:
    none is left in a reference cycle for the collector to find later (an input's work and its queue
    entry once held each other, as a finished flow and its entries did: about eight objects a request
    for each collection to trace and free, on the engine's loop)."""
    rig = Rig(FakeRunner())
    try:
        answered = 0
        all_in = asyncio.Event()

        def reply(tag: object, outcome: object) -> None:
            nonlocal answered
            answered += 1
            if answered == expected:
                all_in.set()

        gc.collect()
        gc.disable()
        try:
            expected = 0
            for wave in range(20):  # one-input queries and requests of three inputs, ten a message
                texts = [[f"wave {wave} request {i} input {k}" for k in range(1 + i % 2 * 2)]
                         for i in range(10)]
                message = [Submission(rig.seqs(*inputs), (wave, i)) for i, inputs in enumerate(texts)]
                expected += len(message)
                rig.batcher.enqueue_many(message, reply)
                await asyncio.wait_for(all_in.wait(), 10)
                all_in.clear()
            left = gc.collect()
        finally:
            gc.enable()
        assert answered == 200
        assert left < 20, f"{left} objects of 200 requests were left in reference cycles"
    finally:
        await rig.aclose()
