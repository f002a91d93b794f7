"""The fair order of waiting inputs: which of them deserves the model next. Pure: no time, no I/O.

Fair queuing over tokens at three levels, one inside the other:

1. **tenants** share the model by their weight;
2. within a tenant, **priority classes** share the tenant's turns by class weight (the scheduler passes
   high:normal:low = r²:r:1);
3. within a class, **flows** share equally — the batcher makes each request a flow, so a one-text query
   waits beside the 2,048 inputs of a bulk request, not behind them;

and within a flow, inputs keep their arrival order.

At every level each child (tenant, class or flow) carries ``vtime``, the tokens it has been served divided
by its weight: the start tag of its next input, whose finish tag is ``vtime + tokens / weight``. Tenants
and flows go by start tag (start-time fair queuing: the least served first, so a long input is not pushed
back by a crowd of short ones that came after it); classes go by finish tag (weighted fair queuing: a
short ``high`` input overtakes a ``normal`` one that started a little earlier, unless normal is owed a
whole input). Remaining ties go to the other tag, then to the child that joined first (or the higher
class). Inputs are charged at all three levels when they are taken into a batch; inputs removed unserved
(cancelled, expired, shed) charge nothing.

**Joining.** A child with nothing waiting that gets an input of ``n`` tokens starts at
``max(floor, clock - n / weight)``, or at ``clock`` when none of its siblings has work:

* ``floor`` is the smallest start tag among its active siblings. The newcomer starts no earlier than the
  least served of them — idle time earns no credit to burst with later — and, by the tie rules, is not
  behind it either: a query that arrives next to a bulk request goes first.
* ``clock`` is the level's fluid virtual time: every batch advances it by the tokens served through the
  level over the active siblings' total weight (what each would have received had the model been shared
  exactly). Newcomers join at most one input behind it, and it keeps moving while they keep coming, so a
  stream of new requests cannot hold back an input already waiting: that input's start tag is fixed,
  and once the clock has passed it, newcomers queue behind it. Under overload by many requests, each
  one gets about its share: a request among N waiting ones gets about 1/N of the tokens served.
* A **flow** (a request) is credited the mean input of its class's waiting inputs, not its own ``n``:
  ``max(floor, clock - mean)``. The flow clock moves by the tokens served over the number of waiting
  requests, a few tokens a batch with hundreds of them, so a credit of its own length let a request
  arriving batches later be ordered ahead of a shorter one that had waited: under a sustained overload
  the short requests (queries) were the ones that missed the start admission promised them and were
  dropped late, 43% of those of at most 8 tokens against 0.3% of those of 24 or more in the simulator
  (``tests/unit/test_overload.py::test_short_requests_are_not_the_ones_dropped_late_under_a_sustained_overload``).
  One credit for every newcomer of the moment keeps them in arrival order, as one-input requests expect.
  Tenants and classes, which come and go far less often, keep their own ``n``.

Nothing of a child that emptied is used when it comes back: its ``vtime`` is set afresh (an empty flow is
dropped at once; the batcher's flows are requests, which never come back). Having been served ahead of
its siblings before leaving is thus forgiven — at most about a window of inputs, since the order
interleaves active siblings.

``flow=None`` is one shared flow per tenant and class: callers that set no flow get first-come,
first-served order within a class, as before flows existed, and their inputs together share the class
with the explicit flows as one flow.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
DEFAULT_TENANT = "default"
IDLE_TENANTS_KEPT = 1024  # tenants kept before idle ones are dropped


class Entry(msgspec.Struct, eq=False):
    """One input waiting for a batch. ``payload`` is the caller's; never read here (the batcher
    subclasses the entry instead: its work is the entry).

    ``flow`` groups the inputs that share a class fairly as one (the batcher uses one key per request);
    None is the tenant's shared flow for that class. Compared and hashed by identity.

    A msgspec Struct, not a dataclass: the engine builds one per request input, and a Struct is built
    in C where a dataclass runs a generated ``__init__`` of Python, one assignment a field.
    """

    n_tokens: int
    arrival: float
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    priority: int = 1
    deadline: float | None = None
    payload: Any = None
    flow: Hashable = None
    kind: object = None  # what the runner returns for it: entries of different kinds never share a batch
    bulk: bool = False  # part of a request of many inputs (the scheduler sets it; see interactive_batch_s)
    lead: bool = False  # its request's first input, whose start admission judged (see admit.py)
    strict: bool = False  # a lead admitted while the queue stood or soon after: held to its bound (late)
    taken: bool = False
    _flow: _Flow | None = None  # set by FairQueue.add (never passed in)

    @property
    def queued(self) -> bool:
        """Whether :meth:`FairQueue.add` has taken it (it may have left the queue since)."""
        return self._flow is not None

    @property
    def fresh(self) -> bool:
        """Whether it joined while the queue was split (:meth:`FairQueue.split_off`) and waits among
        those that go before the backlog."""
        flow = self._flow
        return flow is not None and flow.fresh


_Key = tuple[float, float, int, "_Flow"]  # (start tag, finish tag, join order, flow)
_Part = TypeVar("_Part", "_Class", "_Tenant")


class _Flow(msgspec.Struct, eq=False):
    """One flow of a class: its waiting inputs in arrival order (taken ones linger in the middle). A
    Struct, as :class:`Entry`: a one-input request is a flow of its own."""

    key: Hashable
    seq: int  # join order: the last tie-break
    cls: _Class
    vtime: float  # tokens served (a flow's weight is 1): the start tag of its first waiting input
    entries: deque[Entry]
    items: int = 1
    order_key: _Key | None = None  # its place in cls.order (or cls.fresh) while it has waiting inputs
    fresh: bool = False  # joined while the queue was split (:meth:`FairQueue.split_off`): in cls.fresh


@dataclass(slots=True, eq=False)
class _Class:
    tenant: _Tenant
    index: int  # 0 high, 1 normal, 2 low: breaks the last tie
    weight: float
    vtime: float = 0.0  # tokens served / weight, among the tenant's classes
    clock: float = 0.0  # the flow level's fluid virtual time
    items: int = 0
    tokens: int = 0
    flows: dict[Hashable, _Flow] = field(default_factory=dict)  # flows with waiting inputs
    order: list[_Key] = field(default_factory=list)  # those flows by (start, finish, join order)
    multi: int = 0  # flows with more than one waiting input
    # While the queue is split (FairQueue.split_off): the flows that joined since, kept as ``order`` is and
    # served before it, and their waiting inputs and tokens.
    fresh: list[_Key] = field(default_factory=list)
    fresh_items: int = 0
    fresh_tokens: int = 0


@dataclass(slots=True, eq=False)
class _Tenant:
    name: str
    weight: float = 1.0
    vtime: float = 0.0  # tokens served / weight, among tenants
    seq: int = 0
    clock: float = 0.0  # the class level's fluid virtual time
    items: int = 0
    queued_tokens: int = 0
    classes: tuple[_Class, ...] = ()


class FairQueue:
    """Waiting inputs of one model, in tenant → class → flow fair order. Owned by the scheduler."""

    def __init__(self, class_weights: tuple[float, float, float]) -> None:
        self.class_weights = class_weights
        self.tenants: dict[str, _Tenant] = {}
        self.items = 0
        self.tokens = 0
        self._active: dict[str, _Tenant] = {}  # tenants with waiting inputs
        self._active_weight = 0.0
        self._clock = 0.0  # the tenant level's fluid virtual time
        self._seq = itertools.count()
        self.split = False  # flows joining now go before those that joined earlier (see split_off())
        # While set (the scheduler sets it: overload.Regime.onset), a class's one-input requests are
        # served newest first — after those that joined since a split, which keep their order — while
        # no request of several inputs waits in the class (that keeps fair order). Adaptive LIFO ("Fail
        # at Scale"): while a queue may be an overload's onset, its oldest requests could no longer
        # make the bound, and served first they made everyone behind them miss it too.
        self.newest_first = False

    # -- the newest first, for a moment ---------------------------------------------------------------
    def split_off(self) -> None:
        """From now on, within each class, flows that join go before the flows already waiting (the
        backlog), in fair order among themselves, until :meth:`fold`. Tenants and classes keep their
        shares: only the order of one class's requests changes.

        The scheduler splits the queue while it stands and is not yet confirmed an overload
        (:mod:`.overload`): what waits then was admitted as a burst, and a burst and the onset of an
        overload look alike until one of them stops. Served first, it made everything admitted behind it
        wait past the bound; set aside, the requests admitted now under the standing queue's promise keep
        it, and the backlog is served once they are (a burst that stops arriving) or held to the bound
        when the overload is confirmed (the scheduler folds then, and what can no longer start in time
        is answered late). With :attr:`newest_first`, the backlog's one-input requests go newest first
        behind them."""
        self.split = True

    def fold(self) -> None:
        """Back to one fair order: the flows that joined while split take their places among the
        backlog by their tags (the backlog's are older: it goes first again)."""
        if not self.split:
            return
        self.split = False
        for t in self._active.values():
            for c in t.classes:
                if c.fresh:
                    for key in c.fresh:
                        key[3].fresh = False
                    c.order = list(heapq.merge(c.order, c.fresh))
                    c.fresh = []
                    c.fresh_items = c.fresh_tokens = 0

    # -- in ------------------------------------------------------------------------------------------
    def add(self, entries: Iterable[Entry]) -> None:
        split = self.split
        # The tenant and class of the entry before: consecutive entries of the same tenant, weight and
        # class (a message's queries, a request's inputs) skip their lookup and joining, which only
        # the first of them can need (the level is active, with this weight, from then on).
        # The tenant's and the queue's counts are brought up to date when the group ends (the class's
        # stay live: a newcomer's credit reads them).
        t: _Tenant | None = None
        c: _Class | None = None
        tenant, weight, p = "", 0.0, -1
        items = tokens = 0  # the group's, not yet counted in its tenant and the queue
        for e in entries:
            n = e.n_tokens
            if t is None or c is None or e.tenant != tenant or e.priority != p or e.weight != weight:
                if t is not None:
                    self._count(t, items, tokens)
                    items = tokens = 0
                tenant, weight, p = e.tenant, e.weight, e.priority
                t, c = self._join(e)
            f = c.flows.get(e.flow)
            if f is None:
                order = c.fresh if split else c.order
                # (The class's mean waiting input as the credit, not this input's own tokens: see
                # "Joining" above. ``order`` is non-empty, so the class has inputs waiting.)
                start = max(order[0][0], c.clock - c.tokens / c.items) if order else c.clock
                f = c.flows[e.flow] = _Flow(e.flow, next(self._seq), c, start, deque((e,)), fresh=split)
                key = f.order_key = (start, start + n, f.seq, f)
                if not order or order[-1] < key:
                    order.append(key)  # the usual place: one-input flows join in arrival order
                else:
                    bisect.insort(order, key)
            else:
                if f.items == 1:
                    c.multi += 1
                f.entries.append(e)
                f.items += 1
            if split and f.fresh:  # (a flow is fresh only while the queue is split)
                c.fresh_items += 1
                c.fresh_tokens += n
            e._flow = f
            c.items += 1
            c.tokens += n
            items += 1
            tokens += n
        if t is not None:
            self._count(t, items, tokens)

    def _count(self, t: _Tenant, items: int, tokens: int) -> None:
        t.items += items
        t.queued_tokens += tokens
        self.items += items
        self.tokens += tokens

    def _join(self, e: Entry) -> tuple[_Tenant, _Class]:
        """The tenant and class ``e`` is queued in, each joining its level (see "Joining") if it had
        nothing waiting, and the tenant's weight made ``e``'s."""
        t = self.tenants.get(e.tenant)
        if t is None:
            if len(self.tenants) >= IDLE_TENANTS_KEPT:
                self._forget_idle_tenants()
            t = self.tenants[e.tenant] = self._new_tenant(e.tenant)
        if t.items == 0:
            t.weight = e.weight
            t.vtime = self._clock
            if self._active:
                floor = min(x.vtime for x in self._active.values())
                t.vtime = max(floor, self._clock - e.n_tokens / t.weight)
            t.seq = next(self._seq)
            self._active[t.name] = t
            self._active_weight += t.weight
        elif e.weight != t.weight:
            self._active_weight += e.weight - t.weight
            t.weight = e.weight
        p = e.priority
        c = t.classes[p if 0 <= p <= 2 else (0 if p < 0 else 2)]
        if c.items == 0:
            c.vtime = t.clock
            if t.items:
                floor = min(x.vtime for x in t.classes if x.items)
                c.vtime = max(floor, t.clock - e.n_tokens / c.weight)
        return t, c

    def _new_tenant(self, name: str) -> _Tenant:
        t = _Tenant(name)
        t.classes = tuple(_Class(t, i, w) for i, w in enumerate(self.class_weights))
        return t

    def _forget_idle_tenants(self) -> None:
        # Tenant names come from clients (X-Tenant): keep memory bounded. Nothing is lost: an idle
        # tenant that returns starts afresh anyway.
        for name in [name for name, t in self.tenants.items() if t.items == 0]:
            del self.tenants[name]

    # -- order ---------------------------------------------------------------------------------------
    def window(self, size: int) -> list[Entry]:
        """The first ``size`` waiting inputs in fair order: the order in which taking them one by one
        would serve them. The first is the one fairness says goes next (the batch's anchor)."""
        if len(self._active) == 1:
            (t,) = self._active.values()
            return list(itertools.islice(_tenant_order(t, size, self.newest_first), size))
        tenants = [(t.vtime, t.weight, t.seq, _tenant_order(t, size, self.newest_first))
                   for t in self._active.values()]
        return list(itertools.islice(_merge(tenants, by_finish=False), size))

    def waiting(self) -> Iterator[Entry]:
        for t in self._active.values():
            for c in t.classes:
                for f in c.flows.values():
                    yield from (e for e in f.entries if not e.taken)

    def active_flows(self) -> int:
        """Flows with inputs waiting (requests, for the batcher), over every tenant and class."""
        return sum(len(c.flows) for t in self._active.values() for c in t.classes)

    def tokens_ahead(self, tenant: str, weight: float, priority: int, tokens: int) -> int:
        """About how many waiting tokens fair order serves before a new request of ``tokens`` tokens of
        ``tenant`` (at ``weight``) and class ``priority`` is done: the fluid share of each level.

        Within its class each waiting request (flow) goes first with its next input, or with as many
        tokens as this request's ``tokens`` (start-time fair queuing: one-input requests that came
        earlier all go first); each other class of its tenant its class weight's share of that; each other
        tenant its weight's share of the tenant's. So a flood of one tenant or class does not count
        against a light one, and a fresh ``high`` query counts little of a ``normal`` backlog."""
        if not self.items:
            return 0  # (what the lines below come to with nothing waiting; asked at every admission)
        t = self._active.get(tenant)
        own: float = tokens
        if t is not None:
            mine = t.classes[min(max(priority, 0), 2)]
            if self.split:  # a newcomer joins the flows that joined since the split, ahead of the rest
                if mine.fresh_items:
                    own += min(mine.fresh_tokens,
                               len(mine.fresh) * max(tokens, mine.fresh_tokens / mine.fresh_items))
            elif mine.items:  # each flow sends about one input, or as many tokens as this request
                own += min(mine.tokens, len(mine.flows) * max(tokens, mine.tokens / mine.items))
            scale = own / mine.weight
            siblings = 0.0  # (loops, not sum() over generators: this runs for every admitted request)
            for c in t.classes:
                if c is not mine and c.tokens:
                    siblings += min(c.tokens, c.weight * scale)
            own += siblings
            weight = t.weight
        scale = own / weight
        others = 0.0
        for x in self._active.values():
            if x is not t:
                others += min(x.queued_tokens, x.weight * scale)
        return int(own - tokens + others)

    def tenant_tokens(self, name: str) -> int:
        t = self.tenants.get(name)
        return 0 if t is None else t.queued_tokens

    def tenant_queued_tokens(self) -> dict[str, int]:
        return {name: t.queued_tokens for name, t in self._active.items()}

    # -- out -----------------------------------------------------------------------------------------
    def take(self, entries: Iterable[Entry], charge: bool) -> None:
        """Take entries out; ``charge`` bills their tokens to their flow, class and tenant (a batch)."""
        flows: dict[_Flow, list[int]] = {}  # tokens, inputs
        total = [0, 0]
        c: _Class | None = None
        one_class = True
        for e in entries:
            if e.taken:
                continue
            e.taken = True
            f = e._flow
            assert f is not None, "an entry taken that was never added"
            got = flows.get(f)
            if got is None:
                flows[f] = [e.n_tokens, 1]
                if c is None:
                    c = f.cls
                elif f.cls is not c:
                    one_class = False
            else:
                got[0] += e.n_tokens
                got[1] += 1
            total[0] += e.n_tokens
            total[1] += 1
        if c is None:
            return
        if one_class:  # the common case
            classes = {c: total}
            tenants = {c.tenant: total}
        else:
            classes = _sums((f.cls, got) for f, got in flows.items())
            tenants = _sums((cls.tenant, got) for cls, got in classes.items())
        if charge:
            self._charge(flows, classes, tenants)
        if len(classes) == 1:
            _reorder(c, flows)
        else:
            for c in classes:
                _reorder(c, {f: got for f, got in flows.items() if f.cls is c})
        for c, (tokens, n) in classes.items():
            c.items -= n
            c.tokens -= tokens
        for t, (tokens, n) in tenants.items():
            t.items -= n
            t.queued_tokens -= tokens
            self.items -= n
            self.tokens -= tokens
            if t.items == 0:
                del self._active[t.name]
                self._active_weight -= t.weight
        if not self._active:
            self._active_weight = 0.0  # no drift from the running sum

    def _charge(
        self,
        flows: dict[_Flow, list[int]],
        classes: dict[_Class, list[int]],
        tenants: dict[_Tenant, list[int]],
    ) -> None:
        # Clocks advance by the tokens served over the weight that was active before this batch.
        total = 0
        for t, (tokens, _) in tenants.items():
            total += tokens
            t.vtime += tokens / t.weight
            weight = 0.0
            for c in t.classes:
                if c.items:
                    weight += c.weight
            t.clock += tokens / weight
        self._clock += total / self._active_weight
        for c, (tokens, _) in classes.items():
            c.vtime += tokens / c.weight
            c.clock += tokens / (len(c.order) + len(c.fresh))
        for f, (tokens, _) in flows.items():
            f.vtime += tokens


def _sums(parts: Iterable[tuple[_Part, list[int]]]) -> dict[_Part, list[int]]:
    """(tokens, inputs) summed per key."""
    sums: dict[_Part, list[int]] = {}
    for key, (tokens, n) in parts:
        got = sums.get(key)
        if got is None:
            sums[key] = [tokens, n]
        else:
            got[0] += tokens
            got[1] += n
    return sums


def _reorder(c: _Class, flows: dict[_Flow, list[int]]) -> None:
    """Give the flows of ``c`` that lost inputs their new place in ``c.order`` (or, split, in ``c.fresh``:
    each stays in its own), or drop them if empty."""
    if c.fresh:
        fresh = {f: got for f, got in flows.items() if f.fresh}
        if fresh:
            for tokens, n in fresh.values():
                c.fresh_items -= n
                c.fresh_tokens -= tokens
            _requeue(c, c.fresh, fresh)
            flows = {f: got for f, got in flows.items() if not f.fresh}
    _requeue(c, c.order, flows)


def _requeue(c: _Class, order: list[_Key], flows: dict[_Flow, list[int]]) -> None:
    """:func:`_reorder` for flows of ``c`` that are all in ``order``."""
    olds: list[_Key] = [f.order_key for f in flows if f.order_key is not None]
    news: list[_Key] = []
    for f, (_, n) in flows.items():
        f.items -= n
        c.multi += (f.items > 1) - (f.items + n > 1)
        if f.items == 0:
            del c.flows[f.key]
            f.order_key = None
            f.entries.clear()  # (taken inputs all: nothing else holds them in a cycle with it)
            continue
        q = f.entries
        while q[0].taken:
            q.popleft()
        # Inputs taken from the middle stay until they reach the head; rebuild when they make up most
        # of the deque, so memory stays proportional to what waits.
        if len(q) > 2 * f.items + 64:
            q = f.entries = deque(e for e in q if not e.taken)
        key = f.order_key = (f.vtime, f.vtime + q[0].n_tokens, f.seq, f)
        news.append(key)
    if len(olds) <= 4:
        for key in olds:
            del order[bisect.bisect_left(order, key)]
    else:
        # Many (a batch of one-input requests): all sit together, near the front (or the back, newest
        # first); one pass over their span drops them.
        start, end = bisect.bisect_left(order, min(olds)), bisect.bisect_right(order, max(olds))
        order[start:end] = [k for k in order[start:end] if k[3].order_key is k]
    for key in news:
        bisect.insort(order, key)


def _tenant_order(t: _Tenant, size: int, newest: bool = False) -> Iterator[Entry]:
    """The tenant's first ``size`` waiting inputs (or more), in fair order (``newest``: see
    :attr:`FairQueue.newest_first`)."""
    active = [c for c in t.classes if c.items]
    if len(active) == 1:
        return _class_order(active[0], size, newest)
    return _merge([(c.vtime, c.weight, c.index, _class_order(c, size, newest)) for c in active],
                  by_finish=True)


def _class_order(c: _Class, size: int, newest: bool = False) -> Iterator[Entry]:
    """The class's first ``size`` waiting inputs (or more), in fair order: while the queue is split,
    those of the flows that joined since first (:meth:`FairQueue.split_off`); ``newest``, the backlog's
    one-input requests newest first."""
    if not c.fresh:
        return _flows_order(c.order, c.multi, size, newest)
    if not c.order:
        return _flows_order(c.fresh, c.multi, size)
    return itertools.chain(_flows_order(c.fresh, c.multi, size), _flows_order(c.order, c.multi, size, newest))


def _flows_order(order: list[_Key], multi: int, size: int, newest: bool = False) -> Iterator[Entry]:
    """The inputs of the flows of ``order`` (``multi``: whether some have several), in fair order, or
    (``newest``, one-input flows only) the latest to join first."""
    if len(order) == 1:
        return (e for e in order[0][3].entries if not e.taken)
    if multi == 0:  # one-input flows only (the common case): their heads, in order
        if newest:
            return iter([k[3].entries[0] for k in order[: -size - 1 : -1]])
        return iter([k[3].entries[0] for k in order[:size]])
    return _flow_merge(order)


def _flow_merge(order: list[_Key]) -> Iterator[Entry]:
    """The inputs of a class's flows in fair order. Flows not reached yet are read from ``order`` (sorted
    by their heads' tags); a flow reached has its next input in ``reached``, whose start tag is the
    finish tag of the input before it."""
    reached: list[tuple[float, float, int, Entry, Iterator[Entry]]] = []
    i, n = 0, len(order)
    while True:
        if reached and (i == n or (reached[0][0], reached[0][1], reached[0][2]) < order[i][:3]):
            _, fin, seq, e, rest = heapq.heappop(reached)
        elif i < n:
            _, fin, seq, f = order[i]
            i += 1
            rest = iter(f.entries)
            e = next(rest)  # a flow's head is never a taken input: take() drops those
        else:
            return
        yield e
        for x in rest:
            if not x.taken:
                heapq.heappush(reached, (fin, fin + x.n_tokens, seq, x, rest))
                break


def _merge(children: list[tuple[float, float, int, Iterator[Entry]]], by_finish: bool) -> Iterator[Entry]:
    """Interleave children's input sequences by fair queuing.

    Each child is (vtime, weight, tie-break, its inputs in its own order); a child's next input starts
    where its previous one finished (``+ tokens / weight``). Start tags first (start-time fair queuing),
    or ``by_finish``: finish tags first (weighted fair queuing: a short input of a heavy child goes
    before a sibling's input that started a little earlier but ends later).
    """
    heap: list[tuple[tuple[float, float], int, Entry, float, Iterator[Entry]]] = []
    for start, weight, seq, inputs in children:
        first = next(inputs, None)
        if first is not None:
            fin = start + first.n_tokens / weight
            heap.append(((fin, start) if by_finish else (start, fin), seq, first, weight, inputs))
    heapq.heapify(heap)
    while heap:
        tags, seq, _, weight, inputs = heap[0]
        yield heap[0][2]
        start = tags[0] if by_finish else tags[1]  # this input's finish: the next one's start
        nxt = next(inputs, None)
        if nxt is None:
            heapq.heappop(heap)
        else:
            fin = start + nxt.n_tokens / weight
            heapq.heapreplace(heap, ((fin, start) if by_finish else (start, fin), seq, nxt, weight, inputs))
