"""A CPU forward on every core, capped at one thread fewer while that runs faster (``engine/threads.py``):
a core busy with another program holds every operator of a forward on all of them back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest
from coalesce.kernels.worker import LoopShare
from coalesce.service.batching.cost import CostModel
from coalesce.service.engine import threads
from coalesce.service.engine.threads import PROBE_FIRST_S, PROBE_MAX_S, SLOW_BATCHES, ThreadChooser

from ..fakes import Clocks, FakeRunner


class _Share:
    """LoopShare's part the chooser drives, recorded."""

    def __init__(self, cores: int) -> None:
        self.cores = self.cap = cores
        self.probes: list[int] = []

    def limit(self, cap: int) -> None:
        self.cap = cap

    def probe(self, threads: int) -> None:
        self.probes.append(threads)


def _seeded(fewer_s: float) -> CostModel:
    """A cost model of a forward on 2 threads, its fit on one thread fewer ``fewer_s`` per 100 tokens."""
    cost = CostModel()
    cost.use(2)
    for t in (100, 1000):
        cost.observe(t, 0.55 * fewer_s * t / 100)  # every core free: two threads take 0.55× one's time
        cost.observe(t, fewer_s * t / 100, 1)
    return cost


def test_with_every_core_free_the_forward_keeps_them_all() -> None:
    share, now = _Share(2), [0.0]
    chooser = ThreadChooser(share, clock=lambda: now[0])
    cost = _seeded(0.01)
    for i in range(200):
        now[0] += 0.05
        tokens = 100 + 37 * i % 900
        chooser.forwarded(cost, 2, tokens, 0.55 * 0.01 * tokens / 100 * (1.4 if i % 7 == 0 else 1.0))
    assert share.cap == 2 and share.probes == [], "a forward on both cores beats one: never capped"
    tiny = _seeded(0.0001)  # forwards of a tenth of a millisecond: three times slower is noise there
    for _ in range(5):
        chooser.forwarded(tiny, 2, 100, 0.0003)
    assert share.cap == 2


def test_a_busy_core_caps_the_forward_and_probes_find_when_it_is_free_again() -> None:
    share, now = _Share(2), [0.0]
    chooser = ThreadChooser(share, clock=lambda: now[0])
    cost = _seeded(0.01)
    chooser.forwarded(cost, 2, 100, 0.2)  # 20× one thread's prediction: a neighbour took a core
    assert share.cap == 2, "one slow batch (a collection, a page fault) is not a busy core"
    chooser.forwarded(cost, 2, 100, 0.0055)
    for _ in range(SLOW_BATCHES):
        chooser.forwarded(cost, 2, 100, 0.2)
    assert share.cap == 1, "slow batches in a row: one thread fewer"
    cost.use(1)  # (the engine's on_change: the cost model follows the count)
    now[0] += PROBE_FIRST_S / 2
    chooser.forwarded(cost, 1, 100, 0.01)
    assert share.probes == [], "no probe before its time"
    waits = []
    for _ in range(8):  # the neighbour stays: every probe loses, and they come ever further apart
        asked = len(share.probes)
        start = now[0]
        while len(share.probes) == asked:
            now[0] += 0.05
            chooser.forwarded(cost, 1, 100, 0.01)
        assert share.probes[-1] == 2
        waits.append(now[0] - start)
        chooser.forwarded(cost, 2, 100, 0.2)  # the probe's batch, on both cores: slow still
        assert share.cap == 1
    assert waits[0] <= PROBE_FIRST_S
    assert waits[1] == pytest.approx(2 * PROBE_FIRST_S, abs=0.06)
    assert waits[2] == pytest.approx(4 * PROBE_FIRST_S, abs=0.06)
    assert max(waits) == pytest.approx(PROBE_MAX_S, abs=0.06), "at most PROBE_MAX_S apart"
    while len(share.probes) == 8:
        now[0] += 0.05
        chooser.forwarded(cost, 1, 100, 0.01)
    chooser.forwarded(cost, 2, 100, 0.0056)  # the neighbour has gone: the probe ran faster than one thread
    assert share.cap == 2, "every core again"


def test_batches_far_larger_than_the_one_that_lost_are_probed_at_once() -> None:
    # A tiny forward on every core can lose to one thread fewer with every core free (its threads wake for
    # each operator); a large one gains from them. Capped at a light load, the cap must not outlast it.
    share, now = _Share(2), [0.0]
    chooser = ThreadChooser(share, clock=lambda: now[0])
    cost = _seeded(0.01)
    for _ in range(SLOW_BATCHES):
        chooser.forwarded(cost, 2, 20, 0.01)  # 20 tokens: one thread predicts 2 ms
    assert share.cap == 1
    cost.use(1)
    for _ in range(30):  # the probe interval has grown
        now[0] += 0.01
        chooser.forwarded(cost, 1, 20, 0.002)
    assert share.probes == []
    chooser.forwarded(cost, 1, 1000, 0.1)  # a load arrives: batches of 1,000 tokens
    now[0] += 0.001
    chooser.forwarded(cost, 1, 1000, 0.1)
    assert share.probes == [2], "probed at the next batch"


def test_a_probe_whose_batch_failed_is_asked_for_again() -> None:
    share, now = _Share(2), [0.0]
    chooser = ThreadChooser(share, clock=lambda: now[0])
    cost = _seeded(0.01)
    for _ in range(SLOW_BATCHES):
        chooser.forwarded(cost, 2, 100, 0.2)
    cost.use(1)
    now[0] += PROBE_FIRST_S
    chooser.forwarded(cost, 1, 100, 0.01)
    assert share.probes == [2]
    now[0] += 0.05
    chooser.forwarded(cost, 1, 100, 0.01)  # (the probe's batch failed: not seen; this one ran capped)
    now[0] += PROBE_FIRST_S
    chooser.forwarded(cost, 1, 100, 0.01)
    assert share.probes == [2, 2]


def test_a_share_caps_its_count_and_a_probe_runs_one_forward_on_another() -> None:
    clocks, set_threads, changes = Clocks(), [], []
    share = LoopShare(4, 0.5, set_threads.append, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu)
    share.on_change = changes.append
    share.limit(3)
    assert (share.threads, changes) == (3, [3])
    assert share.on_device() == 3 and set_threads == [3]
    share.probe(4)
    assert share.on_device() == 4 and share.on_device() == 3, "once"
    for _ in range(LoopShare.ABOVE_WINDOWS + 1):  # the loop busy too: it asks for one fewer, as the cap
        clocks.spend(1.0, busy=0.9)
        share.on_loop()
    assert share.threads == 3 and changes == [3]
    share.limit(4)
    assert share.threads == 3, "the busy loop still keeps its thread"
    clocks.spend(1.0, busy=0.1)
    share.on_loop()
    assert share.threads == 4 and changes == [3, 4]
    share.limit(9)
    assert share.cap == 4


@dataclass
class _Neighbour(FakeRunner):
    """A forward that takes 50 ms on every one of the 4 threads it may have (a busy core beside it) and
    1 ms on fewer, as the count last set on the device thread (``counts``) says."""

    counts: list[int] = field(default_factory=list)

    def forward(self, prepared: object) -> object:
        time.sleep(0.05 if not self.counts or self.counts[-1] == 4 else 0.001)
        return super().forward(prepared)


async def test_an_engine_that_starts_beside_a_busy_core_starts_on_fewer_threads_and_predicts_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The --workers 2 engine beside a busy core: its seeds on every core ran a hundred times slower than on
    # one fewer, and an idle burst after start was refused at the burst bound on their fit.
    from coalesce.service.engine import core
    from coalesce.service.metrics import Metrics
    from coalesce.service.settings import build

    clocks, set_threads = Clocks(), []

    def loop_share(device: object, above: float, *, judge_forward: bool = False) -> LoopShare:
        return LoopShare(4, above, set_threads.append, clock=lambda: clocks.wall, loop_cpu=lambda: clocks.cpu)

    monkeypatch.setattr(core, "loop_share", loop_share)
    metrics = Metrics()
    engine = core.Engine(build(["--model", "a=/models/a"], environ={}), metrics,
                         lambda spec: _Neighbour(info=replace(FakeRunner().info, name=spec.name),
                                                    counts=set_threads))
    await engine.load()
    try:
        assert engine.share is not None and engine.chooser is not None
        assert engine.share.cap == 3 and engine.share.threads == 3
        assert metrics.registry.get_sample_value("coalesce_forward_threads") == 3
        cost = engine.models[0].batcher.scheduler.cost
        assert cost.setting == 3 and cost.predict(100) < 0.01, "predicted on the count it runs on"
        assert cost.predict_at(4, 100) > 0.03
        result = await engine.models[0].batcher.submit([[1, 5, 2]])
        assert result.rows.shape[0] == 1 and set_threads[-1] == 3
    finally:
        await engine.close()


def test_only_a_forward_on_more_than_one_thread_has_a_chooser() -> None:
    assert threads.chooser(_Share(1)) is None
    chooser = threads.chooser(_Share(8))
    assert chooser is not None and (chooser.all, chooser.fewer) == (8, 7)


def test_the_neighbour_bench_reports_each_figure_s_median_and_the_ratios_to_a_baseline() -> None:
    from coalesce.loadtests.neighbour import report

    def run(p50: float, rps: float, refused: int) -> dict[str, float]:
        return {"lone_p50_ms": p50, "lone_p90_ms": p50, "lone_max_ms": 3 * p50, "burst_refused": refused,
                "closed_rps": rps}

    table = report({("busy", "--workers 2", "current"): [run(6.0, 400.0, 0), run(8.0, 420.0, 0)],
                    ("busy", "--workers 2", "baseline"): [run(220.0, 380.0, 45), run(200.0, 400.0, 21)]},
                   ["current", "baseline"])
    assert "| busy | --workers 2 | current | 7.0 | 7.0 | 21.0 | 0/0 | 410.0 |" in table
    assert "| busy | --workers 2 | baseline | 210.0 | 210.0 | 630.0 | 45/21 | 390.0 |" in table
    assert "| busy | --workers 2 | 0.03× | 1.05× |" in table
