"""The fair order of waiting inputs (tenants → priority classes → flows), as a pure object."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Hashable

import pytest
from coalesce.service.batching.fair import Entry, FairQueue

WEIGHTS = (16.0, 4.0, 1.0)


def entries(n: int, tokens: int = 10, **kw: object) -> list[Entry]:
    return [Entry(tokens, 0.0, **kw) for _ in range(n)]  # type: ignore[arg-type]


def serve(q: FairQueue, batches: int, size: int) -> Counter[Hashable]:
    """Take ``batches`` batches of the first ``size`` in fair order: tokens per (tenant, class, flow)."""
    served: Counter[Hashable] = Counter()
    for _ in range(batches):
        batch = q.window(size)
        q.take(batch, charge=True)
        for e in batch:
            served[(e.tenant, e.priority, e.flow)] += e.n_tokens
    return served


def test_flows_share_a_class_by_tokens() -> None:
    q = FairQueue(WEIGHTS)
    q.add(entries(500, 10, flow="short"))
    q.add(entries(500, 30, flow="long"))
    served = serve(q, 10, 40)
    assert served[("default", 1, "short")] == pytest.approx(served[("default", 1, "long")], rel=0.05)


def test_a_new_flow_goes_first_and_the_old_one_fills_the_rest() -> None:
    q = FairQueue(WEIGHTS)
    q.add(entries(2048, 200, flow="bulk"))
    q.take(q.window(64), charge=True)
    query = Entry(12, 1.0, flow="query")
    q.add([query])
    window = q.window(64)
    assert window[0] is query
    assert all(e.flow == "bulk" for e in window[1:])


@pytest.mark.parametrize(
    "newcomer",
    [{"flow": "query"}, {"flow": "query", "priority": 0}, {"flow": "query", "tenant": "other"}],
    ids=["flow", "class", "tenant"],
)
def test_a_newcomer_after_a_batch_without_the_bulk_still_goes_first(newcomer: dict[str, object]) -> None:
    # A batch that served only newcomers (a query too short to pad to the bulk's length on a CPU)
    # leaves the bulk request a little behind the level's clock; the next newcomer must still not
    # wait behind a whole bulk batch for that: it is no later than the least-served sibling.
    q = FairQueue(WEIGHTS)
    q.add(entries(2048, 200, flow="bulk"))
    q.take(q.window(64), charge=True)
    for _ in range(2):
        q.add([Entry(12, 1.0, **newcomer)])  # type: ignore[arg-type]
        q.take([e for e in q.window(64) if e.flow != "bulk"], charge=True)
    late = Entry(12, 2.0, **newcomer)  # type: ignore[arg-type]
    q.add([late])
    assert q.window(1) == [late]


@pytest.mark.parametrize("seed", range(4))
def test_later_longer_requests_do_not_overtake_waiting_short_ones_under_a_standing_queue(seed: int) -> None:
    # 40 one-text requests of 4 to 28 tokens arrive between batches of 32: the queue stands and grows.
    # Admission promised each request a start by what waited ahead of it, so a later request must not
    # go far ahead of an earlier one, however long either is: a short query overtaken batch after batch
    # by longer newcomers misses that promise and is refused late. Requests that arrive together may
    # go shortest first (ties), so a batch spans a few arrival intervals, not many; and the longest wait
    # is the same for short and long requests. (With a newcomer credited its own length against a flow
    # clock that moves a few tokens a batch, a batch spanned 18-19 intervals over these seeds and short
    # requests waited up to 20-21 batches, long ones 5-6.)
    rng = random.Random(seed)
    q = FairQueue(WEIGHTS)
    spans: list[int] = []
    waits: dict[bool, list[int]] = {True: [], False: []}  # short (<= 8 tokens) or long (>= 24)
    for step in range(60):
        q.add([Entry(rng.randint(4, 28), float(step), flow=(step, i)) for i in range(40)])
        batch = q.window(32)
        q.take(batch, charge=True)
        spans.append(int(max(e.arrival for e in batch) - min(e.arrival for e in batch)))
        for e in batch:
            if e.n_tokens <= 8 or e.n_tokens >= 24:
                waits[e.n_tokens <= 8].append(step - int(e.arrival))
    assert q.items > 400  # the queue stood throughout
    assert max(spans) <= 4
    assert abs(max(waits[True]) - max(waits[False])) <= 2, (max(waits[True]), max(waits[False]))


def test_an_idle_flow_tenant_or_class_earns_no_credit() -> None:
    q = FairQueue(WEIGHTS)
    q.add(entries(5, flow="returning", tenant="a"))
    q.add(entries(5, priority=0, tenant="a"))
    serve(q, 1, 10)
    # Only tenant b, normal class, flow "busy" is served for a long while; then everyone comes back.
    q.add(entries(5000, flow="busy", tenant="b"))
    serve(q, 100, 20)
    q.add(entries(1000, flow="returning", tenant="a"))
    q.add(entries(1000, flow="other", tenant="b"))
    served = serve(q, 20, 20)
    tenant_a = served[("a", 1, "returning")]
    tenant_b = served[("b", 1, "busy")] + served[("b", 1, "other")]
    assert tenant_a == pytest.approx(tenant_b, rel=0.05), "tenant a does not burst"
    assert served[("b", 1, "busy")] == pytest.approx(served[("b", 1, "other")], rel=0.1), "nor flow other"
    # A class: high went idle while normal was served; back with a backlog it gets its 16:4 share.
    q = FairQueue(WEIGHTS)
    q.add(entries(5, priority=0))
    serve(q, 1, 5)
    q.add(entries(5000, flow="normal"))
    serve(q, 100, 20)
    q.add(entries(1000, priority=0))
    served = serve(q, 20, 20)
    assert served[("default", 0, None)] / sum(served.values()) == pytest.approx(16 / 20, abs=0.03)


def test_classes_share_by_weight_when_all_are_backlogged() -> None:
    q = FairQueue(WEIGHTS)
    for priority in (0, 1, 2):
        q.add(entries(3000, 10, priority=priority))
    served = serve(q, 50, 42)
    total = sum(served.values())
    for priority, weight in enumerate(WEIGHTS):
        assert served[("default", priority, None)] / total == pytest.approx(weight / 21, abs=0.01)


def test_a_fresh_input_of_an_idle_class_goes_first_however_old_the_others_are() -> None:
    q = FairQueue(WEIGHTS)
    q.add([Entry(16, float(i), flow=i) for i in range(300)])  # normal inputs, long waiting
    q.take(q.window(64), charge=True)
    high = Entry(16, 100.0, priority=0, flow="high")
    low = Entry(16, 100.0, priority=2, flow="low")
    q.add([low, high])
    window = q.window(64)
    # High before everything; low level with normal's least-served input, so after only the few normal
    # inputs that finish before it at their 4× weight (weighted fair queuing between classes).
    assert window[0] is high
    assert window.index(low) == 4


def test_emptied_flows_and_idle_tenants_hold_no_memory() -> None:
    q = FairQueue(WEIGHTS)
    for i in range(3000):
        q.add([Entry(4, 0.0, tenant=f"t{i}", flow=i)])
        q.take(q.window(1), charge=True)
    assert len(q.tenants) <= 1025
    q.add(entries(300, flow="bulk"))
    batch = q.window(256)[::2]  # every other one: the rest stay behind in the flow's deque
    q.take(batch, charge=True)
    q.take(q.window(256), charge=True)
    assert q.items == 0 and q.tokens == 0 and not list(q.waiting())
    classes = [c for t in q.tenants.values() for c in t.classes]
    assert all(not c.flows and not c.order for c in classes)


# Requests of 1 to 20 inputs, a fifth of them in their tenant's shared flow; or every one a query of
# its own (no flow holds more than one input: the case newest first orders).
_MIXED, _QUERIES = ([1, 1, 1, 3, 20], 0.8), ([1], 1.0)


@pytest.mark.parametrize(("split", "newest", "sizes"), [(None, False, _MIXED), (200, False, _MIXED),
                                                      (200, True, _QUERIES)],
                         ids=["one order", "split", "one-input requests, split and newest first"])
@pytest.mark.parametrize("seed", range(6))
def test_the_window_is_the_order_of_taking_inputs_one_at_a_time(
    seed: int, split: int | None, newest: bool, sizes: tuple[list[int], float],
) -> None:
    # The window is computed without taking anything; it must be exactly the order in which the
    # inputs would be served if each were taken (and charged) alone, across tenants, classes and flows,
    # with inputs already taken out of the middle of flows (and with the queue split half way; one-input
    # requests served newest first from there. A class whose last request of several inputs comes down
    # to one input within a window turns newest first only at the next window.)
    def build() -> FairQueue:
        rng = random.Random(seed)
        q = FairQueue(WEIGHTS)
        for i in range(400):
            if i == split:
                q.split_off()
                q.newest_first = newest
            n = rng.choice(sizes[0])
            q.add(
                [
                    Entry(
                        rng.randint(4, 64),
                        float(i),
                        tenant=rng.choice(["default", "a", "b"]),
                        weight=2.0 if i % 7 == 0 else 1.0,
                        priority=rng.randint(0, 2),
                        payload=(i, k),
                        flow=i if rng.random() < sizes[1] else None,
                    )
                    for k in range(n)
                ]
            )
            if i % 50 == 49:
                q.take(q.window(60)[::3], charge=True)
        return q

    a, b = build(), build()
    count = min(300, b.items)
    window = [e.payload for e in a.window(count)]
    one_by_one = []
    for _ in range(count):
        (e,) = b.window(1)
        one_by_one.append(e.payload)
        b.take([e], charge=True)
    assert window == one_by_one


def test_while_split_the_requests_that_join_go_before_the_backlog_until_it_folds() -> None:
    # A backlog of one-input requests (a burst), then the queue splits (it stands, not yet confirmed an
    # overload): the requests that join go first, in their own arrival order, and a newcomer counts only
    # them ahead of it; folded, the backlog's older tags put it first again.
    q = FairQueue(WEIGHTS)
    backlog = [Entry(10, 0.0, flow=("old", i)) for i in range(50)]
    q.add(backlog)
    q.take(q.window(5), charge=True)
    q.split_off()
    fresh = [Entry(10, 1.0, flow=("new", i)) for i in range(8)]
    for e in fresh:
        q.add([e])
    assert q.tokens_ahead("default", 1.0, 1, 10) == 8 * 10  # not the 45 waiting behind them
    window = q.window(20)
    assert window[:8] == fresh and window[8:] == backlog[5:17]
    q.take(window[:3], charge=True)
    assert q.window(5) == fresh[3:]
    q.fold()
    assert q.window(45 + 5) == [*backlog[5:], *fresh[3:]]
    assert q.tokens_ahead("default", 1.0, 1, 10) == (45 + 5) * 10


def test_newest_first_the_backlog_s_queries_go_newest_first_and_requests_of_many_keep_fair_order() -> None:
    # While a queue's head is old and no overload is known (a burst arriving, or an overload's onset),
    # its one-input requests are served newest first: the oldest could no longer make the bound anyway,
    # and the newest still can. What joins after a split goes first, in its own order (it was admitted
    # on a promise); folded back and in order again, the oldest goes first.
    q = FairQueue(WEIGHTS)
    backlog = [Entry(10, float(i), flow=("old", i)) for i in range(20)]
    for e in backlog:
        q.add([e])
    q.newest_first = True
    assert q.window(5) == backlog[::-1][:5]
    q.take(q.window(5), charge=True)
    assert q.window(3) == [backlog[14], backlog[13], backlog[12]]
    q.split_off()
    fresh = [Entry(10, 30.0, flow=("new", i)) for i in range(2)]
    for e in fresh:
        q.add([e])
    assert q.window(4) == [*fresh, backlog[14], backlog[13]]
    q.newest_first = False
    q.fold()
    assert q.window(17) == [*backlog[:15], *fresh]
    # A request of many inputs waiting beside queries: fair order as before, whichever way.
    mixed = FairQueue(WEIGHTS)
    mixed.add(entries(6, flow="bulk"))
    for i in range(6):
        mixed.add([Entry(4, 1.0 + i, flow=i)])
    in_order = mixed.window(12)
    mixed.newest_first = True
    assert mixed.window(12) == in_order


def test_a_split_keeps_the_shares_of_tenants_and_classes() -> None:
    # The split orders one class's requests only: a light tenant's backlog keeps its tenant's share
    # beside a flood that joins after the split, and a low backlog its class's share beside new
    # normal requests.
    q = FairQueue(WEIGHTS)
    q.add([Entry(10, 0.0, tenant="light", flow=("light", i)) for i in range(100)])
    q.add([Entry(10, 0.0, priority=2, flow=("low", i)) for i in range(50)])
    q.split_off()
    q.add([Entry(10, 1.0, flow=("flood", i)) for i in range(400)])
    served = serve(q, 10, 10)
    light = sum(n for (tenant, _, _), n in served.items() if tenant == "light")
    low = sum(n for (_, priority, _), n in served.items() if priority == 2)
    assert light == pytest.approx(500, rel=0.1)  # half the model: two tenants of one weight
    assert low == pytest.approx(500 / 5, rel=0.2)  # normal:low = 4:1 of the default tenant's half


def test_a_split_queue_emptied_and_folded_holds_no_memory() -> None:
    q = FairQueue(WEIGHTS)
    q.add(entries(30, flow="bulk"))
    q.split_off()
    for i in range(30):
        q.add([Entry(4, 1.0, flow=i)])
    q.take(q.window(45)[::2], charge=True)
    q.fold()
    q.take(q.window(100), charge=True)
    assert q.items == 0 and q.tokens == 0 and not list(q.waiting())
    classes = [c for t in q.tenants.values() for c in t.classes]
    assert all(not c.flows and not c.order and not c.fresh and not c.fresh_items for c in classes)


@pytest.mark.parametrize("seed", range(4))
def test_adding_inputs_together_queues_them_as_adding_them_one_at_a_time(seed: int) -> None:
    # The engine adds a turn's inputs in one call, which looks a tenant and class up once for a run of
    # inputs that share them: the queue must be the one that adding each input alone would build —
    # runs that switch tenant, class or weight midway, and a tenant that comes back later in the call.
    def arrivals() -> list[list[Entry]]:
        rng = random.Random(seed)
        calls = []
        for i in range(60):
            calls.append([
                Entry(rng.randint(4, 64), float(i), tenant=rng.choice(["default", "default", "a", "b"]),
                      weight=rng.choice([1.0, 1.0, 2.0]), priority=rng.choice([1, 1, 0, 2]),
                      payload=(i, k), flow=(i, k) if rng.random() < 0.7 else rng.choice([None, i]))
                for k in range(rng.choice([1, 1, 4, 12]))
            ])
        return calls

    together, alone = FairQueue(WEIGHTS), FairQueue(WEIGHTS)
    for i, (call, same) in enumerate(zip(arrivals(), arrivals(), strict=True)):
        together.add(call)
        for e in same:
            alone.add([e])
        assert (together.items, together.tokens) == (alone.items, alone.tokens)
        assert together.tenant_queued_tokens() == alone.tenant_queued_tokens()
        assert [e.payload for e in together.window(40)] == [e.payload for e in alone.window(40)]
        if i % 5 == 4:
            together.take(together.window(16), charge=True)
            alone.take(alone.window(16), charge=True)
    assert [e.payload for e in together.window(2000)] == [e.payload for e in alone.window(2000)]
