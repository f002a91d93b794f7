"""The scheduler: every batching decision, as a pure object driven by an explicit clock.

It owns the waiting entries of one model and decides, when asked with the current time:

* **admission** — the queue bound (model-wide and per named tenant, one check: :meth:`Scheduler.check_room`),
  the predicted wait against what the queue's regime admits (:mod:`.overload`: a burst into a queue that
  keeps emptying up to ``burst_wait_s``; into a standing queue only what finishes within
  ``max_queue_wait_s``, counting the time the request spent before admission), and requests that
  cannot meet their deadline, refused at once with a retry hint; a request's first input that can no
  longer start when it was promised is dropped when its turn comes (``late``), not computed late;
* **order** — fair queuing over tokens at three levels (:mod:`.fair`): tenants share the model by weight;
  within a tenant the priority classes share it by class weight; within a class each request (flow)
  gets an equal share, and its inputs go in arrival order. Batches are filled across waiting requests,
  so a one-text query joins the next batch even behind thousands of queued inputs of one request, which
  fills the rest of that batch whenever one forward is cheaper than two (:mod:`.policy`);
* **the next batch** — of one kind (the anchor's: pooled and per-token inputs never share a forward), by
  strategy: ``none`` (one input at a time), ``fixed`` (wait up to a window for a batch of fixed size,
  like the peers), ``adaptive`` (dispatch as soon as the model has room; size each
  batch as the largest that keeps its anchor — the input fair order serves first — within the latency
  target, and go for throughput when that target is already lost); shed entries whose deadline has
  passed or cannot be met. Length grouping (:func:`.policy.form_batch`) picks the batch from the first
  ``window_size`` inputs in fair order, always including the anchor, so nothing starves.

**Priorities** (``X-Priority``) are weighted shares, not aging. While classes compete, high, normal and
low share a tenant's tokens r²:r:1 (``priority_ratio`` r, default 4: 16:4:1), and between them the input
that finishes first at its class's weight goes first. So a fresh ``high`` input goes ahead of ``normal``
and ``low`` ones however long those have waited — waiting earns no rank; a lower class goes first only
once it is owed a whole input of its own. None starves: under a sustained ``high`` stream ``normal`` keeps
at least r/(r²+r+1) and ``low`` at least 1/(r²+r+1) of the tenant's tokens (low: 1/21 by default, 1/17
against high alone), and a class with nothing waiting that gets an input starts level with the least
served class, so that input is in one of the next batches even then.

No asyncio, no torch, no wall clock: the batcher drives it on the event loop, and tests drive it with a
virtual clock and a simulated runner.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from .admit import AdmissionConfig, Admitter, Hold, Refusal
from .cost import CostModel
from .fair import DEFAULT_TENANT, IDLE_TENANTS_KEPT, PRIORITIES, Entry, FairQueue
from .overload import ARRIVAL_WINDOW_S
from .policy import Limits, PaddedCost, form_batch, window_size

__all__ = [
    "DEFAULT_TENANT",
    "IDLE_TENANTS_KEPT",
    "PRIORITIES",
    "Dispatch",
    "Entry",
    "Refusal",
    "Scheduler",
    "SchedulerConfig",
    "Step",
    "Strategy",
    "Wait",
]

Strategy = Literal["none", "fixed", "adaptive"]


# Taken inputs kept behind an older one still waiting (the deadline heap, in deadline order) are dropped
# from the record once they outnumber the waiting ones by this much: an input that waits long
# (a bulk request served at its fair share) must not keep every input admitted after it, answered long
# since, and with it each one's request and rows, for as long as it waits.
_COMPACT_SLACK = 1024


def compact_by(waiting: int) -> int:
    """The length past which a record of ``waiting`` inputs still waiting (and taken ones behind them)
    is compacted: twice what waits, and some, so compacting costs O(1) per input added over time."""
    return 2 * waiting + _COMPACT_SLACK


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    strategy: Strategy = "adaptive"
    limits: Limits = field(default_factory=lambda: Limits(64, 16384))
    target_latency_s: float = 0.5
    max_wait_s: float = 0.0  # fixed: the window; adaptive: an optional hold for a fuller batch
    max_queued_tokens: int = 1 << 20
    tenant_max_queued_tokens: int = 1 << 19  # named tenants only; the default tenant has the model bound
    # X-Priority: while classes compete, each gets this many times the tokens of the class below it
    # (high:normal:low = r²:r:1), and a fresh high input goes before lower ones however long they waited.
    # Larger makes priorities stricter under sustained load; low always keeps 1/(r²+r+1) of the tokens
    # (1/21 at 4) and normal r/(r²+r+1). 1 = classes share equally (X-Priority then only breaks ties).
    priority_ratio: float = 4.0
    # A batch of a bulk request (more than INTERACTIVE_INPUTS inputs) is predicted to take at most this
    # long: a forward cannot be interrupted, so a query that arrives mid-batch waits out what remains of
    # it, the first query after a quiet spell included. Shorter keeps queries quick beside ingestion, at
    # some bulk throughput where a forward's fixed cost is large (CPU; on a GPU the batch-size limit
    # binds first); 0 = off (bulk batches as large as the other limits allow).
    interactive_batch_s: float = 0.05
    pipeline_depth: int = 1
    # Batches that run side by side, each its own forward on one core (``--cpu-forwards``); 1 = one forward
    # at a time. A batch is formed when one of them is free and starts at once; predicted waits count the
    # queue draining that many times as fast. pipeline_depth is then this.
    forwards: int = 1
    # Admission by the queue's regime (see overload.py); 0 = off (only the token bounds and deadlines
    # refuse). Under a standing queue a request is admitted only if it is predicted to have its first
    # result within this many seconds of its head arriving (time before admission + queue wait + its
    # forward); the rest is refused at once (429 overloaded, Retry-After), so admitted requests keep
    # their latency and refused ones cost little.
    max_queue_wait_s: float = 0.0
    # While the queue keeps emptying, a burst is admitted as long as its first input is predicted to
    # wait at most this many seconds in the queue (429 queue_full beyond): what it takes to serve a
    # burst well within a request's deadline.
    burst_wait_s: float = 10.0
    # The queue stands once its oldest waiting input has been older than queue_target_s for a whole
    # queue_interval_s (CoDel's target and interval); it is good again as soon as it is not.
    queue_target_s: float = 0.125
    queue_interval_s: float = 0.5

    def admission(self) -> AdmissionConfig:
        """The knobs admission reads (:mod:`.admit`)."""
        return AdmissionConfig(
            self.limits.max_batch_size, self.max_queued_tokens, self.tenant_max_queued_tokens,
            self.max_queue_wait_s, self.burst_wait_s, self.queue_target_s, self.queue_interval_s,
            self.forwards,
        )


INTERACTIVE_INPUTS = 4  # a request of at most this many inputs is a query, not ingestion


@dataclass(frozen=True, slots=True)
class Dispatch:
    batch: list[Entry]
    padded_tokens: int  # what the batch costs the model (its cell's area with graphs); done() takes it back
    predicted_s: float


@dataclass(frozen=True, slots=True)
class Wait:
    until: float  # ask again then (or sooner, when something changes)


class Step(NamedTuple):
    """What :meth:`Scheduler.next` decided, and the entries it took out unrun for the caller to answer."""

    decision: Dispatch | Wait | None  # a batch to run now, a time to ask again, or nothing to do
    expired: list[Entry]  # their deadline passed
    shed: list[Entry]  # they cannot finish by their deadline
    late: list[Entry]  # first inputs the regime would no longer run (answered 429, not computed late)
    retry_after: list[float]  # when each of ``late`` should come back, in seconds


class Scheduler:
    """Admission, fair ordering and batch formation for one model."""

    def __init__(self, config: SchedulerConfig, cost: CostModel, padded_cost: PaddedCost) -> None:
        self.config = config
        self.cost = cost
        # A runner's padded cost is a pure function of (inputs, longest): asked several times per request
        # by admission and per batch by formation, it is looked up (a graph runner walks its grid for it).
        self.padded_cost = padded_cost = functools.lru_cache(maxsize=1 << 14)(padded_cost)
        self.inflight = 0
        # Predicted end of the work already handed to the model (forwards side by side: of all of it, were
        # it shared evenly by them)
        self.busy_until = 0.0
        r = config.priority_ratio
        self._queue = FairQueue((r * r, r, 1.0))
        self._promoted_s = 0.0  # predicted time of batches _query_first moved up since bulk anchored one
        self._deadlines: list[tuple[float, int, Entry]] = []  # heap of entries that have one
        self._seq = itertools.count()
        self.admission = Admitter(
            config.admission(), self._queue, cost, padded_cost, lambda now: max(0.0, self.busy_until - now)
        )
        self.regime = self.admission.regime
        self.regime.queued = lambda: self._queue.items
        self.regime.listener = self._tier

    @property
    def queued_tokens(self) -> int:
        return self._queue.tokens

    @property
    def queued_items(self) -> int:
        return self._queue.items

    @property
    def can_dispatch(self) -> bool:
        """Whether :meth:`next` could dispatch a batch now: work waits and a forward is free. While not,
        a step finds nothing to run; what it would drop (a deadline passed, a late input) is dropped at
        the step that follows the running batch's end, which runs in any case."""
        return self._queue.items > 0 and self.inflight < self.config.pipeline_depth

    # -- admission (admit.py) ------------------------------------------------------------------------
    def check_room(self, tenant: str, tokens: int, now: float) -> Refusal | None:
        """None if ``tokens`` more tokens of ``tenant`` fit the queue bounds now; else why not."""
        return self.admission.check_room(tenant, tokens, now)

    def admit(
        self,
        tokens: Iterable[int],
        tenant: str,
        deadline: float | None,
        now: float,
        *,
        weight: float = 1.0,
        priority: int = 1,
        arrived: float | None = None,
        held: Hold | None = None,
    ) -> Refusal | None:
        """None if a request of these inputs may queue now; else why not (:meth:`Admitter.admit`)."""
        return self.admission.admit(tokens, tenant, deadline, now, weight=weight, priority=priority,
                                    arrived=arrived, held=held)

    def admits_all(
        self, total: int, inputs: int, shortest: int, longest: int, widest: int, arrived: float,
        deadline: float | None, tenants: dict[str, int], now: float,
    ) -> bool:
        """Whether every request of a message so summarised is admitted (:meth:`Admitter.admits_all`)."""
        return self.admission.admits_all(total, inputs, shortest, longest, widest, arrived, deadline, tenants,
                                         now)

    def admitted(self, tokens: Sequence[int], now: float, holds: Sequence[Hold] = (),
                 held_tokens: int = 0) -> None:
        """A message's requests admitted on :meth:`admits_all`'s word, tokens by class, and the holds
        some took with their tokens (:meth:`Admitter.admitted`)."""
        self.admission.admitted(tokens, now, holds, held_tokens)

    def precheck(
        self, first: int, total: int, inputs: int, tenant: str, weight: float, priority: int,
        arrived: float, now: float, *, hold: bool = True,
    ) -> Refusal | Hold:
        """Before tokenising, on estimated counts (:meth:`Admitter.precheck`)."""
        return self.admission.precheck(first, total, inputs, tenant, weight, priority, arrived, now,
                                       hold=hold)

    def drain_s(self, now: float) -> float:
        """Predicted seconds until everything already admitted has run."""
        return self.admission.drain_s(now)

    def waits(self, now: float) -> list[float]:
        """Predicted seconds before the first input of a new one-token request of the default tenant
        would start, by priority class: what a gateway checks its requests against before tokenising."""
        queue, wait_s = self._queue, self.admission.wait_s
        aheads = [queue.tokens_ahead(DEFAULT_TENANT, 1.0, p, 1) for p in range(3)]
        return [wait_s(ahead, now) if ahead else 0.0 for ahead in aheads]  # nothing ahead: no backlog

    def add(self, entries: Iterable[Entry], inputs: int | None = None) -> None:
        """Queue admitted entries (one request's inputs, in order; they share its ``flow``). ``inputs``
        is the request's size when some of its inputs are not queued (cached, or shared with another)."""
        entries = list(entries)
        self.add_many([(entries, len(entries) if inputs is None else inputs)])

    def add_many(self, requests: Sequence[tuple[list[Entry], int]]) -> None:
        """Queue the admitted entries of several requests at once, in order: each request's entries
        and its size, as :meth:`add` takes them. The same queue as adding them one by one."""
        strict_until = self.regime.recent_until(self.regime.STRICT)  # (Regime.recent, once for all)
        every: list[Entry] = []
        for entries, inputs in requests:
            if not entries:
                continue
            if inputs > INTERACTIVE_INPUTS:
                for e in entries:
                    e.bulk = True
            lead = entries[0]
            lead.lead = True
            lead.strict = lead.arrival < strict_until
            every += entries
        self._queue.add(every)
        waiting = self._queue.items
        self.regime.add(every)
        deadlines, seq = self._deadlines, self._seq
        for e in every:
            if e.deadline is not None:
                heapq.heappush(deadlines, (e.deadline, next(seq), e))
        if len(deadlines) > compact_by(waiting):
            # Taken entries leave the heap lazily, once at its top: behind an early deadline still
            # waiting they would pile up (and keep their requests and rows) for as long as it waits.
            self._deadlines = [d for d in deadlines if not d[2].taken and d[2].deadline == d[0]]
            heapq.heapify(self._deadlines)

    # -- dispatch ------------------------------------------------------------------------------------
    @property
    def standing(self) -> bool:
        """Whether the queue stands (see :mod:`.overload`), as of the last admission or dispatch."""
        return self.regime.standing

    def next(self, now: float) -> Step:
        """What to do now. Expired entries passed their deadline; shed ones cannot meet it; late ones
        are first inputs that cannot start when admission promised (they would run late).

        None of them is in any batch; the caller answers them. The decision is a batch to run now, a
        time to ask again, or None (nothing to do until an entry arrives or a batch finishes).
        """
        expired, shed = self._drop_hopeless(now)
        step = self._next(now, expired, shed)
        if (self.regime.observe(now) and step.decision is None and self._queue.items == 0
                and self.inflight == 0):
            # A confirmed overload stands through a moment with nothing waiting (overload.Regime); with
            # nothing to admit or run, nothing would observe it again: ask again once the arrivals
            # window has passed, so that it ends (gauge and all) when the arrivals stop.
            step = step._replace(decision=Wait(now + ARRIVAL_WINDOW_S))
        return step

    def _next(self, now: float, expired: list[Entry], shed: list[Entry]) -> Step:
        if not self.can_dispatch:
            return Step(None, expired, shed, [], [])
        cfg = self.config
        # (Side by side, a batch is formed only when a forward is free, and starts at once.)
        start = max(now, self.busy_until) if cfg.forwards == 1 else now
        split = self._queue.split
        window = self._queue.window(window_size(cfg.limits))
        late: list[Entry] = []
        retry: list[float] = []
        while True:
            dropped = self.admission.late(window, start, now)  # (observes the regime)
            if self._queue.split != split:  # the regime changed, and with it the queue's order (_tier)
                split = self._queue.split
                window = self._queue.window(window_size(cfg.limits))
                continue
            if not dropped:
                break
            self._queue.take(dropped, charge=False)
            late += dropped
            retry += self.admission.late_retry(now, dropped)
            if self._queue.items == 0:
                return Step(None, expired, shed, late, retry)
            window = self._queue.window(window_size(cfg.limits))
        # The batch is of the anchor's kind; the others wait for a batch of their own.
        kind = window[0].kind
        window = [e for e in window if e.kind == kind]
        promoted = False  # a query moved up ahead of the bulk input fair order serves next
        if cfg.strategy == "none":
            picked = [0]
        elif cfg.strategy == "fixed":
            picked = self._fifo_prefix(window)
            full = len(picked) >= cfg.limits.max_batch_size or len(picked) < len(window)
            oldest = min(e.arrival for e in window)
            if not (full or now >= oldest + cfg.max_wait_s):
                return Step(Wait(oldest + cfg.max_wait_s), expired, shed, late, retry)
        else:
            if cfg.interactive_batch_s > 0 and window[0].bulk:
                window, promoted = self._query_first(window)
            # The batch is sized for its anchor, the input fair order serves first: inputs of a bulk
            # request that lost the target long ago must not make a fresh query's batch a long one.
            budget = cfg.target_latency_s - (start - window[0].arrival)
            limit = budget
            if self.admission.on and self.regime.standing:
                # Admission keeps a standing queue to what has its first result within the bound with a
                # batch of half of it (Admitter.batch_s): batches that long are the throughput the
                # overload needs — no shorter, whatever an anchor has left, and no longer, whatever it
                # has left (a fresh query anchoring a batch as long as the whole target made every
                # input admitted behind it wait that long, past what admission promised them).
                limit = self.admission.batch_limit_s
            if cfg.interactive_batch_s > 0:
                alone = self.cost.predict(self.padded_cost(1, window[0].n_tokens))
                if window[0].bulk:  # ingestion: a short batch, so a query arriving meanwhile waits little
                    limit = max(cfg.interactive_batch_s, alone)
                elif any(e.bulk for e in window):
                    # A query may carry ingestion's inputs only while that costs it at most twice its
                    # own forward: on a launch-bound device a full batch, on a CPU hardly any.
                    limit = 2 * alone
                # (A limit the anchor alone fits, never the latency budget: a budget nearly spent would
                # let form_batch drop the limit and run the longest batch of all.)
            picked = form_batch(
                [e.n_tokens for e in window],
                0,
                cfg.limits,
                self.padded_cost,
                self.cost.predict,
                max_seconds=limit,
            )
            hold = self._hold_until(window, picked, now, budget)
            if hold is not None:
                return Step(Wait(hold), expired, shed, late, retry)
        batch = [window[i] for i in picked]
        padded = self.padded_cost(len(batch), max(e.n_tokens for e in batch))
        predicted = self.cost.predict(padded)
        if split and len(batch) > 1 and window[0].fresh and self.admission.on:
            # Split (the queue stands, not yet confirmed an overload), a batch anchored by what joined
            # since leaves out the backlog's inputs that it would finish past the bound. Length grouping
            # took them beside the anchor, ahead of fresh inputs of other lengths: on the VM most of a
            # soak's 2x phase's slowest requests were such inputs, admitted as a burst just before the
            # queue stood and served, past the bound, just before it was confirmed (when they would
            # have been dropped late). They wait on: dropped late once the overload is confirmed,
            # served once no fresh input waits, or in order once a burst stops arriving.
            kept = self._fresh_and_within_bound(batch, start + predicted)
            if len(kept) < len(batch):
                batch = kept
                padded = self.padded_cost(len(batch), max(e.n_tokens for e in batch))
                predicted = self.cost.predict(padded)
        if promoted:
            self._promoted_s += predicted
        elif batch[0].bulk:
            self._promoted_s = 0.0
        self._queue.take(batch, charge=True)
        self.admission.dispatched(sum(e.n_tokens for e in batch), padded)
        self.inflight += 1
        self.busy_until = max(now, self.busy_until) + predicted / cfg.forwards  # (one forward: start + it)
        return Step(Dispatch(batch, padded, predicted), expired, shed, late, retry)

    def _fresh_and_within_bound(self, batch: list[Entry], finish: float) -> list[Entry]:
        """Of a split queue's batch anchored by a fresh input and finishing at ``finish``, the fresh
        inputs and the backlog's that it finishes within the bound (see :meth:`_next`)."""
        since = finish - self.admission.config.max_queue_wait_s  # (arrived before it: past the bound)
        return [e for e in batch if e.fresh or e.arrival >= since]

    def _tier(self) -> None:
        """The regime changed (:meth:`.overload.Regime.observe` calls this): while the queue stands and
        is not yet confirmed an overload, what joins it goes before what waits, which was admitted as a
        burst (:meth:`.fair.FairQueue.split_off`); otherwise one fair order. From the moment its head
        grows old with no overload in memory until one is confirmed, its one-input requests go newest
        first (:attr:`.fair.FairQueue.newest_first`)."""
        regime = self.regime
        if self.admission.on and regime.standing and not regime.overload:
            self._queue.split_off()
        else:
            self._queue.fold()
        self._queue.newest_first = self.admission.on and regime.onset

    def _query_first(self, window: list[Entry]) -> tuple[list[Entry], bool]:
        """``window`` (anchored by a bulk input) with the first query of the anchor's tenant and class
        moved to the front, and whether one was.

        A bulk batch is a run of similar lengths around its anchor, which a short query is seldom in, and
        fair order puts a fresh query beside the bulk input that goes next, sometimes just behind it: it
        would wait out one more bulk batch. Moving it up reorders one window of one class, so fairness
        moves by at most that; and only while the batches so moved up since the bulk request last
        anchored one are predicted to take less than ``interactive_batch_s``, so under a flood of queries
        ingestion still anchors a batch at least that often."""
        if self._promoted_s >= self.config.interactive_batch_s:
            return window, False
        anchor = window[0]
        for i, e in enumerate(window):
            if not e.bulk and e.tenant == anchor.tenant and e.priority == anchor.priority:
                return [e, *window[:i], *window[i + 1 :]], True
        return window, False

    def done(self, padded_tokens: int, seconds: float | None, now: float, threads: int = 0) -> None:
        """A dispatched batch finished (``seconds`` None if it failed), its CPU forward on ``threads``
        where the engine sets them (its cost model's setting: :meth:`.cost.CostModel.use`)."""
        self.inflight -= 1
        self.admission.drained(seconds, now, self._queue.items > 0)
        if seconds is not None:
            self.cost.observe(padded_tokens, seconds, threads or None)
        if self.inflight == 0:
            self.busy_until = now

    def extend_deadline(self, e: Entry, deadline: float | None) -> None:
        """Give a waiting entry a later deadline, or none (another request now waits for it too). An
        entry not queued yet (of the same message) is queued with it."""
        e.deadline = deadline
        if deadline is not None and e.queued:
            heapq.heappush(self._deadlines, (deadline, next(self._seq), e))

    def remove(self, should_drop: Callable[[Entry], bool]) -> list[Entry]:
        """Take out waiting entries the caller no longer wants (their caller left)."""
        dropped = [e for e in self._queue.waiting() if should_drop(e)]
        self._queue.take(dropped, charge=False)
        return dropped

    def drain_all(self) -> list[Entry]:
        """Take out everything still waiting (shutdown)."""
        left = list(self._queue.waiting())
        self._queue.take(left, charge=False)
        return left

    def tenant_queued_tokens(self) -> dict[str, int]:
        """Tokens waiting per tenant that has any."""
        return self._queue.tenant_queued_tokens()

    # -- internals -----------------------------------------------------------------------------------
    def _drop_hopeless(self, now: float) -> tuple[list[Entry], list[Entry]]:
        """Entries whose deadline passed (expired) or that could not finish by it even alone (shed)."""
        expired: list[Entry] = []
        shed: list[Entry] = []
        heap = self._deadlines
        coef = self.cost.coef
        while heap:
            deadline, _, e = heap[0]
            if e.taken or e.deadline != deadline:  # gone, or its deadline was extended since
                heapq.heappop(heap)
            elif deadline <= now:
                expired.append(heapq.heappop(heap)[2])
            elif now + coef.overhead_s + coef.per_token_s * e.n_tokens > deadline:
                shed.append(heapq.heappop(heap)[2])
            else:
                break
        if expired or shed:
            self._queue.take(expired + shed, charge=False)
        return expired, shed

    def _fifo_prefix(self, window: list[Entry]) -> list[int]:
        limits = self.config.limits
        picked: list[int] = []
        longest = 0
        for i, e in enumerate(window):
            longest_if = max(longest, e.n_tokens)
            if picked and (
                len(picked) + 1 > limits.max_batch_size
                or self.padded_cost(len(picked) + 1, longest_if) > limits.max_batch_tokens
            ):
                break
            picked.append(i)
            longest = longest_if
        return picked

    def _hold_until(self, window: list[Entry], picked: list[int], now: float, budget: float) -> float | None:
        """Adaptive cost-saving mode: hold a small batch briefly when a fuller one is due soon."""
        cfg = self.config
        if cfg.max_wait_s <= 0 or self.inflight > 0 or len(picked) >= cfg.limits.max_batch_size:
            return None
        if len(picked) < len(window):
            return None  # more is already waiting than fits: waiting cannot help
        oldest = min(e.arrival for e in window)
        hold = oldest + cfg.max_wait_s
        if hold <= now:
            return None
        longest = max(window[i].n_tokens for i in picked)
        # Holding must still leave the anchor within target with the batch it then runs.
        after = (hold - now) + self.cost.predict(self.padded_cost(cfg.limits.max_batch_size, longest))
        return hold if after <= budget else None
