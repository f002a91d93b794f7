"""The scheduler: every batching decision, as a pure object driven by an explicit clock.

It owns the waiting entries of one model and decides, when asked with the current time:

* **admission** — the queue bound (model-wide and per tenant) and requests that cannot meet their
  deadline, refused at once with a retry hint;
* **order** — tenants share the model by weight (start-time fair queuing over tokens: the tenant that
  has received the least service per unit of weight goes next); within a tenant, priority classes go
  high → normal → low, and a waiting entry gains one class per ``priority_aging_s`` so none starves;
* **the next batch** — of one kind (the most urgent entry's: pooled and per-token inputs never share
  a forward), by strategy: ``none`` (one input at a time), ``fixed`` (wait up to a window for a batch
  of fixed size, like the peers), ``adaptive`` (dispatch as soon as the model has room; size each
  batch as the largest that keeps the oldest waiting entry within the latency target, and go for
  throughput when the target is already lost); shed entries whose deadline has passed or cannot be met.

No asyncio, no torch, no wall clock: the batcher drives it on the event loop, and tests drive it with a
virtual clock and a simulated runner.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from .cost import CostModel
from .policy import Limits, PaddedCost, form_batch, window_size

Strategy = Literal["none", "fixed", "adaptive"]
PRIORITIES = {"high": 0, "normal": 1, "low": 2}
DEFAULT_TENANT = "default"
IDLE_TENANTS_KEPT = 1024  # tenants remembered before idle ones are forgotten


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    strategy: Strategy = "adaptive"
    limits: Limits = field(default_factory=lambda: Limits(64, 16384))
    target_latency_s: float = 0.5
    max_wait_s: float = 0.0  # fixed: the window; adaptive: an optional hold for a fuller batch
    max_queued_tokens: int = 1 << 20
    tenant_max_queued_tokens: int = 1 << 19  # named tenants only; the default tenant has the model bound
    priority_aging_s: float = 1.0
    pipeline_depth: int = 1


@dataclass(slots=True, eq=False)
class Entry:
    """One input waiting for a batch. ``payload`` is the batcher's (its future); never read here."""

    n_tokens: int
    arrival: float
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    priority: int = 1
    deadline: float | None = None
    payload: Any = None
    flow: Any = None  # the request it belongs to
    kind: object = None  # what the runner returns for it: entries of different kinds never share a batch
    taken: bool = field(default=False, repr=False)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an admission was refused: ``reason`` is a metric label; ``retry_after`` is in seconds."""

    reason: Literal["queue_full", "tenant_queue_full", "deadline_unmeetable", "too_large"]
    message: str
    retry_after: float


@dataclass(frozen=True, slots=True)
class Dispatch:
    batch: list[Entry]
    padded_tokens: int  # what the batch costs the model (its cell's area with graphs); done() takes it back
    predicted_s: float


@dataclass(frozen=True, slots=True)
class Wait:
    until: float  # ask again then (or sooner, when something changes)


@dataclass(slots=True)
class _Tenant:
    weight: float = 1.0
    vtime: float = 0.0  # service received / weight, in tokens
    queued_tokens: int = 0
    items: int = 0  # waiting entries (taken ones may still sit in the deques until compacted)
    classes: tuple[deque[Entry], deque[Entry], deque[Entry]] = field(
        default_factory=lambda: (deque(), deque(), deque())
    )


class Scheduler:
    """Admission, fair ordering and batch formation for one model."""

    def __init__(self, config: SchedulerConfig, cost: CostModel, padded_cost: PaddedCost) -> None:
        self.config = config
        self.cost = cost
        self.padded_cost = padded_cost
        self.queued_tokens = 0
        self.queued_items = 0
        self.inflight = 0
        self.busy_until = 0.0  # predicted end of the work already handed to the model
        self._tenants: dict[str, _Tenant] = {}
        self._deadlines: list[tuple[float, int, Entry]] = []  # heap of entries that have one
        self._seq = itertools.count()

    # -- admission -----------------------------------------------------------------------------------
    def check_room(self, tenant: str, tokens: int, now: float) -> Refusal | None:
        """None if ``tokens`` more tokens of ``tenant`` fit the queue bounds now; else why not."""
        cfg = self.config
        if self.queued_tokens + tokens > cfg.max_queued_tokens:
            return Refusal(
                "queue_full",
                f"{self.queued_tokens} tokens are waiting (bound {cfg.max_queued_tokens}); retry later.",
                self.drain_s(now),
            )
        t = self._tenants.get(tenant)
        held = t.queued_tokens if t is not None else 0
        if tenant != DEFAULT_TENANT and held + tokens > cfg.tenant_max_queued_tokens:
            return Refusal(
                "tenant_queue_full",
                f"Tenant '{tenant}' has {held} tokens waiting (bound "
                f"{cfg.tenant_max_queued_tokens}); retry later.",
                self.drain_s(now),
            )
        return None

    def admit(self, tokens: Iterable[int], tenant: str, deadline: float | None, now: float) -> Refusal | None:
        """None if a request of these inputs may queue now; else why not."""
        lengths = list(tokens)
        total = sum(lengths)
        cfg = self.config
        if total > cfg.max_queued_tokens:
            return Refusal(
                "too_large",
                f"The request holds {total} tokens, more than this model ever queues "
                f"({cfg.max_queued_tokens}); split it.",
                0.0,
            )
        refusal = self.check_room(tenant, total, now)
        if refusal is not None:
            return refusal
        if deadline is not None:
            longest = max(lengths)
            finish = now + self.drain_s(now) + self.cost.predict(self.padded_cost(len(lengths), longest))
            if finish > deadline:
                return Refusal(
                    "deadline_unmeetable",
                    f"The queue ahead needs about {finish - now:.3f} s, past this request's deadline.",
                    self.drain_s(now),
                )
        return None

    def drain_s(self, now: float) -> float:
        """Predicted seconds until everything already admitted has run."""
        coef = self.cost.coef
        batches = math.ceil(self.queued_items / self.config.limits.max_batch_size)
        return (
            max(0.0, self.busy_until - now)
            + batches * coef.overhead_s
            + self.queued_tokens * coef.per_token_s
        )

    def add(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            t = self._tenants.get(e.tenant)
            if t is None or t.items == 0:
                # A tenant (re)joining starts level with the least-served active tenant: idle time earns
                # no credit to burst with later.
                floor = min((x.vtime for x in self._tenants.values() if x.queued_tokens), default=0.0)
                if t is None:
                    if len(self._tenants) >= IDLE_TENANTS_KEPT:
                        self._forget_idle_tenants()
                    t = self._tenants[e.tenant] = _Tenant()
                t.vtime = max(t.vtime, floor)
            t.weight = e.weight
            t.classes[min(max(e.priority, 0), 2)].append(e)
            t.items += 1
            t.queued_tokens += e.n_tokens
            if e.deadline is not None:
                heapq.heappush(self._deadlines, (e.deadline, next(self._seq), e))
            self.queued_tokens += e.n_tokens
            self.queued_items += 1

    # -- dispatch ------------------------------------------------------------------------------------
    def next(self, now: float) -> tuple[Dispatch | Wait | None, list[Entry], list[Entry]]:
        """(decision, expired, shed). Expired entries passed their deadline; shed ones cannot meet it.

        Neither is in any batch; the caller answers them. The decision is a batch to run now, a time to
        ask again, or None (nothing to do until an entry arrives or a batch finishes).
        """
        expired, shed = self._drop_hopeless(now)
        if self.queued_items == 0 or self.inflight >= self.config.pipeline_depth:
            return None, expired, shed
        window = self._fair_window(now)
        if not window:
            return None, expired, shed
        # The batch is of the most urgent entry's kind; the others wait for a batch of their own.
        kind = window[0].kind
        window = [e for e in window if e.kind == kind]
        cfg = self.config
        start = max(now, self.busy_until)
        if cfg.strategy == "none":
            picked = [0]
        elif cfg.strategy == "fixed":
            picked = self._fifo_prefix(window)
            full = len(picked) >= cfg.limits.max_batch_size or len(picked) < len(window)
            ripe = now >= min(e.arrival for e in window) + cfg.max_wait_s
            if not (full or ripe):
                return Wait(min(e.arrival for e in window) + cfg.max_wait_s), expired, shed
        else:
            oldest = min(e.arrival for e in window)
            budget = cfg.target_latency_s - (start - oldest)
            picked = form_batch(
                [e.n_tokens for e in window],
                0,
                cfg.limits,
                self.padded_cost,
                self.cost.predict,
                max_seconds=budget,
            )
            hold = self._hold_until(window, picked, now, budget)
            if hold is not None:
                return Wait(hold), expired, shed
        batch = [window[i] for i in picked]
        padded = self.padded_cost(len(batch), max(e.n_tokens for e in batch))
        predicted = self.cost.predict(padded)
        self._take(batch)
        self.inflight += 1
        self.busy_until = start + predicted
        return Dispatch(batch, padded, predicted), expired, shed

    def done(self, padded_tokens: int, seconds: float | None, now: float) -> None:
        """A dispatched batch finished (``seconds`` None if it failed)."""
        self.inflight -= 1
        if seconds is not None:
            self.cost.observe(padded_tokens, seconds)
        if self.inflight == 0:
            self.busy_until = now

    def extend_deadline(self, e: Entry, deadline: float | None) -> None:
        """Give a waiting entry a later deadline, or none (another request now waits for it too)."""
        e.deadline = deadline
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._seq), e))

    def remove(self, should_drop: Callable[[Entry], bool]) -> list[Entry]:
        """Take out waiting entries the caller no longer wants (their caller left)."""
        dropped = [e for e in self._waiting() if should_drop(e)]
        self._take(dropped, charge=False)
        return dropped

    def drain_all(self) -> list[Entry]:
        """Take out everything still waiting (shutdown)."""
        left = list(self._waiting())
        self._take(left, charge=False)
        return left

    def tenant_queued_tokens(self) -> dict[str, int]:
        """Tokens waiting per tenant that has any."""
        return {name: t.queued_tokens for name, t in self._tenants.items() if t.queued_tokens}

    def _forget_idle_tenants(self) -> None:
        # Tenant names come from clients (X-Tenant): keep memory bounded. An idle tenant that returns
        # starts level with the active ones, which is what it would get anyway unless it had been
        # served ahead of them just before going idle.
        for name in [name for name, t in self._tenants.items() if t.items == 0]:
            del self._tenants[name]

    # -- internals -----------------------------------------------------------------------------------
    def _waiting(self) -> Iterable[Entry]:
        for t in self._tenants.values():
            for q in t.classes:
                for e in q:
                    if not e.taken:
                        yield e

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
            self._take(expired + shed, charge=False)
        return expired, shed

    def _head(self, t: _Tenant, now: float, skip: dict[int, int]) -> tuple[int, Entry] | None:
        """The tenant's next entry by aged priority, ignoring the first ``skip[cls]`` of each class."""
        best: tuple[float, int, Entry] | None = None
        for cls, q in enumerate(t.classes):
            i = skip.get(cls, 0)
            while i < len(q) and q[i].taken:
                i += 1
            skip[cls] = i
            if i < len(q):
                e = q[i]
                key = cls - (now - e.arrival) / max(self.config.priority_aging_s, 1e-9)
                if best is None or (key, e.arrival) < (best[0], best[2].arrival):
                    best = (key, cls, e)
        return None if best is None else (best[1], best[2])

    def _fair_window(self, now: float) -> list[Entry]:
        """Waiting entries in the order fair sharing would serve them, up to the policy's window."""
        want = window_size(self.config.limits)
        active = [(name, t) for name, t in self._tenants.items() if t.queued_tokens > 0]
        if len(active) == 1:
            queues = [q for q in active[0][1].classes if q]
            if len(queues) == 1:  # the common case: one tenant, one priority class, arrival order
                return list(itertools.islice((e for e in queues[0] if not e.taken), want))
        vtime = {name: t.vtime for name, t in active}
        cursors: dict[str, dict[int, int]] = {name: {} for name, _ in active}
        heads = {name: self._head(t, now, cursors[name]) for name, t in active}
        window: list[Entry] = []
        while len(window) < want:
            live = [(vtime[n], h[1].arrival, n) for n, h in heads.items() if h is not None]
            if not live:
                break
            _, _, name = min(live)
            cls, entry = heads[name]  # type: ignore[misc]
            window.append(entry)
            t = self._tenants[name]
            vtime[name] += entry.n_tokens / t.weight
            cursors[name][cls] += 1
            heads[name] = self._head(t, now, cursors[name])
        return window

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
        # Holding must still leave the oldest within target with the batch it then runs.
        after = (hold - now) + self.cost.predict(self.padded_cost(cfg.limits.max_batch_size, longest))
        return hold if after <= budget else None

    def _take(self, entries: Iterable[Entry], charge: bool = True) -> None:
        touched: set[str] = set()
        for e in entries:
            if e.taken:
                continue
            e.taken = True
            t = self._tenants[e.tenant]
            t.items -= 1
            t.queued_tokens -= e.n_tokens
            if charge:
                t.vtime += e.n_tokens / t.weight
            self.queued_tokens -= e.n_tokens
            self.queued_items -= 1
            touched.add(e.tenant)
        for name in touched:
            t = self._tenants[name]
            for q in t.classes:
                while q and q[0].taken:
                    q.popleft()
            # Entries taken from the middle of a queue stay until they reach its head; rebuild the
            # queues when those make up most of them, so memory stays proportional to what waits.
            if sum(len(q) for q in t.classes) > 2 * t.items + 64:
                for q in t.classes:
                    keep = [e for e in q if not e.taken]
                    q.clear()
                    q.extend(keep)
