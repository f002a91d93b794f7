"""A message's requests admitted at once: ``admits_all`` never admits what ``admit`` one by one would
refuse, and ``Batcher.enqueue_many`` answers as ``enqueue`` one after the other does."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import numpy as np
import pytest
from coalesce.service.batching.admit import Refusal
from coalesce.service.batching.batcher import Batcher, RequestResult, Submission, Ticket
from coalesce.service.batching.cache import ResultCache
from coalesce.service.batching.cost import Coefficients, CostModel
from coalesce.service.batching.fair import Entry
from coalesce.service.batching.policy import Limits
from coalesce.service.batching.scheduler import Scheduler, SchedulerConfig
from coalesce.service.errors import CoalesceError, DeadlineExceeded, Unavailable

from ..fakes import FakeRunner, GatedFake
from .test_batcher import Rig

# (input lengths, tenant, weight, class, deadline, arrived)
Request = tuple[list[int], str, float, int, float | None, float]


def _scheduler(rng: random.Random, now: float, burst_waits: tuple[float, ...] = (0.3, 1.0, 10.0)
               ) -> Scheduler:
    """A scheduler in a random state: a queue of several tenants and classes, held prechecks, a busy
    model, a cost model, a regime standing or not, bounds near what is queued."""
    config = SchedulerConfig(
        limits=Limits(rng.choice([8, 32, 64]), 16384),
        max_queued_tokens=rng.choice([2_000, 20_000, 1 << 20]),
        tenant_max_queued_tokens=rng.choice([500, 5_000, 1 << 19]),
        max_queue_wait_s=rng.choice([0.0, 0.2, 0.5]),
        burst_wait_s=rng.choice(burst_waits),
    )
    cost = CostModel(Coefficients(rng.uniform(1e-4, 1e-2), rng.uniform(1e-7, 2e-5)))
    sched = Scheduler(config, cost, lambda n, longest: n * longest)
    sched.busy_until = now + rng.uniform(0.0, 0.3) * rng.randint(0, 1)
    for i in range(rng.randint(0, 12)):
        n = rng.randint(1, 4)
        tenant, priority = rng.choice(["default", "a", "b"]), rng.randint(0, 2)
        arrival = now - rng.uniform(0.0, 0.6)
        sched.add([Entry(rng.randint(1, 200), arrival, tenant, 1.0, priority, None, flow=("q", i))
                   for _ in range(n)], inputs=n)
    for _ in range(rng.randint(0, 3)):
        sched.precheck(rng.randint(1, 50), rng.randint(1, 200), 1, "default", 1.0, rng.randint(0, 2),
                       now - rng.uniform(0.0, 0.3), now)
    sched.regime.standing = rng.random() < 0.5
    sched.admission.drain_pace = rng.choice([1.0, rng.uniform(1.0, 3.0)])  # (time besides forwards)
    sched.regime.overload = sched.regime.standing and rng.random() < 0.5  # (admit() then counts the pace)
    return sched


def _message(rng: random.Random, now: float) -> list[Request]:
    return [([rng.randint(1, 120) for _ in range(rng.choice([1, 1, 1, 2, 5]))], rng.choice(["default", "a"]),
             rng.choice([1.0, 2.0]), rng.randint(0, 2), rng.choice([None, now + rng.uniform(0.01, 2.0)]),
             now - rng.uniform(0.0, 0.1))
            for _ in range(rng.randint(2, 24))]


def _summary(message: list[Request], now: float) -> tuple[int, int, int, int, int, float, float | None,
                                                          dict[str, int]]:
    lengths = [k for r in message for k in r[0]]
    deadlines = [r[4] for r in message if r[4] is not None]
    tenants: dict[str, int] = {}
    for r in message:
        if r[1] != "default":
            tenants[r[1]] = tenants.get(r[1], 0) + sum(r[0])
    return (sum(lengths), len(lengths), min(lengths), max(lengths), max(len(r[0]) for r in message),
            min(r[5] for r in message), min(deadlines, default=None), tenants)


def test_a_message_admitted_at_once_is_one_that_admission_one_by_one_admits_whole() -> None:
    passed = refused = 0
    for seed in range(1500):
        rng = random.Random(seed)
        now = 1000.0
        sched = _scheduler(rng, now)
        message = _message(rng, now)
        if not sched.admits_all(*_summary(message, now), now):
            refused += 1
            continue
        passed += 1
        for j, (lengths, tenant, weight, priority, deadline, arrived) in enumerate(message):
            refusal = sched.admit(lengths, tenant, deadline, now, weight=weight, priority=priority,
                                  arrived=arrived)
            assert refusal is None, (seed, j, refusal)
            sched.add([Entry(k, arrived, tenant, weight, priority, deadline, flow=("m", j)) for k in lengths],
                      inputs=len(lengths))
    # Neither answer is rare among these states, so both branches were exercised.
    assert passed > 100 and refused > 100, (passed, refused)


class Answers:
    """What a reply callback was told, by tag, in order."""

    def __init__(self) -> None:
        self.got: dict[object, RequestResult | CoalesceError] = {}
        self.order: list[object] = []
        self.all_in = asyncio.Event()
        self.expect = 0

    def __call__(self, tag: object, outcome: RequestResult | CoalesceError) -> None:
        assert tag not in self.got, f"{tag} answered twice"
        self.got[tag] = outcome
        self.order.append(tag)
        if len(self.got) >= self.expect:
            self.all_in.set()


def _outcomes(out: list[Ticket | CoalesceError]) -> list[str]:
    return ["ticket" if isinstance(o, Ticket) else type(o).__name__ + ":" + str(getattr(o, "code", ""))
            for o in out]


async def _run(enqueue: Callable[[Batcher, list[Submission], Answers], list[Ticket | CoalesceError]],
               submissions: list[Submission], **config: object) -> tuple[list[str], dict[object, object],
                                                                          dict[str, float]]:
    """Enqueue ``submissions`` into a fresh batcher: what each was told at once, the rows (or the
    error) each was answered, and the counters. (No step runs before every request is in, either way:
    the batcher's owner runs on the loop's next turn.)"""
    rig = Rig(FakeRunner(), ResultCache(1 << 20), **config)
    try:
        answers = Answers()
        out = enqueue(rig.batcher, submissions, answers)
        answers.expect = sum(isinstance(o, Ticket) for o in out)
        if len(answers.got) >= answers.expect:
            answers.all_in.set()
        await asyncio.wait_for(answers.all_in.wait(), 10)
        rows = {tag: (o.rows.copy() if isinstance(o, RequestResult) else type(o).__name__)
                for tag, o in answers.got.items()}
        counters = {name: rig.sample(name) for name in (
            "coalesce_cache_hits_total", "coalesce_cache_misses_total", "coalesce_inputs_total",
            "coalesce_deduplicated_inputs_total", "coalesce_batches_total")}
        return _outcomes(out), rows, counters
    finally:
        await rig.aclose()


def _one_by_one(batcher: Batcher, submissions: list[Submission], reply: Answers
                ) -> list[Ticket | CoalesceError]:
    out: list[Ticket | CoalesceError] = []
    for r in submissions:
        try:
            out.append(batcher.enqueue(r.seqs, reply, r.tag, tenant=r.tenant, weight=r.weight,
                                       priority=r.priority, deadline=r.deadline, kind=r.kind,
                                       arrived=r.arrived, link=r.link))
        except CoalesceError as err:
            out.append(err)
    return out


def _at_once(batcher: Batcher, submissions: list[Submission], reply: Answers) -> list[Ticket | CoalesceError]:
    return batcher.enqueue_many(submissions, reply)


def _submissions(runner: FakeRunner, texts: list[list[str]], **kw: object) -> list[Submission]:
    def seqs(words: list[str]) -> list[list[int]]:
        return [runner.with_special_tokens(ids) for ids in runner.tokenize(words)]

    return [Submission(seqs(words), f"r{i}", **kw) for i, words in enumerate(texts)]  # type: ignore[arg-type]


@pytest.mark.parametrize("bound", [1 << 20, 12], ids=["room for all", "room for some"])
async def test_a_message_is_answered_request_by_request_as_if_enqueued_one_after_the_other(
    bound: int,
) -> None:
    runner = FakeRunner()
    # Requests of one and several inputs, an input repeated within a request and across requests.
    texts = [["alpha"], ["beta gamma", "delta"], ["alpha"], ["eps", "eps", "zeta"], ["eta theta iota"],
             ["delta"], ["kappa"]]
    subs = _submissions(runner, texts)
    one = await _run(_one_by_one, subs, max_queued_tokens=bound)
    many = await _run(_at_once, subs, max_queued_tokens=bound)
    assert many[0] == one[0]
    if bound > 1000:
        assert many[0] == ["ticket"] * len(texts)
    else:
        assert "ticket" in many[0] and any(o.startswith("Overloaded") for o in many[0]), many[0]
    assert many[1].keys() == one[1].keys()
    for tag, rows in one[1].items():
        assert np.array_equal(many[1][tag], rows) if isinstance(rows, np.ndarray) else many[1][tag] == rows
    assert many[2] == one[2]
    expected = {f"r{i}": np.stack([runner.expected(w) for w in words]) for i, words in enumerate(texts)}
    for tag, rows in many[1].items():
        if isinstance(rows, np.ndarray):
            np.testing.assert_allclose(rows, expected[tag], rtol=1e-6)


@pytest.mark.parametrize("free_at", [0.15, 0.7], ids=["between the deadlines", "after both"])
async def test_an_input_shared_within_a_message_waits_for_the_later_deadline_and_expires_once(
    free_at: float,
) -> None:
    rig = Rig(GatedFake(batch_seconds=0.001))
    runner = rig.runner
    assert isinstance(runner, GatedFake)
    try:
        runner.gate.clear()
        blocker = rig.batcher.submit(rig.seqs("blocker"))
        assert await asyncio.to_thread(runner.entered.wait, 10)  # the model is busy from here
        answers = Answers()
        answers.expect = 2
        now = time.monotonic()
        seqs = rig.seqs("shared words")
        out = rig.batcher.enqueue_many([Submission(seqs, "a", deadline=now + 0.05),
                                        Submission(seqs, "b", deadline=now + 0.6)], answers)
        assert all(isinstance(o, Ticket) for o in out)
        await asyncio.sleep(free_at - (time.monotonic() - now))
        runner.gate.set()
        await blocker
        await asyncio.wait_for(answers.all_in.wait(), 10)
        got = list(answers.got.values())
        if free_at < 0.6:  # computed: the later request keeps the shared input alive past the first deadline
            assert all(isinstance(o, RequestResult) for o in got), got
            np.testing.assert_allclose(got[0].rows[0], runner.expected("shared words"), rtol=1e-6)  # type: ignore[union-attr]
        else:  # dropped unrun, and counted once (one input), whichever of the two drops came first
            assert all(isinstance(o, (DeadlineExceeded, Unavailable)) for o in got), got
            dropped = (rig.sample("coalesce_rejected_total", reason="expired")
                       + rig.sample("coalesce_rejected_total", reason="deadline_unmeetable"))
            assert dropped == 1
        sched = rig.batcher.scheduler
        assert sched.queued_items == 0 and sched.queued_tokens == 0  # the queue's books are straight
        assert len(await rig.embed("after")) == 1
    finally:
        runner.gate.set()
        await rig.aclose()


async def test_one_input_requests_take_a_shortcut_to_the_outcome_of_the_general_path() -> None:
    # enqueue_many joins a request of one pooled input in one call (Batcher._join_one) rather than
    # sorting its inputs into cached, shared and fresh ones first (_sort, then _join). The same three
    # messages through both, one after the other, each meeting the rows the ones before it cached and
    # its own repeated inputs in flight at every class: the same tickets, answers, counters, and work in
    # flight.
    runner = FakeRunner()
    rng = random.Random(11)
    words = ["alpha", "beta gamma", "delta", "eps zeta eta", "theta"]
    soon = time.monotonic() + 30.0
    seqs = {w: [runner.with_special_tokens(runner.tokenize([w])[0])] for w in words}
    messages = [[Submission(seqs[rng.choice(words)], f"m{m}r{j}", tenant=rng.choice(["default", "a"]),
                            priority=rng.randint(0, 2), deadline=rng.choice([None, soon, soon + 1.0]))
                 for j in range(10)] for m in range(3)]
    Outcome = tuple[list[list[str]], dict[object, object], dict[str, float], list[object]]

    async def run(general: bool) -> Outcome:
        rig = Rig(FakeRunner(), ResultCache(1 << 20))
        batcher = rig.batcher
        if general:
            def join(r: Submission, arrived: float, reply: object, counts: list[int]) -> object:
                return batcher._join(r, arrived, reply, *batcher._sort(r), counts)  # type: ignore[arg-type]
            batcher._join_one = join  # type: ignore[method-assign,assignment]
        try:
            answers = Answers()
            outcomes, inflight = [], []
            for message in messages:
                # Every request of the message answered (its rows cached) before the next one comes: set
                # before enqueueing, since cached rows are answered during the call.
                answers.expect += len(message)
                answers.all_in.clear()
                out = batcher.enqueue_many(message, answers)
                outcomes.append(_outcomes(out))
                inflight.append(sorted(
                    (key, sorted(str(job.tag) for job, _ in work.waiters), work.n_tokens, work.tenant,
                     work.priority, work.deadline, work.kind)
                    for key, work in batcher._inflight.items()))
                await asyncio.wait_for(answers.all_in.wait(), 10)
            rows = {tag: (o.rows.copy() if isinstance(o, RequestResult) else type(o).__name__)
                    for tag, o in answers.got.items()}
            counters = {name: rig.sample(name) for name in (
                "coalesce_cache_hits_total", "coalesce_cache_misses_total", "coalesce_inputs_total",
                "coalesce_deduplicated_inputs_total")}
            return outcomes, rows, counters, inflight
        finally:
            await rig.aclose()

    short, general = await run(False), await run(True)
    assert short[0] == general[0] and short[3] == general[3] and short[2] == general[2]
    assert short[2]["coalesce_cache_hits_total"] > 0 and short[2]["coalesce_deduplicated_inputs_total"] > 0
    assert short[1].keys() == general[1].keys()
    for tag, rows in general[1].items():
        assert np.array_equal(short[1][tag], rows) if isinstance(rows, np.ndarray) else short[1][tag] == rows


def test_a_check_on_room_for_everything_waiting_is_the_check_made_in_full() -> None:
    # Before tokenising, a queue that keeps emptying with room for everything that waits and is held
    # passes a request without its fair-share walk and wait prediction (Admitter._burst_room). The same
    # checks, made in full on a twin scheduler, give the same verdicts and leave the same holds.
    taken = refused = 0
    waits = (0.002, 0.01, 0.03, 0.1, 0.3)  # (bounds near what waits: the queue's forwards, the busy model)
    for seed in range(600):
        rng = random.Random(seed)
        now = 1000.0
        fast, full = _scheduler(random.Random(seed), now, waits), _scheduler(random.Random(seed), now, waits)
        room = fast.admission._burst_room

        def counted(at: float, room: Callable[[float], bool] = room) -> bool:
            nonlocal taken
            ok = room(at)
            taken += ok
            return ok

        fast.admission._burst_room = counted  # type: ignore[method-assign]
        full.admission._burst_room = lambda at: False  # type: ignore[method-assign]
        for k in range(rng.randint(1, 30)):
            args = (rng.randint(1, 60), rng.randint(1, 400), rng.choice([1, 1, 3]),
                    rng.choice(["default", "a"]), rng.choice([1.0, 2.0]), rng.randint(0, 2),
                    now - rng.uniform(0.0, 0.2), now + 0.01 * k)
            a, b = fast.precheck(*args), full.precheck(*args)
            assert type(a) is type(b), (seed, k)
            if isinstance(a, Refusal):
                refused += a.reason == "queue_full"  # (the burst's wait bound, or the queue's)
                assert (a.reason, a.retry_after) == (b.reason, b.retry_after), (seed, k)
            else:
                assert list(a) == list(b), (seed, k)
            assert list(map(list, fast.admission._held)) == list(map(list, full.admission._held)), (seed, k)
    assert taken > 1000 and refused > 1000  # (both ways taken often enough to mean something)
