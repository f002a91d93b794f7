"""Admission that tells a burst from overload (``batching/overload.py``, ``batching/admit.py``), on the
virtual clock of ``sim.py``: bursts into a queue that keeps emptying are served whole, a sustained
overload is shed at the door with the admitted requests' p99 held, the regime recovers, refused callers
that honour Retry-After get in, and shedding never refuses the high-priority or light-tenant work."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
from coalesce.service.batching import admit, cost
from coalesce.service.batching.admit import DOOR, HOLD_S, Hold, Refusal
from coalesce.service.batching.cost import CostModel
from coalesce.service.batching.fair import Entry, FairQueue
from coalesce.service.batching.overload import Regime, RetryPacer
from coalesce.service.batching.scheduler import Dispatch, Scheduler, Wait

from .sim import Arrival, Result, poisson, simulate
from .test_scheduler import CAPACITY, TARGET, TOKENS, A, B, adaptive, own_flows


def shedding(**kw: object):  # type: ignore[no-untyped-def]
    """The server's defaults: the wait bound is the latency target, bursts up to 10 s."""
    base: dict[str, object] = {"max_queue_wait_s": TARGET, "burst_wait_s": 10.0,
                               "queue_target_s": TARGET / 4, "queue_interval_s": 0.5}
    base.update(kw)
    return adaptive(**base)


def refused(res: Result) -> int:
    return sum(res.refused.values()) + res.late


def test_a_burst_into_an_idle_queue_is_admitted_whole() -> None:
    # A thousand one-chunk requests within 0.2 s: about 3.4 s of work, far past the latency target.
    burst = own_flows([Arrival(i * 0.0002, TOKENS) for i in range(1000)])
    res = simulate(shedding(), burst, A, B)
    assert refused(res) == 0 and res.completed == 1000
    assert res.end < 1.1 * 1000 / CAPACITY  # served at the model's rate, nothing wasted


def test_the_old_rule_refused_most_of_that_burst() -> None:
    # What the issue measured: a bound on the predicted wait alone (the regime always standing) refuses
    # all but the latency target's worth of the same burst.
    burst = own_flows([Arrival(i * 0.0002, TOKENS) for i in range(1000)])
    res = simulate(shedding(burst_wait_s=TARGET, queue_target_s=0.0, queue_interval_s=0.0), burst, A, B)
    assert refused(res) > 500


@pytest.mark.parametrize("load", [2.0, 4.0])
def test_sustained_overload_sheds_the_excess_and_the_admitted_keep_their_latency(load: float) -> None:
    arrivals = own_flows(poisson(load * CAPACITY, 20.0, random.Random(3), tokens=TOKENS))
    res = simulate(shedding(), arrivals, A, B, measure_from=2.0)
    share = refused(res) / len(arrivals)
    assert share == pytest.approx(1 - 1 / load, abs=0.06)  # about half at 2×, three quarters at 4×
    assert res.pct(0.99) <= TARGET * 1.02  # 2% for the simulated runner's ±5% noise
    assert res.throughput((2.0, res.end)) >= 0.9 * CAPACITY  # goodput: the model stays busy
    assert regime_at(res, 10.0) and not regime_at(res, res.end)  # it knows it stands, until it drains


def test_overload_of_mixed_lengths_is_judged_on_the_padded_rate_the_model_serves() -> None:
    # Inputs of 4 to 28 tokens: batches run at their longest input's length, so the model serves fewer
    # inputs a second than the 298 of 16-token inputs (about 210 here, batching similar lengths
    # together). 1.6× the rate of batches padded to 28 tokens arrives: about 1.3× what is served, but
    # below the unpadded rate that the regime once compared arrivals with, so the queue took seconds to
    # "stand", admitting up to --burst-wait-ms meanwhile, and left it at dips in arrivals (p99 0.67 s).
    padded_capacity = 64 / (A + B * 64 * 28)
    arrivals = own_flows(poisson(1.6 * padded_capacity, 20.0, random.Random(5),
                                 tokens=lambda rng: rng.randint(4, 28)))
    res = simulate(shedding(), arrivals, A, B, measure_from=2.0)
    # It knows it stands, early and most of the time (arrivals this close to the rate dip below it for
    # moments, and so does the regime; a little more often since a fresh input's batch leaves the
    # backlog past the bound out, at the same p99 and share refused).
    assert regime_at(res, 3.0) and standing_share(res, 2.0, 20.0) >= 0.8
    assert res.pct(0.99) <= TARGET * 1.05
    # The excess is refused, not queued: about 15% arrive beyond what is served.
    assert refused(res) >= 0.12 * len(arrivals)


@pytest.mark.parametrize("slowdown", [2.0, 3.0])
def test_overload_on_a_machine_slower_than_its_warm_up_sheds_at_the_door_not_late(slowdown: float) -> None:
    # Other programs take the cores after warm-up: every forward runs two or three times what the cost
    # model's window of fast batches says, and 2× the slowed rate arrives. With predictions at the pace
    # forwards run now, the admitted keep about their latency and the model its goodput, and most of
    # the excess is refused at the door rather than admitted, decoded, tokenised and dropped late. (A
    # cost model that trusted its window fails all three: its p99 went far past the target, and late
    # drops were most of its refusals.)
    capacity = CAPACITY / slowdown
    arrivals = own_flows(poisson(2.0 * capacity, 20.0, random.Random(3), tokens=TOKENS))
    res = simulate(shedding(), arrivals, A, B, measure_from=2.0, slowdown=slowdown)
    assert res.pct(0.99) <= TARGET * 1.15
    assert res.throughput((2.0, res.end)) >= 0.9 * capacity
    assert res.late <= 0.2 * refused(res), (res.late, dict(res.refused))


@pytest.mark.parametrize("seed", [3, 4])
def test_time_that_holds_the_model_besides_the_forward_is_counted_in_a_standing_queues_promises(
    seed: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each batch holds the model half as long again as its forward (the event loop's turn between
    # batches, answering): the cost model is told the forwards only. 2× what the model really serves
    # arrives. At the drain pace, what cannot keep the bound is refused at the door, and the admitted
    # keep their latency with the model as busy.
    stall = 1.5
    capacity = CAPACITY / stall
    arrivals = own_flows(poisson(2.0 * capacity, 20.0, random.Random(seed), tokens=TOKENS))
    res = simulate(shedding(), arrivals, A, B, measure_from=2.0, stall=stall)
    # (Late drops of what arrived once the overload went on: its onset's are the same either way,
    # what a burst was admitted before the queue stood, held to the bound once it is confirmed.)
    assert res.late_since(2.0) <= 0.05 * refused(res), (res.late_since(2.0), dict(res.refused))
    assert res.pct(0.99) <= TARGET
    assert res.throughput((2.0, res.end)) >= 0.95 * capacity
    # With the pace held at 1, predictions of forwards alone promised starts the queue did not keep:
    # admitted requests were dropped late (decoded, tokenised and queued for nothing), and the admitted
    # p99 passed the target.
    monkeypatch.setattr(admit, "DRAIN_BOUNDS", (1.0, 1.0))
    blind = simulate(shedding(), arrivals, A, B, measure_from=2.0, stall=stall)
    assert blind.late_since(2.0) > 0.1 * refused(blind) and blind.late_since(2.0) > 4 * res.late_since(2.0)
    assert blind.pct(0.99) > 1.15 * TARGET


@pytest.mark.parametrize("spikes", [(0.1, 2.0), (0.2, 1.5)])
@pytest.mark.parametrize("load", [2.0, 4.0])
def test_forwards_that_run_long_at_random_are_promised_at_their_slow_end(
    spikes: tuple[float, float], load: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tenth of forwards run twice as long as the rest (or a fifth half as long again), at random: on
    # two cores the event loop refusing the overload and other programs preempt the forward's threads
    # (the bench's 4× step: the slowest 1% rode forwards of 353 ms, the mean 156). No prediction can say
    # which batch it will be, so a standing queue promises a first result by a slow forward (the cost
    # model's spread), and the admitted p99 keeps the target with the model as busy. Measured from 6 s:
    # the spread is learnt from the batches that ran (the first seconds of a server's life have too
    # few of these 200-ms batches).
    share, factor = spikes
    capacity = CAPACITY / (1 + share * (factor - 1))  # what the model serves with its slow forwards
    arrivals = own_flows(poisson(load * CAPACITY, 20.0, random.Random(3), tokens=TOKENS))
    res = simulate(shedding(), arrivals, A, B, measure_from=6.0, spikes=spikes, seed=3)
    assert res.pct(0.99) <= TARGET
    assert res.throughput((6.0, res.end)) >= 0.9 * capacity
    # Promising by the mean forward (the spread held at 1), the admitted p99 passed the target.
    monkeypatch.setattr(cost, "SPREAD_BOUNDS", (1.0, 1.0))
    blind = simulate(shedding(), arrivals, A, B, measure_from=6.0, spikes=spikes, seed=3)
    assert blind.pct(0.99) > 1.05 * TARGET


@pytest.mark.parametrize("load", [2.0, 4.0])
def test_a_standing_queue_s_wait_is_promised_at_the_slow_end_of_a_run_of_forwards(
    load: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Slow forwards in spells of four in a row (what takes the cores lasts longer than a batch), 30% of
    # them half as long again. A newcomer's wait is the batches ahead: predicted at the median forward,
    # a slow spell broke the promise of everyone admitted on it, and those who could no longer make the
    # bound were dropped late — decoded, tokenised and queued for nothing. Counted at the cost model's
    # run spread, the promises hold: late drops are rare and the admitted p99 keeps the target with a
    # margin, for a few per cent of throughput (a shorter standing queue admits less). Measured from
    # 10 s, once the spreads are learnt.
    share, factor = 0.3, 1.5
    capacity = CAPACITY / (1 + share * (factor - 1))
    arrivals = own_flows(poisson(load * CAPACITY, 30.0, random.Random(3), tokens=TOKENS))

    def run() -> Result:
        return simulate(shedding(), arrivals, A, B, measure_from=10.0, spikes=(share, factor), seed=3,
                        spell=4)

    res = run()
    assert res.pct(0.99) <= 0.95 * TARGET
    assert res.throughput((10.0, res.end)) >= 0.9 * capacity
    assert res.late_since(10.0) <= 0.002 * refused(res), (res.late_since(10.0), refused(res))
    # The wait at the drain pace alone (the median forward), as before the run spread:
    monkeypatch.setattr(admit.Admitter, "_pace",
                        lambda self: self.drain_pace if self.regime.overload else 1.0)
    blind = run()
    assert blind.late_since(10.0) > 4 * max(res.late_since(10.0), 1)
    assert blind.pct(0.99) > res.pct(0.99)
    assert res.throughput((10.0, res.end)) >= 0.95 * blind.throughput((10.0, blind.end))


def test_the_drain_pace_is_wall_time_between_completions_over_forwards_while_work_waits() -> None:
    sched = _standing_scheduler()
    adm = sched.admission
    before = adm.wait_s(10 * TOKENS, 1.0)
    t = 1.0
    for _ in range(8):  # forwards of 0.1 s, completions 0.15 s apart, work waiting throughout
        t += 0.15
        adm.drained(0.1, t, backlog=True)
    assert adm.drain_pace == pytest.approx(1.5)
    assert adm.wait_s(10 * TOKENS, t) == pytest.approx(before * 1.5, rel=1e-9)  # (busy_s is 0 here)
    assert adm.batch_limit_s == pytest.approx(TARGET / 2 / 1.5)  # the model held half the bound
    adm.regime.overload = False  # a burst's wait, or a queue standing a moment, is no promise: not scaled
    assert adm.wait_s(10 * TOKENS, t) == pytest.approx(before, rel=1e-9)
    adm.regime.overload = True
    # Idle time is not the model's: after a completion that left nothing waiting, or a failed batch,
    # the next completion starts a new run instead of counting the gap.
    adm.drained(0.1, t + 0.15, backlog=False)
    adm.drained(0.1, t + 5.0, backlog=True)
    adm.drained(None, t + 5.2, backlog=True)
    adm.drained(0.1, t + 9.0, backlog=True)
    assert adm.drain_pace == pytest.approx(1.5)
    t += 9.0
    for _ in range(16):  # completions as fast as the forwards: back to 1 (never below)
        t += 0.1
        adm.drained(0.1, t, backlog=True)
    assert adm.drain_pace == pytest.approx(1.0)


def _standing_scheduler() -> Scheduler:
    sched = Scheduler(shedding(), CostModel(), lambda n, m: n * m)
    for n in (1, 8, 64):  # as warm-up measures it
        sched.cost.observe(n * TOKENS, A + B * n * TOKENS)
    sched.regime.standing, sched.regime.capacity = True, 0.0  # an overload that goes on,
    sched.regime.overload = True  # confirmed (it has stood a whole interval more)
    sched.add([Entry(TOKENS, 1.0)])  # and a queue that has not emptied
    return sched


def test_a_standing_queue_runs_batches_no_longer_than_admission_counted_on() -> None:
    # Admission promises a first result within the wait bound, with a batch of half of it ahead
    # (Admitter.batch_s). A fresh input anchoring the next batch has the whole latency target left; a
    # batch sized to that target ran 64 inputs of 32 tokens (0.42 s) while everyone admitted behind it
    # had been promised 0.25 s.
    sched = _standing_scheduler()
    for i in range(200):  # one-text requests
        sched.add([Entry(32, 1.0, flow=i)])
    step = sched.next(1.0)
    assert isinstance(step.decision, Dispatch)
    assert step.decision.predicted_s <= sched.admission.batch_limit_s == TARGET / 2
    assert len(step.decision.batch) > 16  # still a batch: the overload needs the throughput


def _passes(sched: Scheduler, now: float, priority: int = 1, hold: bool = True) -> bool:
    return not isinstance(sched.precheck(TOKENS, TOKENS, 1, "default", 1.0, priority, now, now, hold=hold),
                          Refusal)


def test_requests_checked_before_tokenising_count_until_admitted() -> None:
    # Under a standing queue, requests that passed the early check are tokenised meanwhile: each
    # later check counts them ahead, so a crowd arriving together is not all let through against the
    # same empty queue, to be refused (or dropped late) after decoding and tokenising.
    sched = _standing_scheduler()
    passed = sum(_passes(sched, 1.0) for _ in range(2000))
    # About the target's worth of the model's rate, not all of them (nor one).
    assert 0.5 * TARGET * CAPACITY < passed < 1.5 * TARGET * CAPACITY
    assert not _passes(sched, 1.0)
    # Once admitted they are in the queue, no longer held: the fair queue counts them instead, so
    # admission sees about what the check saw (it decides again, so a few at the edge may go).
    admitted = 0
    for _ in range(passed):
        if sched.admit([TOKENS], "default", None, 1.0) is None:
            admitted += 1
            sched.add([Entry(TOKENS, 1.0)])
    assert admitted >= 0.9 * passed
    # Held normal requests do not refuse a high query.
    crowd = _standing_scheduler()
    while _passes(crowd, 1.0):
        pass
    assert _passes(crowd, 1.0, priority=0)
    # A check made again for the same request (the head's, before the route's) holds nothing.
    fresh = _standing_scheduler()
    assert all(_passes(fresh, 1.0, hold=False) for _ in range(2000))


def test_a_hold_on_an_estimate_above_the_real_tokens_ends_whole_at_admission() -> None:
    # The check from a request's head estimates its tokens from the body's size, JSON included: for a
    # short query, above what the tokenizer finds. Released by count (the oldest holds of the class, by
    # the real tokens), each admitted request left its excess held for HOLD_S, and a flood of them held
    # the room of a queue that was not there: a server refused nearly everyone under a sustained overload.
    # Carried to admission, each request's hold ends whole.
    estimate, real = 2 * TOKENS, TOKENS
    for exact in (True, False):
        sched = _standing_scheduler()
        for _ in range(20):
            held = sched.precheck(estimate, estimate, 1, "default", 1.0, 1, 1.0, 1.0)
            assert isinstance(held, Hold) and held
            carried = held if exact else None
            assert sched.admit([real], "default", None, 1.0, arrived=1.0, held=carried) is None
            sched.add([Entry(real, 1.0)])
        leftover = sum(h[1] for h in sched.admission._held)
        assert leftover == (0 if exact else 20 * (estimate - real))
    # A request whose inputs are all cached queues nothing: its hold ends all the same.
    sched = _standing_scheduler()
    held = sched.precheck(estimate, estimate, 1, "default", 1.0, 1, 1.0, 1.0)
    assert isinstance(held, Hold)
    sched.admission.unhold(held)
    assert sum(h[1] for h in sched.admission._held) == 0


def test_admission_counts_the_holds_taken_before_its_own_not_after() -> None:
    # Heads checked one after the other each hold their room; at admission, a held request counts the
    # holds taken before its own (the check judged it with those ahead), not those taken after it,
    # which were judged with it ahead of them. Counting them all, a request the check passed as the
    # first of a crowd was refused at admission behind the crowd, after its body was read and tokenised.
    sched = _standing_scheduler()
    holds = []
    while isinstance(held := sched.precheck(TOKENS, TOKENS, 1, "default", 1.0, 1, 1.0, 1.0), Hold):
        holds.append(held)
    assert len(holds) > 10
    first, last = holds[0], holds[-1]
    assert sched.admit([TOKENS], "default", None, 1.0, arrived=1.0, held=first) is None
    sched.add([Entry(TOKENS, 1.0)])
    # The last held one was judged behind every other hold: it is admitted once they are in the queue.
    for held in holds[1:-1]:
        assert sched.admit([TOKENS], "default", None, 1.0, arrived=1.0, held=held) is None
        sched.add([Entry(TOKENS, 1.0)])
    assert sched.admit([TOKENS], "default", None, 1.0, arrived=1.0, held=last) is None
    assert sum(h[1] for h in sched.admission._held) == 0


def test_holds_of_requests_that_never_arrive_lapse() -> None:
    sched = _standing_scheduler()
    while _passes(sched, 1.0):
        pass
    assert not _passes(sched, 1.0 + HOLD_S / 2)
    assert _passes(sched, 1.0 + HOLD_S * 1.01)  # they failed before admission: no longer counted


def _holds(sched: Scheduler, first: int, total: int, inputs: int) -> bool:
    """Whether a check before tokenising at 1.0 s passes (and holds)."""
    return isinstance(sched.precheck(first, total, inputs, "default", 1.0, 1, 1.0, 1.0), Hold)


def test_a_held_burst_of_long_inputs_is_counted_as_its_inputs() -> None:
    # A thousand one-chunk calls of 128 tokens arrive together and are all checked before any is
    # tokenised, on a GPU-like model whose forward costs mostly its fixed overhead (20 ms a batch, 2 µs
    # a token): sixteen batches of 64, about 0.6 s. Counted as inputs of 16 tokens, the same held
    # tokens were eight thousand inputs, 125 batches' overheads, 2.8 s: past a one-second burst bound,
    # so most of a burst the model serves in 0.6 s was refused.
    sched = Scheduler(shedding(burst_wait_s=1.0), CostModel(), lambda n, m: n * m)
    for n in (1, 8, 64):  # as warm-up measures it
        sched.cost.observe(n * 128, 0.020 + 2e-6 * n * 128)
    passed = sum(_holds(sched, 128, 128, 1) for _ in range(1000))
    assert passed == 1000
    # Still a bound: of two thousand more, not all pass (the three thousand are 1.7 s of work).
    more = sum(_holds(sched, 128, 128, 1) for _ in range(2000))
    assert more < 1000
    # A request of many inputs is counted as its inputs too: 64 of 128 tokens are one batch, 36 ms (20
    # ms and 8,192 tokens' 16 ms), so about 28 pass the one-second bound; read as 512 inputs of 16
    # tokens, each was eight batches, 0.18 s, and 6 passed.
    many = Scheduler(shedding(burst_wait_s=1.0), CostModel(), lambda n, m: n * m)
    for n in (1, 8, 64):
        many.cost.observe(n * 128, 0.020 + 2e-6 * n * 128)
    passed = sum(_holds(many, 128, 64 * 128, 64) for _ in range(100))
    assert 20 < passed < 36


def regime_at(res: Result, t: float) -> bool:
    return [standing for at, standing in res.standing if at <= t][-1]


def standing_share(res: Result, t0: float, t1: float) -> float:
    """The share of ``t0``..``t1`` the regime stood."""
    marks = [*res.standing, (res.end, False)]
    stood = sum(max(0.0, min(b, t1) - max(a, t0)) for (a, s), (b, _) in pairwise(marks) if s)
    return stood / (t1 - t0)


def test_the_regime_returns_to_good_after_the_overload_and_absorbs_the_next_burst() -> None:
    rng = random.Random(4)
    overload = own_flows(poisson(2.0 * CAPACITY, 5.0, rng, tokens=TOKENS))
    quiet = own_flows(poisson(0.3 * CAPACITY, 6.0, rng, start=5.0, tokens=TOKENS))
    burst = [Arrival(11.0 + i * 0.0002, TOKENS, flow=("burst", i)) for i in range(600)]
    res = simulate(shedding(), [*overload, *quiet, *burst], A, B)
    stood = [t for t, standing in res.standing if standing]
    assert stood and stood[0] < 1.0  # the overload was seen within about an interval
    ended = [t for t, standing in res.standing if not standing and t > stood[0]]
    assert ended and ended[0] < 5.5  # and was over soon after it ended
    assert sum(1 for f in res.finished if isinstance(f, tuple)) == 600  # the next burst: served whole
    assert not regime_at(res, 11.0)


def test_refused_callers_that_honour_retry_after_all_get_in() -> None:
    # A burst arriving over 1.5 s (longer than the interval, so part of it is refused or dropped late;
    # the openai client sends its 1,000 calls within about a second): every caller retries twice after
    # the server's Retry-After, as the openai client does.
    burst = own_flows([Arrival(i * 0.0015, TOKENS, retries=2) for i in range(1000)])
    res = simulate(shedding(), burst, A, B)
    assert res.retried > 0  # the test means something: some were refused
    assert res.failed == [] and res.completed == 1000
    assert res.end < 1.25 * 1000 / CAPACITY + 2.0  # the retries came back paced, not all at once


@pytest.mark.parametrize("gap", [0.001, 0.0015, 0.002])
def test_burst_callers_that_honour_retry_after_get_in_when_batches_run_late(gap: float) -> None:
    # The same burst against a model whose batch times vary by ±15% (padding, CPU that others take) and
    # whose per-batch cost is up to half again the cost model's seed: every caller still gets in within
    # the openai client's two retries.
    for seed in range(4):
        for a in (A, 1.5 * A):
            burst = own_flows([Arrival(i * gap, TOKENS, retries=2) for i in range(1000)])
            res = simulate(shedding(), burst, a, B, seed=seed, noise=0.15)
            assert res.failed == [] and res.completed == 1000, (seed, a)


@pytest.mark.parametrize("stall", [1.5, 2.0])
def test_burst_callers_get_in_when_the_queue_drains_slower_than_the_forwards_predict(stall: float) -> None:
    # A busy machine: between forwards the process tokenises, answers and refuses callers, and other
    # programs take the cores, so the queue drains at a half or two thirds of what the cost model (told
    # the forwards' times only) predicts. Every caller still gets in within its two retries (the
    # openai client's).
    for seed in range(3):
        burst = own_flows([Arrival(i * 0.0015, TOKENS, retries=2) for i in range(1000)])
        res = simulate(shedding(), burst, A, B, seed=seed, noise=0.15, stall=stall)
        assert res.retried > 0
        assert res.failed == [] and res.completed == 1000, (seed, len(res.failed))


@pytest.mark.parametrize("stall", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("tail", [0.8, 1.2])
def test_a_burst_whose_tail_trickles_in_loses_no_caller_on_a_busy_machine(stall: float, tail: float) -> None:
    # The thousand-chunk ingestion as it reaches a busy two-core machine: the client sends the first 600
    # within 0.6 s, then (its own event loop starved by the server beside it) the rest at about the rate
    # the model serves, for seconds, while the queue drains at 1/stall of the forwards' pace. The queue
    # stands for a moment while they arrive; what it admitted as a burst before must not be dropped for
    # it, and callers refused meanwhile must be told to come back once the whole queue ahead (not just
    # the bound's worth) has drained. It once lost up to 150 of the thousand after their two retries,
    # with ~700 dropped late.
    for seed in range(2):
        served = CAPACITY / stall
        head = [Arrival(i * 0.001, TOKENS, retries=2) for i in range(600)]
        rest = [Arrival(0.6 + i / (tail * served), TOKENS, retries=2) for i in range(400)]
        res = simulate(shedding(), own_flows(head + rest), A, B, seed=seed, noise=0.15, stall=stall)
        assert res.failed == [] and res.completed == 1000, (seed, len(res.failed), res.late)


def test_a_burst_admitted_whole_is_served_whole_when_the_machine_runs_slower_than_predicted() -> None:
    # 500 requests at once, predicted at 1.7 s of work against a 2 s burst bound, on a machine whose
    # forwards turn out twice as slow: the tail waits past the bound. A queue that keeps emptying is
    # drained in order, so dropping its oldest inputs would help no one behind them: they are served
    # (deadlines still drop what is hopeless). The old rule dropped about a third of them as late after
    # they had waited two seconds, to be sent to the back of the queue.
    burst = own_flows([Arrival(i * 0.0002, TOKENS) for i in range(500)])
    res = simulate(shedding(burst_wait_s=2.0), burst, A, B, slowdown=2.0)
    assert refused(res) == 0 and res.completed == 500
    assert max(res.latencies) > 2.0  # (the test means something: the tail did wait past the bound)


@pytest.mark.parametrize("seed", range(3))
def test_an_overload_from_an_idle_queue_holds_its_start_to_the_bound_once_confirmed(seed: int) -> None:
    # 4× capacity from an idle queue: its first interval looks like a burst while it arrives and is
    # admitted as one (seconds of work), and the queue then stands. Once it has stood for a whole
    # interval, the overload is confirmed and what that start put in the queue is held to the standing
    # bound too (answered late, not computed seconds late). Serving all of it, as a burst's admission is
    # kept, put the admitted p99 past 2 s; a burst whose tail trickles in stands only a moment (the test
    # above) and keeps its admission.
    arrivals = own_flows(poisson(4.0 * CAPACITY, 8.0, random.Random(seed), tokens=TOKENS))
    res = simulate(shedding(burst_wait_s=20.0), arrivals, A, B, seed=seed, noise=0.05)
    assert res.late > 0  # (the test means something: what the start put in the queue was dropped)
    assert res.pct(0.99) <= 2.5 * TARGET
    assert res.throughput((2.0, res.end)) >= 0.9 * CAPACITY  # the model kept busy meanwhile


_SOAK_PHASE_S = 30.0


def _soak_load(seed: int) -> list[Arrival]:
    """`make soak`'s load on the virtual clock: 30-s phases of 0.5x and 2x capacity, four of each."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    for k in range(8):
        arrivals += poisson((0.5 if k % 2 == 0 else 2.0) * CAPACITY, _SOAK_PHASE_S, rng,
                            start=k * _SOAK_PHASE_S, tokens=TOKENS)
    return own_flows(sorted(arrivals, key=lambda a: a.time))


def _double_phase_waits(res: Result, first_s: float = _SOAK_PHASE_S) -> dict[int, list[float]]:
    """Each 2x phase's admitted requests' times to their rows, of those arriving in its first ``first_s``."""
    waits: dict[int, list[float]] = {k: [] for k in range(1, 8, 2)}
    for batch in res.batches:
        for e in batch.entries:
            k = int(e.arrival // _SOAK_PHASE_S)
            if k in waits and e.arrival - k * _SOAK_PHASE_S < first_s:
                waits[k].append(batch.end - e.arrival)
    return waits


@pytest.mark.parametrize("seed", [7, 1, 11])
def test_alternating_half_and_double_capacity_keeps_every_double_phase_within_the_target(seed: int) -> None:
    # `make soak`'s load on the virtual clock: 30-s phases of 0.5x and 2x capacity, four of each. Every
    # 2x phase starts from a queue that keeps emptying, so its first interval is admitted as a burst,
    # up to the burst bound (a burst and the onset of an overload look alike until one of them stops).
    # Served first, that backlog made everything admitted behind it wait past the bound: the 2x phases'
    # p99 ran 0.73-0.78 s, their first 2 s alone 0.87-0.92 s, while the rest of each phase held
    # 0.43-0.47 s (seed 7, the code before). Set aside once the queue stands (the newest first,
    # FairQueue.split_off), the requests admitted under the standing promise keep it, and the backlog
    # is held to the bound once the overload is confirmed. (With the VM's random slow forwards and a
    # drain pace on top, what a phase's first half second admits before the queue can stand is still
    # served past the bound: the soak's remaining miss.)
    res = simulate(shedding(), _soak_load(seed), A, B)
    whole, onset = _double_phase_waits(res), _double_phase_waits(res, first_s=2.0)
    p99 = {k: res.pct(0.99, v) for k, v in whole.items()}
    first = {k: round(res.pct(0.99, v), 2) for k, v in onset.items()}
    assert max(p99.values()) <= TARGET * 1.02, f"2x phases' p99 {p99}, their first 2 s {first}"


@pytest.mark.parametrize("seed", [7, 1, 11])
def test_double_phases_keep_the_target_on_a_machine_whose_forwards_run_slow_in_spells(
    seed: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same load on a machine like the 2-core VM the soak runs on: 30% of forwards run half as long
    # again, in spells of four. Each 2x phase's first half second is admitted as a burst, before the
    # queue can stand; served oldest first, that backlog ran past the bound while the queue stood
    # unconfirmed (past 1.1x the target: the in-order run below, which also lets a fresh input's batch
    # carry the backlog's inputs past the bound, as the scheduler once did). Served newest first from
    # the moment the queue's head grows old with no overload known (FairQueue.newest_first), with those
    # left out of fresh inputs' batches (Scheduler._fresh_and_within_bound), what is served makes the
    # bound, and what could not is what confirmation then drops late: no more requests go unserved (the
    # same goodput), and the tail is the steady state's.
    def run() -> tuple[float, int]:
        res = simulate(shedding(), _soak_load(seed), A, B, seed=seed, spikes=(0.3, 1.5), spell=4)
        waits = _double_phase_waits(res)
        return max(res.pct(0.99, v) for v in waits.values()), sum(len(v) for v in waits.values())

    p99, served = run()
    assert p99 <= TARGET * 1.02, p99
    monkeypatch.setattr(FairQueue, "newest_first", property(lambda self: False, lambda self, on: None),
                        raising=False)
    monkeypatch.setattr(Scheduler, "_fresh_and_within_bound", lambda self, batch, finish: batch)
    in_order, served_in_order = run()
    assert in_order > TARGET * 1.1 and served >= 0.99 * served_in_order, (in_order, served, served_in_order)


def test_the_queue_s_age_is_its_head_s_as_if_served_in_admission_order() -> None:
    # Served newest first, the oldest input waits on; the regime reads how far behind the queue is as it
    # would be in order (as many inputs on from the first admitted as were taken), so a burst served
    # newest first stands when it would have in order, not sooner (then its callers were refused while
    # it still arrived, and their retries refused again).
    regime = Regime(target_s=0.1, interval_s=0.5)
    waiting = 3
    regime.queued = lambda: waiting
    regime.add([Entry(16, 0.0), Entry(16, 0.1), Entry(16, 0.2)])
    assert regime.head_age(0.3) == pytest.approx(0.3)
    waiting = 2  # one taken, whichever: in order, the first would have been
    assert regime.head_age(0.3) == pytest.approx(0.2)
    waiting = 0
    assert regime.head_age(0.3) is None


def test_a_standing_queue_is_confirmed_an_overload_after_a_whole_interval() -> None:
    regime = Regime(target_s=0.1, interval_s=0.5)
    regime.capacity = 1000.0
    regime.add([Entry(16, 0.0)])
    assert not regime.observe(0.2)  # old since 0.2
    regime.asked(1000, 0.7)
    assert regime.observe(0.75) and not regime.confirmed(0.75)  # it stands: a burst's moment, or not
    regime.asked(1000, 1.2)
    assert not regime.confirmed(1.2)
    assert regime.observe(1.3) and regime.confirmed(1.3)  # a whole interval on: an overload
    assert not regime.observe(1.7) and not regime.confirmed(1.7)  # arrivals stopped: a burst draining
    regime.asked(1000, 1.8)
    assert regime.observe(1.85) and not regime.confirmed(1.85)  # standing again at once: counted afresh


@pytest.mark.parametrize("arrivals_go_on", [True, False], ids=["overload", "burst"])
def test_a_queue_that_stands_unconfirmed_serves_what_it_admits_before_its_burst(arrivals_go_on: bool) -> None:
    # Two hundred one-input requests admitted as a burst over 0.6 s, then the queue stands (not yet
    # confirmed an overload): what it admits now goes first, then the burst's backlog, newest first (the
    # onset of an overload and a burst look alike: its oldest could no longer make the bound anyway),
    # as much of it as the batch finishes within the bound. A whole interval on, arrivals still coming:
    # an overload, the queue folds back into one fair order and the backlog, past the bound, is
    # answered late. Arrivals stopped instead: a burst draining, its backlog served, in order again
    # (arrivals no longer outpace the model).
    cost = CostModel()
    for n in (16, 256, 1024):
        cost.observe(n, A + B * n)
    s = Scheduler(shedding(), cost, lambda n, m: n * m)
    burst = [Entry(TOKENS, 0.003 * i, flow=("burst", i)) for i in range(200)]
    for e in burst:
        s.add([e])
    s.regime.asked(100_000, 0.2)
    assert not s.regime.observe(0.2)  # old since 0.2
    s.regime.asked(100_000, 0.75)
    assert s.regime.observe(0.75) and not s.regime.confirmed(0.75)
    fresh = [Entry(TOKENS, 0.75, flow=("since", i)) for i in range(5)]
    for e in fresh:
        s.add([e])
    step = s.next(0.75)
    assert isinstance(step.decision, Dispatch) and not step.late
    batch = step.decision.batch
    served = batch[5:]
    assert batch[:5] == fresh and served == burst[::-1][: len(served)]
    # Some of the backlog rides, none past the bound, and the batch had room for more.
    assert served and all(0.75 + step.decision.predicted_s - e.arrival <= 0.5 for e in served)
    assert len(batch) < 64
    left = burst[: len(burst) - len(served)]
    s.done(step.decision.padded_tokens, 0.2, 0.95)
    if arrivals_go_on:
        s.regime.asked(100_000, 1.3)
    step = s.next(1.3)
    if arrivals_go_on:
        assert s.regime.confirmed(1.3)
        assert not isinstance(step.decision, Dispatch) and step.late == left  # in fair order, none run
    else:
        assert not s.standing and not step.late
        assert isinstance(step.decision, Dispatch) and step.decision.batch[0] is left[0]


def test_a_fresh_input_s_batch_leaves_the_backlog_past_the_bound_to_wait_not_to_ride() -> None:
    # The queue stands, not yet confirmed an overload, and a burst's inputs wait in its backlog, every
    # one past the bound. Length grouping would fill a fresh query's batch with those of its length,
    # ahead of the fresh input of another length, and serve them past the bound just before the
    # overload is confirmed (when they would be dropped late): most of the soak's slowest requests on
    # the VM. Each fresh input's batch leaves them out; once no fresh input waits, they run.
    cost = CostModel()
    for n in (16, 256, 1024):
        cost.observe(n, A + B * n)
    s = Scheduler(shedding(), cost, lambda n, m: n * m)
    burst = [Entry(TOKENS, 0.0, flow=("burst", i)) for i in range(100)]
    for e in burst:
        s.add([e])
    s.regime.asked(100_000, 0.2)
    assert not s.regime.observe(0.2)
    s.regime.asked(100_000, 0.75)
    assert s.regime.observe(0.75) and not s.regime.confirmed(0.75)
    fresh = [Entry(TOKENS, 0.75, flow=("since", 0)), Entry(4 * TOKENS, 0.75, flow=("since", 1))]
    for e in fresh:
        s.add([e])
    batches = []
    for now in (0.75, 0.76, 0.77):
        step = s.next(now)
        assert isinstance(step.decision, Dispatch) and not step.late and not s.regime.confirmed(now)
        batches.append(step.decision.batch)
        s.done(step.decision.padded_tokens, 0.005, now + 0.005)
    ran = [(bool(set(b) & set(fresh)), bool(set(b) & set(burst))) for b in batches]
    assert (True, True) not in ran  # no batch carried both
    assert sum(len(b) for b, (f, _) in zip(batches, ran, strict=True) if f) == len(fresh)
    first_burst = ran.index((False, True))  # the backlog ran, unconfirmed still, nothing fresh waiting
    assert all(f for f, _ in ran[:first_burst])


def test_a_queue_that_was_about_to_stand_but_did_not_leaves_no_memory_of_standing() -> None:
    # Old for a whole interval while arrivals stay below the model's rate: a burst draining, not an
    # overload, so it never stood, and a queue that grows old again later is judged afresh (a whole
    # interval), not as an overload that goes on. (It once stamped "stood until now" there, so every
    # request of a burst that followed was held to the standing bound and then dropped as late.)
    regime = Regime(target_s=0.1, interval_s=0.5)
    regime.capacity = 1000.0
    first = Entry(16, 0.0)
    regime.add([first])
    assert not regime.observe(0.2)  # old since 0.2
    regime.asked(100, 0.7)
    assert not regime.observe(0.75)  # old for a whole interval, but 400 tokens/s arriving
    assert not regime.recent(0.8)
    regime.queued = lambda: 0  # it drained (a batch took it); later a queue grows old again, with
    assert not regime.observe(0.9)  # arrivals faster than the rate
    regime.add([Entry(16, 1.0)])
    regime.queued = lambda: 1
    regime.asked(2000, 1.1)
    assert not regime.observe(1.2)  # an interval starts: it does not stand at once
    regime.asked(2000, 1.6)
    assert regime.observe(1.75)  # old for a whole interval with arrivals going on: it stands


def test_a_standing_queue_stands_until_arrivals_fall_clearly_below_the_model_s_rate() -> None:
    # Hysteresis: arrivals near the rate (callers paced back by Retry-After, a handful per window on a
    # slow model) must not flip the regime at every dispatch.
    regime = Regime(target_s=0.1, interval_s=0.5)
    regime.capacity = 1000.0  # tokens per second
    regime.add([Entry(16, 0.0)])
    assert not regime.observe(0.2)  # old since 0.2
    regime.asked(300, 0.6)
    assert regime.observe(0.75)  # old for a whole interval, 1,200 tokens/s arriving: it stands
    regime.asked(240, 0.85)
    assert regime.observe(0.9)  # 960 tokens/s: below the rate, but not clearly: it still stands
    assert not regime.observe(1.2)  # nothing for a window: a burst draining
    regime.asked(240, 1.3)
    assert not regime.observe(1.3)  # 960 tokens/s does not make it stand again...
    regime.asked(60, 1.35)
    assert regime.observe(1.35)  # ...1,200 does


def test_a_confirmed_overload_stands_through_the_moments_its_queue_is_empty() -> None:
    regime = Regime(target_s=0.1, interval_s=0.5)
    regime.capacity = 1000.0  # tokens per second
    first = Entry(16, 0.0)
    regime.add([first])
    for t in (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6):  # 2,000 tokens/s arriving throughout
        regime.asked(500, t)
    assert not regime.observe(0.2)  # old since 0.2
    assert regime.observe(0.75) and not regime.overload  # it stands: a burst's moment, or not
    assert regime.observe(1.3) and regime.overload  # a whole interval on: a confirmed overload
    regime.queued = lambda: 0  # a batch took everything waiting (the rest was refused at the door)
    assert regime.observe(1.35) and regime.overload  # arrivals go on: it still stands
    assert not regime.observe(1.9) and not regime.overload  # arrivals stopped: it ends
    # A queue that stood only a moment (not confirmed) is drained when it empties, as before: a burst
    # still arriving stands for a moment too, and its retries must not meet a standing queue.
    regime = Regime(target_s=0.1, interval_s=0.5)
    regime.capacity = 1000.0
    first = Entry(16, 0.0)
    regime.add([first])
    for t in (0.2, 0.4, 0.6, 0.8):
        regime.asked(500, t)
    regime.observe(0.2)
    assert regime.observe(0.75) and not regime.overload
    regime.queued = lambda: 0
    assert not regime.observe(0.8)


def test_a_confirmed_overload_ends_when_arrivals_stop_even_with_nothing_to_observe_it() -> None:
    # Once it stands through an empty queue, no admission or batch may come to observe it again: the
    # scheduler asks to be woken once the arrivals window has passed, and then it ends.
    sched = _standing_scheduler()
    sched.regime.capacity = sched.admission.capacity()
    sched.regime.asked(100_000, 1.0)  # arrivals going on, far faster than the model serves
    step = sched.next(1.0)  # takes what waits
    assert isinstance(step.decision, Dispatch)
    sched.done(step.decision.padded_tokens, 0.05, 1.05)
    step = sched.next(1.05)
    assert sched.standing and isinstance(step.decision, Wait)  # empty, standing, and it will look again
    step = sched.next(step.decision.until)
    assert not sched.standing and step.decision is None  # no arrivals for a window: the overload is over


@pytest.mark.parametrize("load", [2.0, 4.0])
def test_a_sustained_overload_is_shed_at_the_door_not_late(load: float) -> None:
    # Before a confirmed overload stood through its empty moments, a batch that took all that waited
    # ended the standing queue, the next target's worth of arrivals was admitted as a burst, and what
    # could not keep the bound was dropped late, after being tokenised and queued: at 4× the queue stood
    # 64% of the time and a sixth of the refusals (3,312 of 17,945) were late drops.
    arrivals = own_flows(poisson(load * CAPACITY, 20.0, random.Random(3), tokens=TOKENS))
    res = simulate(shedding(), arrivals, A, B, measure_from=2.0)
    assert standing_share(res, 2.0, 20.0) >= 0.95
    # (What arrived once it went on: the onset's backlog is held to the bound, see the test above.)
    assert res.late_since(2.0) <= 0.04 * refused(res), (res.late_since(2.0), dict(res.refused))


def test_a_standing_queue_promises_less_than_it_drops_at(monkeypatch: pytest.MonkeyPatch) -> None:
    # Admission's line (DOOR of the bound) and the late drop's (the bound) differ by the prediction's
    # slack: batches that hold the model 1.3× their forward, mispredicted while the drain pace learns
    # it.
    sched = _standing_scheduler()
    sched.add([Entry(TOKENS, 1.0, flow=i) for i in range(40)])
    sched.regime.asked(100_000, 1.0)  # arrivals going on, far faster than the model serves
    own = sched.admission.batch_s(TOKENS)
    wait = sched.admission.wait_s(sched.queued_tokens, 1.0)
    bound = shedding().max_queue_wait_s
    # A request arriving now is promised its first result within DOOR of the bound: refused at the door
    # when it would be predicted between the two lines...
    elapsed = DOOR * bound - own - wait + 0.01
    assert 0 < elapsed < bound - own - wait
    assert sched.admit([TOKENS], "default", None, 1.0, arrived=1.0 - elapsed) is not None
    for seed in (3, 4):
        stall = 1.3
        arrivals = own_flows(poisson(2.0 * CAPACITY / stall, 20.0, random.Random(seed), tokens=TOKENS))
        res = simulate(shedding(), arrivals, A, B, measure_from=2.0, stall=stall)
        assert res.pct(0.99) <= TARGET, seed  # ...and the admitted keep the target
        assert res.throughput((2.0, res.end)) >= 0.95 * CAPACITY / stall, seed  # the model kept busy
        with monkeypatch.context() as m:  # one line for both: the admitted p99 passes the target
            m.setattr(admit, "DOOR", 1.0)
            assert simulate(shedding(), arrivals, A, B, measure_from=2.0, stall=stall).pct(0.99) > TARGET


def test_short_requests_are_not_the_ones_dropped_late_under_a_sustained_overload() -> None:
    # One-text requests of 4 to 28 tokens at 2×. Admission promises each a start by what waits ahead of
    # it now; a request dropped late is one whose promise fair order did not keep. Whatever its length,
    # a request should be about as likely to meet that fate. When a newcomer's start tag was the flow
    # clock minus its own tokens (the clock advancing by the tokens served over the number of waiting
    # requests, a few a batch), a longer request arriving batches later was ordered ahead of a short one
    # that waited: 43% of those of at most 8 tokens were dropped late, 0.3% of those of 24 or more.
    arrivals = own_flows(poisson(2.0 * CAPACITY, 20.0, random.Random(3), tokens=lambda r: r.randint(4, 28)))
    late = simulate(shedding(), arrivals, A, B, measure_from=2.0).late_tokens
    short = sum(1 for a in arrivals if a.tokens <= 8)
    long_ = sum(1 for a in arrivals if a.tokens >= 24)
    share_short = sum(1 for t in late if t <= 8) / short
    share_long = sum(1 for t in late if t >= 24) / long_
    assert share_short <= 2 * share_long + 0.02, (f"{share_short:.1%} of the requests of <= 8 tokens dropped "
                                                  f"late, {share_long:.1%} of those of >= 24")


def test_a_low_priority_flood_does_not_refuse_high_priority_queries() -> None:
    rng = random.Random(5)
    flood = own_flows(poisson(3.0 * CAPACITY, 15.0, rng, tokens=TOKENS, priority=2))
    queries = own_flows(poisson(5.0, 15.0, rng, tokens=TOKENS, priority=0))
    res = simulate(shedding(), sorted([*flood, *queries], key=lambda a: a.time), A, B)
    assert refused(res) > len(flood) / 2  # the flood is shed...
    assert len(res.by_priority[0]) == len(queries)  # ...but not one query
    assert max(res.by_priority[0]) <= TARGET


def test_a_flooding_tenant_does_not_refuse_a_light_one() -> None:
    rng = random.Random(6)
    flood = own_flows(poisson(3.0 * CAPACITY, 15.0, rng, tokens=TOKENS, tenant="flood"))
    light = own_flows(poisson(0.1 * CAPACITY, 15.0, rng, tokens=TOKENS, tenant="light"))
    res = simulate(shedding(tenant_max_queued_tokens=1 << 20), sorted([*flood, *light], key=lambda a: a.time),
                   A, B)
    assert len(res.by_tenant["light"]) == len(light)
    assert res.pct(0.99, res.by_tenant["light"]) <= TARGET


def test_time_spent_before_admission_counts() -> None:
    # The same standing queue: a request that already waited 0.4 s (event loop, body) is refused, one
    # that arrived just now is admitted.
    cost = CostModel()
    for n in (16, 256, 1024):
        cost.observe(n, A + B * n)
    s = Scheduler(shedding(), cost, lambda n, m: n * m)
    s.add([Entry(TOKENS, -1.0, flow=i) for i in range(40)])  # waiting 1 s: the queue stands
    s.regime.observe(-0.6)
    s.regime.asked(100_000, 0.0)  # arrivals going on far faster than the model serves
    assert s.regime.observe(0.0)
    # Admitted since it stood (they go before what it was admitted as a burst): about 0.15 s of work
    # ahead of a newcomer.
    s.add([Entry(TOKENS, 0.0, flow=("since", i)) for i in range(40)])
    fresh = s.admit([TOKENS], "default", None, 0.0, arrived=0.0)
    late = s.admit([TOKENS], "default", None, 0.0, arrived=-0.4)
    assert fresh is None
    assert late is not None and late.reason == "overloaded" and late.retry_after > 0


def test_under_a_standing_queue_late_inputs_of_the_lower_classes_are_dropped_not_a_high_query() -> None:
    # A high query that waited past the bound while a low flood stood (a long running batch, a gateway
    # busy refusing the flood) is still computed; the flood's late inputs are answered 429 late.
    cost = CostModel()
    for n in (16, 256, 1024):
        cost.observe(n, A + B * n)
    s = Scheduler(shedding(), cost, lambda n, m: n * m)
    s.regime.standing = True  # the flood goes on: what follows is admitted under a standing queue
    for i in range(40):  # forty one-text requests of the flood, and one query
        s.add([Entry(TOKENS, -1.0, flow=i, priority=2)])
    s.add([Entry(TOKENS, -1.0, flow=99, priority=0)])
    s.regime.observe(-0.6)
    s.regime.asked(100_000, 0.0)
    assert s.regime.observe(0.0)
    window = s._queue.window(64)
    late = s.admission.late(window, 0.0, 0.0)
    assert len(late) == 40 and {e.priority for e in late} == {2}
    # The flood's inputs just refused or dropped, the query alone is still computed; a late normal
    # input with no lower class waiting is dropped like any other.
    s._queue.take([e for e in s._queue.window(64) if e.priority == 2], charge=False)
    assert s.admission.late(s._queue.window(64), 0.0, 0.0) == []
    s.add([Entry(TOKENS, -1.0, flow=100, priority=1)])
    assert [e.flow for e in s.admission.late(s._queue.window(64), 0.0, 0.0)] == [100]


def test_the_regime_stands_only_after_a_whole_interval_of_an_old_queue_with_arrivals_going_on() -> None:
    regime = Regime(target_s=0.1, interval_s=0.5)
    regime.capacity = 1000.0  # tokens per second the model serves
    old = Entry(16, 0.0)
    regime.add([old])
    for t in (0.05, 0.25, 0.65):  # old since 0.25 (first seen older than 0.1), 0.4 s only at 0.65
        regime.asked(200, t)  # 200 tokens in the last 0.1 s: 2,000 tokens/s, twice the capacity
        assert not regime.observe(t)
    regime.asked(200, 0.8)
    assert regime.observe(0.8)  # a whole interval old, arrivals going on: it stands
    assert not regime.observe(1.0)  # no arrivals for 0.2 s: a burst draining, not overload
    regime.asked(200, 1.05)
    assert regime.observe(1.05)  # arrivals again soon after: it stands again at once
    regime.queued = lambda: 0
    assert not regime.observe(1.1)  # nothing waits: over
    assert regime.head_age(1.1) is None


def test_retry_after_spreads_the_refused_at_the_model_s_rate_and_stays_bounded() -> None:
    pacer = RetryPacer(longest_s=10.0)
    hints = [pacer.after(0.0, 1.0, 0.01) for _ in range(100)]
    # One after the other, each 10 ms of predicted compute apart, and a quarter more for batches that
    # run late.
    assert hints[0] == pytest.approx(1.0125)
    assert hints == sorted(hints) and hints[-1] == pytest.approx(2.25)
    assert max(pacer.after(0.0, 1.0, 1.0) for _ in range(100)) == pytest.approx(10.0)  # bounded
    assert pacer.after(100.0, 0.5, 0.01) == pytest.approx(0.5125)  # a new episode starts afresh
    # By default the bound is a minute, not the burst bound: a burst of 50 s of work ahead is spread
    # over that, not told "10 s" a thousand times over and back as one wave.
    spread = RetryPacer()
    hints = [spread.after(0.0, 0.0, 0.04) for _ in range(1000)]
    assert len(set(hints)) == 1000 and hints[-1] == pytest.approx(50.0)


def test_predictions_that_call_even_a_fresh_input_late_do_not_stop_the_model() -> None:
    # Under a 4× flood one live run served nothing for 18 s while its model sat idle and every input the
    # door admitted was dropped late; this is how that happens. Lateness counts an input's wait so far
    # plus predicted forwards, scaled under a confirmed overload by the drain pace and the spread (up to
    # 9×); a fit gone wrong (here a fixed cost of 0.2 s, as a few slow forwards of full batches of one
    # size can read) then says that even an input that has just arrived cannot make the bound. Dropped,
    # it never runs, so no forward corrects the fit: nothing ever runs again. An input is late by its own
    # wait, past half the bound; until then the prediction alone drops nothing.
    big = CostModel()
    for n in (16, 256, 1024):
        big.observe(n, 0.2 + B * n)
    s = Scheduler(shedding(), big, lambda n, m: n * m)
    s.add([Entry(TOKENS, -2.0, flow=0, lead=True, strict=True)])
    for t in (-1.0, -0.4, 0.2):  # old past the target for a whole interval, arrivals going on: it stands
        s.regime.asked(100_000, t)
        s.regime.observe(t)
    assert s.regime.confirmed(0.2) and s.regime.overload
    s.admission.drain_pace = admit.DRAIN_BOUNDS[1]
    big.spread = cost.SPREAD_BOUNDS[1]
    fresh = [Entry(TOKENS, 0.2, flow=i, lead=True, strict=True) for i in range(1, 9)]
    for e in fresh:
        s.add([e])
    step = s.next(0.2)
    assert [e.flow for e in step.late] == [0]  # the one that waited 2.2 s
    assert isinstance(step.decision, Dispatch)
    assert {e.flow for e in step.decision.batch} == {e.flow for e in fresh}
