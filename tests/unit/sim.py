"""A discrete-event simulation of one model: Poisson arrivals, the scheduler, and a simulated runner
whose batch time is ``a + b × padded tokens`` with noise. Virtual clock: runs in milliseconds of CPU.

An arrival is one request: ``inputs`` inputs of ``tokens`` tokens each, sharing its ``flow`` (None: the
tenant's shared flow, as for a caller that sets none; the batcher sets one per request)."""

from __future__ import annotations

import heapq
import random
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from coalesce.service.batching.cost import CostModel
from coalesce.service.batching.scheduler import Dispatch, Entry, Scheduler, SchedulerConfig, Wait


@dataclass(frozen=True)
class Arrival:
    time: float
    tokens: int
    tenant: str = "default"
    weight: float = 1.0
    priority: int = 1
    timeout: float | None = None
    flow: Hashable = None
    inputs: int = 1
    retries: int = 0  # a refused (or late) one comes back after its Retry-After this many times
    arrived: float | None = None  # when its head arrived, if before ``time`` (when admission decides)


@dataclass(frozen=True)
class Batch:
    start: float
    end: float
    entries: list[Entry]

    def flows(self) -> set[Hashable]:
        return {e.flow for e in self.entries}


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    by_tenant: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    by_priority: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    served_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    finished: dict[Hashable, float] = field(default_factory=dict)  # flow -> when its last input completed
    batches: list[Batch] = field(default_factory=list)
    completed: int = 0
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    expired: int = 0
    shed: int = 0
    late_tokens: list[int] = field(default_factory=list)  # each first input dropped at dequeue, its tokens
    late_arrivals: list[float] = field(default_factory=list)  # and when its request arrived
    retried: int = 0  # refusals (and late drops) that came back after their Retry-After
    failed: list[Arrival] = field(default_factory=list)  # refused or late with no retry left
    standing: list[tuple[float, bool]] = field(default_factory=list)  # (time, regime) at each change
    late_dispatches: int = 0  # entries dispatched after their deadline (must stay 0)
    batch_sizes: list[int] = field(default_factory=list)
    max_queued_tokens: int = 0
    end: float = 0.0
    waiting_at_end: int = 0

    @property
    def late(self) -> int:
        """First inputs dropped at dequeue: the regime would no longer run them."""
        return len(self.late_tokens)

    def late_since(self, t: float) -> int:
        """First inputs dropped at dequeue whose requests arrived at ``t`` or after."""
        return sum(1 for at in self.late_arrivals if at >= t)

    def pct(self, q: float, values: list[float] | None = None) -> float:
        vals = sorted(self.latencies if values is None else values)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else 0.0

    def throughput(self, window: tuple[float, float]) -> float:
        return self.completed / (window[1] - window[0])


def poisson(
    rate: float, duration: float, rng: random.Random, start: float = 0.0, **kw: object
) -> list[Arrival]:
    out, t = [], start
    tokens = kw.pop("tokens", 16)
    while True:
        t += rng.expovariate(rate)
        if t >= start + duration:
            return out
        n = tokens(rng) if callable(tokens) else tokens
        out.append(Arrival(t, int(n), **kw))  # type: ignore[arg-type]


def eager_cost(n: int, longest: int) -> int:
    return n * longest


def simulate(
    config: SchedulerConfig,
    arrivals: list[Arrival],
    a: float,
    b: float,
    noise: float = 0.05,
    seed: int = 0,
    horizon: float | None = None,
    measure_from: float = 0.0,
    stall: float = 1.0,
    slowdown: float = 1.0,
    spikes: tuple[float, float] = (0.0, 1.0),
    spell: int = 1,
) -> Result:
    """Run ``arrivals`` through a scheduler of ``config`` against a model whose forward of ``padded``
    tokens takes ``a + b·padded`` s (±``noise``). ``stall``: each batch holds the model ``stall`` times as
    long as its forward, which is all the cost model is told (the rest is what the process and the
    machine do between forwards: tokenising, answering, other programs on the cores). ``slowdown``: every
    forward takes that many times what the warm-up measured (other programs on the cores slow the forward
    itself; the cost model is told, but was seeded fast). ``spikes``: (share, factor): that share of
    forwards, at random, take ``factor`` times as long (a forward whose thread other programs on the
    cores preempt: the cost model is told, but a mean cannot say which batch it will be). ``spell``: they
    come in spells of that many in a row, as often as keeps their share: what takes the cores from the
    forward (a flood being refused, another program) lasts longer than one batch."""
    rng = random.Random(seed)
    sched = Scheduler(config, CostModel(), eager_cost)
    # Seed the cost model as the server's warm-up does; a server slowed down after running a while at
    # full speed has a whole window of fast batches behind it.
    seeds = [(1, 16), (8, 64)] if slowdown == 1.0 else [(1 + i % 64, 16 + i % 48) for i in range(128)]
    for n, length in seeds:
        sched.cost.observe(n * length, a + b * n * length)
    res = Result()
    slow_left = 0  # slow forwards still to come in the spell under way
    # A spell starts at a batch with this chance (outside spells), so that spells of ``spell`` batches are
    # ``spikes[0]`` of all batches: spell·q / (spell·q + 1 − q) = share.
    starts = spikes[0] / (spell * (1 - spikes[0]) + spikes[0]) if spikes[0] else 0.0
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    def come_back(arr: Arrival, now: float, after: float) -> None:
        if arr.retries > 0:
            res.retried += 1
            push(now + after, "arrive", replace(arr, time=now + after, retries=arr.retries - 1, arrived=None))
        else:
            res.failed.append(arr)

    for arr in arrivals:
        push(arr.time, "arrive", arr)
    wake_at: float | None = None
    now = 0.0
    while events:
        now, _, kind, data = heapq.heappop(events)
        if horizon is not None and now > horizon:
            break
        if kind == "arrive":
            arr: Arrival = data  # type: ignore[assignment]
            deadline = None if arr.timeout is None else now + arr.timeout
            head = now if arr.arrived is None else arr.arrived
            refusal = sched.admit([arr.tokens] * arr.inputs, arr.tenant, deadline, now, weight=arr.weight,
                                  priority=arr.priority, arrived=head)
            if refusal is not None:
                res.refused[refusal.reason] += 1
                come_back(arr, now, refusal.retry_after)
            else:
                entry = (arr.tokens, head, arr.tenant, arr.weight, arr.priority, deadline, arr)
                sched.add([Entry(*entry, flow=arr.flow) for _ in range(arr.inputs)])
            res.max_queued_tokens = max(res.max_queued_tokens, sched.queued_tokens)
        elif kind == "done":
            batch, padded, seconds = data  # type: ignore[misc]
            sched.done(padded, seconds, now)
            res.batches.append(Batch(now - seconds * stall, now, batch))
            for e in batch:
                res.finished[e.flow] = now
                if now >= measure_from:  # throughput: what completes inside the measured window
                    res.completed += 1
                    res.served_tokens[e.tenant] += e.n_tokens
                if e.arrival >= measure_from:  # latency: what arrived inside it
                    lat = now - e.arrival
                    res.latencies.append(lat)
                    res.by_tenant[e.tenant].append(lat)
                    res.by_priority[e.priority].append(lat)
        elif kind == "wake":
            if wake_at != now:
                continue
            wake_at = None
        while True:
            decision, expired, shed, late, retry_after = sched.next(now)
            res.expired += len(expired)
            res.shed += len(shed)
            res.late_tokens += [e.n_tokens for e in late]
            res.late_arrivals += [e.arrival for e in late]
            for e, after in zip(late, retry_after, strict=True):
                come_back(e.payload, now, after)
            if not res.standing or res.standing[-1][1] != sched.standing:
                res.standing.append((now, sched.standing))
            if isinstance(decision, Dispatch):
                batch = decision.batch
                res.late_dispatches += sum(1 for e in batch if e.deadline is not None and e.deadline <= now)
                padded = decision.padded_tokens
                seconds = (a + b * padded) * (1 + rng.uniform(-noise, noise)) * slowdown
                if slow_left:
                    slow_left -= 1
                    seconds *= spikes[1]
                elif starts and rng.random() < starts:  # (no draw without: other runs' noise unchanged)
                    slow_left = spell - 1
                    seconds *= spikes[1]
                res.batch_sizes.append(len(batch))
                push(now + seconds * stall, "done", (batch, padded, seconds))
                continue
            if isinstance(decision, Wait) and (wake_at is None or decision.until < wake_at):
                wake_at = decision.until
                push(decision.until, "wake", None)
            break
    res.end = now
    res.waiting_at_end = sched.queued_items
    return res
