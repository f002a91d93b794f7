"""Admission of one model's requests: the queue bounds, the wait the queue's regime admits, deadlines.

A request is refused at once — before it queues, and where the caller can, before it is tokenised
(:meth:`Admitter.precheck` on estimated counts) — when:

* its tokens would pass the model's queue bound, or its named tenant's (``queue_full``,
  ``tenant_queue_full``; ``too_large`` if it could never fit);
* its first input would wait longer than the queue's regime admits (:mod:`.overload`): while the
  queue keeps emptying, up to ``burst_wait_s`` in the queue (``queue_full`` beyond), so a burst that
  drains in seconds is served whole; once the queue stands, only if its first result is predicted
  within :data:`DOOR` (nine tenths) of ``max_queue_wait_s`` of its head arriving, the time it spent
  before admission included (``overloaded``), so admitted requests keep their latency under sustained
  overload while the excess is refused for the price of a check (and what was admitted under that
  promise but can no longer make the whole bound is answered ``late`` when its turn comes:
  :meth:`Admitter.late`); under a confirmed overload, predictions count the time that holds the
  model besides its forwards (the drain pace, :meth:`Admitter.drained`), the wait ahead at the slow
  end of a few forwards in a row (the cost model's run spread) and the batch a request rides in at the
  slow end of recent forwards (its spread), since the bound is on the p99;
* it cannot finish by its deadline (``deadline_unmeetable``).

**Checked but not yet queued.** Between the check before tokenising and admission (the tokeniser's
turn), a request is in neither the queue nor the past: without counting it, every request that
arrives meanwhile is judged against the same short queue, and under a sustained overload most of
them pass the early check only to be refused — or admitted and dropped late — after being decoded
and tokenised. So a request that passes :meth:`Admitter.precheck` is *held*: counted ahead of later
checks of its class and the more urgent ones' (never of a more urgent request's, so a held ``low``
flood does not refuse a ``high`` query) until :meth:`Admitter.admit` takes its tokens back, or for
:data:`HOLD_S` at most (a request that fails before admission is not waited for). A request that
carries its :class:`Hold` to admission (the check from its head, ``gateway/shed.py``) has that hold
ended whole, and counts only the holds taken before its own; others release the oldest hold of their
class by their real tokens.

The predicted wait is fair-queue aware (:meth:`.fair.FairQueue.tokens_ahead`): a flood of one tenant
or of ``low`` requests does not count against a ``high`` query or another tenant's, so a refused flood
does not refuse them. Refusals carry a Retry-After from :class:`.overload.RetryPacer`, so callers that
honour it come back one after the other when there is room.

Pure: no clock, no asyncio; the scheduler owns it and passes its ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from .cost import CostModel
from .fair import DEFAULT_TENANT, PRIORITIES, Entry, FairQueue
from .overload import Regime, RetryPacer
from .policy import PaddedCost

# How long a request that passed the check before tokenising counts as held (see the module's
# docstring): longer than a tokenising turn takes under load; what a failed request leaves behind
# counts no longer than this.
HOLD_S = 0.5


class Hold(list[float]):
    """One request's hold, from its check before tokenising to its admission: [when, tokens (what is
    left of them), priority class, tokens per input]; empty: the check held nothing. The request carries
    it to :meth:`Admitter.admit`, which ends it whole: released by count instead (the oldest of the
    class), a hold on an estimate above the request's real tokens outlived it, and a flood of them, each
    leaving its excess for :data:`HOLD_S`, refused everyone behind a queue that was not there."""

    __slots__ = ()


# The drain pace (see :meth:`Admitter.drained`): over the last DRAIN_SPAN batches that finished with
# work waiting, seconds between completions ÷ their measured forwards, once DRAIN_AFTER are in; within
# DRAIN_BOUNDS (never below 1: it only corrects predictions that run short).
DRAIN_SPAN = 16
DRAIN_AFTER = 4
DRAIN_BOUNDS = (1.0, 3.0)

# An input is dropped ``late`` (:meth:`Admitter.late`) only once it has waited this share of
# ``max_queue_wait_s`` itself, whatever the predictions add. Under a confirmed overload predictions are
# scaled to the slow end of the pace (up to 9×); with a fit gone wrong they said that even an input just
# arrived could not make the bound. The door admits into an empty queue whatever they say, and every input
# it admitted was then dropped: the model sat idle with nothing to run that could correct the fit (the
# likely cause of a live 4× flood that served nothing for 18 s while admitting some 500 requests a second,
# each dropped late). The floor binds only when a lone input's forward is predicted, at that slow end,
# past half the bound: otherwise :meth:`Admitter.batch_s` (a batch's share, at most half the bound unless
# one input alone takes longer) already waits longer.
LATE_AFTER = 0.5

# What a standing queue promises at the door: a first result within this share of
# ``max_queue_wait_s``; it drops an admitted input ``late`` only past the whole bound (:meth:`Admitter.late`).
# Predictions err both ways, and with one line for both, every admission near it that ran a little
# late was dropped after being decoded, tokenised and queued (each costing the event loop what a served
# request costs), or served past the bound: the simulator's admitted p99 sat at or over the target.
# The tenth between the two lines is the prediction's slack
# (``test_a_standing_queue_promises_less_than_it_drops_at``).
DOOR = 0.9

_POSITIVE = (0.0).__lt__  # (filter's test of a number above 0: no bytecode per item)

Reason = Literal["queue_full", "overloaded", "tenant_queue_full", "deadline_unmeetable", "too_large"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an admission was refused: ``reason`` is a metric label; ``retry_after`` is in seconds."""

    reason: Reason
    message: str
    retry_after: float


class Admitter:
    """The admission decisions of one model's scheduler. ``busy_s(now)``: seconds the batches already
    handed to the model still need."""

    def __init__(self, config: AdmissionConfig, queue: FairQueue, cost: CostModel, padded_cost: PaddedCost,
                 busy_s: Callable[[float], float]) -> None:
        self.config = config
        self._queue = queue
        self._cost = cost
        self._padded_cost = padded_cost
        self._busy_s = busy_s
        # Forwards that run side by side (SchedulerConfig.forwards): the queue drains that many times as
        # fast as one forward after another would drain it.
        self._side = config.forwards
        self._padding = 1.0  # padded ÷ real tokens of recent batches
        self._drain: deque[tuple[float, float]] = deque(maxlen=DRAIN_SPAN)  # (held, forward) seconds
        self._last_done: float | None = None  # the last completion that left work waiting
        self.drain_pace = 1.0
        # Requests that passed precheck and are not admitted yet: [when, tokens, priority, tokens per
        # input], oldest first; tokens shrink as admissions release them (inputs with them, at that size).
        self._held: deque[Hold] = deque()
        self._held_tokens = [0.0] * len(PRIORITIES)  # held tokens by priority class
        self._held_inputs = [0.0] * len(PRIORITIES)  # and the inputs they are
        self.regime = Regime(config.queue_target_s, config.queue_interval_s)
        self.regime.capacity = self.capacity()  # and again at each admission, as the cost model learns
        self._pacer = RetryPacer()

    @property
    def on(self) -> bool:
        """Whether the regime's wait bounds apply (``max_queue_wait_s`` > 0)."""
        return self.config.max_queue_wait_s > 0

    def check_room(self, tenant: str, tokens: int, now: float) -> Refusal | None:
        """None if ``tokens`` more tokens of ``tenant`` fit the queue bounds now; else why not.

        The model-wide bound applies to everyone; the tenant bound to named tenants (the default tenant
        has only the model's). ``check_room(tenant, 1, now)`` before tokenising refuses a flood early.
        """
        cfg = self.config
        queued = self._queue.tokens
        if queued + tokens > cfg.max_queued_tokens:
            return Refusal(
                "queue_full",
                f"{queued} tokens are waiting (bound {cfg.max_queued_tokens}); retry later.",
                self.drain_s(now),
            )
        if tenant != DEFAULT_TENANT:
            held = self._queue.tenant_tokens(tenant)
            if held + tokens > cfg.tenant_max_queued_tokens:
                return Refusal(
                    "tenant_queue_full",
                    f"Tenant '{tenant}' has {held} tokens waiting (bound "
                    f"{cfg.tenant_max_queued_tokens}); retry later.",
                    self.drain_s(now),
                )
        return None

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
        """None if a request of these inputs may queue now; else why not. ``arrived``: when its head
        arrived (``now`` if unknown), so the wait before admission counts. ``held``: the hold its
        check took (:meth:`precheck`), released whole; None: the oldest hold of its class, by count."""
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
        self.regime.asked(total, now)
        self.regime.capacity = self.capacity()
        # Its own hold, if it had one: it is in the queue from now.
        if held is None:
            self._release(total, priority)
        else:
            self.unhold(held)
        refusal = self.check_room(tenant, total, now)
        ahead = None
        if refusal is None and self.on:
            ahead = self._queue.tokens_ahead(tenant, weight, priority, lengths[0])
            # Held room counts ahead of it; for a request that held its own, only the holds taken before
            # its own (those taken since were judged with it ahead of them).
            holds = self._held_before(priority, now, held[0]) if held else self._held_ahead(priority, now)
            refusal = self._check_wait(lengths[0], total, len(lengths), tenant, weight, priority, now,
                                       arrived, ahead, holds)
        if refusal is not None or deadline is None:
            return refusal
        if ahead is None or len(lengths) > 1:  # (one input: what is ahead of its first is ahead of all)
            ahead = self._queue.tokens_ahead(tenant, weight, priority, total)
        own = self._cost.predict(self._padded_cost(len(lengths), max(lengths)))
        finish = now + self.wait_s(ahead, now) + own
        if finish > deadline:
            return Refusal(
                "deadline_unmeetable",
                f"The queue ahead needs about {finish - now:.3f} s, past this request's deadline.",
                self.drain_s(now),
            )
        return None

    def admits_all(
        self, total: int, inputs: int, shortest: int, longest: int, widest: int, arrived: float,
        deadline: float | None, tenants: dict[str, int], now: float,
    ) -> bool:
        """Whether :meth:`admit` would admit every request of a message, taken one after the other,
        judged once for the message: ``total`` tokens in ``inputs`` inputs, of ``shortest`` to
        ``longest`` tokens, at most ``widest`` in one request, the earliest head ``arrived``, the earliest
        ``deadline`` (None: none has one), and the message's tokens by named tenant. True only when its
        worst case passes every check in either regime: every token of the message already queued ahead
        (``FairQueue.tokens_ahead`` never counts more than the whole queue), every held token too, every
        input as short and every batch as small as any of them could make it, and every request as old
        as the oldest. False says only that this bound fails: :meth:`admit` then judges each request
        (some may still be admitted). Sound, not exact (``tests/unit/test_bulk_admission.py`` checks
        it against :meth:`admit`); it spares a message of one-sentence requests a fair-share walk, a wait
        prediction and a regime update each, which were a third of the engine's CPU per request."""
        cfg, queue, coef = self.config, self._queue, self._cost.coef
        self.regime.capacity = self.capacity()  # (as admit() does: the cost model learns)
        if queue.tokens + total > cfg.max_queued_tokens:
            return False
        for tenant, tokens in tenants.items():
            if queue.tenant_tokens(tenant) + tokens > cfg.tenant_max_queued_tokens:
                return False
        if not self.on and deadline is None:
            return True
        if coef.overhead_s < 0 or coef.per_token_s < 0:
            return False  # (predictions would not grow with the batch: no worst case to take)
        padding, limit = self._padding, self.batch_limit_s  # (shortened as admit()'s: the pace, the spread)
        held, held_inputs = self._held_ahead(len(PRIORITIES) - 1, now)
        ahead = queue.tokens + total + held
        mean = queue.tokens / queue.items if queue.items else 16.0  # (wait_s's count of an empty queue)
        low, high = min(mean, shortest), max(mean, longest, 1)
        if held_inputs > 0:  # (wait_s counts held inputs as they were checked: the shortest counts here)
            low = min(low, held / held_inputs)
        if low <= 0:
            return False
        # wait_s at its worst: the most inputs ahead, in batches as small as a standing queue runs them.
        size = cfg.max_batch_size
        per_input = coef.per_token_s * padding * high
        size = max(1, min(size, int((limit - coef.overhead_s) / max(per_input, 1e-9))))
        wait = (self._busy_s(now) + (math.ceil(ahead / low / size) * coef.overhead_s
                + ahead * padding * coef.per_token_s) / self._side
                ) * self.drain_pace * self._cost.run_spread  # (≥ _pace())
        if self.on:
            n = min(cfg.max_batch_size, queue.items + inputs + 1)
            full = self._cost.predict(self._padded_cost(n, math.ceil(high)))
            alone = self._cost.predict(self._padded_cost(1, max(longest, 1)))
            own = min(full, max(alone, limit)) * self.drain_pace * self._cost.spread  # batch_s(), at most
            if wait > cfg.burst_wait_s or max(0.0, now - arrived) + wait + own > DOOR * cfg.max_queue_wait_s:
                return False
        if deadline is not None:
            own = self._cost.predict(self._padded_cost(widest, longest))
            if now + wait + own > deadline:
                return False
        return True

    def admitted(self, tokens: Sequence[int], now: float, holds: Sequence[Hold] = (),
                 held_tokens: int = 0) -> None:
        """The requests of a message join the queue on :meth:`admits_all`'s word, ``tokens[p]`` tokens
        of class ``p`` without a hold of their own and ``held_tokens`` with one (``holds``): what
        :meth:`admit` records of their admissions (their arrival, their holds released: their own
        whole, the others the oldest of each class first, as one by one)."""
        self.regime.asked(sum(tokens) + held_tokens, now)
        for held in holds:
            self.unhold(held)
        if self._held:
            for priority, count in enumerate(tokens):
                if count:
                    self._release(count, priority)

    def precheck(
        self, first: int, total: int, inputs: int, tenant: str, weight: float, priority: int,
        arrived: float, now: float, *, hold: bool = True,
    ) -> Refusal | Hold:
        """Before tokenising: refuse a request of about ``total`` tokens in ``inputs`` inputs (its
        first about ``first``) that the queue bounds or the regime would refuse. The counts are
        estimates, so callers err low; :meth:`admit` decides again on the real ones. One that passes
        is held (see the module's docstring) unless ``hold`` is False (a check made again later): its
        :class:`Hold` (empty when nothing is held), which :meth:`admit` releases whole when given it.
        The regime is observed first, whatever waits (before, only with something ahead of the
        request): a queue that keeps emptying with room for all that waits and is held
        (:meth:`_burst_room`) then passes it unjudged."""
        refusal = self.check_room(tenant, 1, now)
        if refusal is None and self.on:
            # A queue that keeps emptying with room for whatever waits and is held passes any newcomer:
            # judged so, a request's check makes no fair-share walk and no wait prediction.
            standing = self.regime.observe(now)
            if standing or not self._burst_room(now):
                refusal = self._check_wait(first, total, inputs, tenant, weight, priority, now, arrived,
                                           standing=standing)
        if refusal is not None:
            self.regime.asked(total, now)  # it never reaches admit(), which counts the others
            return refusal
        if hold and self.on and total > 0:
            held = Hold([now, float(total), float(priority), total / max(inputs, 1)])
            self._held.append(held)
            self._held_tokens[priority] += total
            self._held_inputs[priority] += max(inputs, 1)
            return held
        return Hold()

    def unhold(self, held: Hold) -> None:
        """A request is being admitted with the hold its check took: that hold ends, whole (what the
        others' releases by count left of it)."""
        if held and held[1] > 0:
            priority, tokens = int(held[2]), held[1]
            held[1] = 0.0
            self._held_tokens[priority] -= tokens
            self._held_inputs[priority] -= tokens / held[3]

    def _held_ahead(self, priority: int, now: float) -> tuple[int, float]:
        """Held tokens that a request of ``priority`` counts ahead of it, and the inputs they are: its
        class's and the more urgent ones' (a lower number), after dropping holds older than
        :data:`HOLD_S`."""
        if not self._prune(now):
            return 0, 0.0
        tokens_by, inputs_by = self._held_tokens, self._held_inputs
        return int(sum(tokens_by[: priority + 1])), max(sum(inputs_by[: priority + 1]), 0.0)

    def _prune(self, now: float) -> bool:
        """Drop the holds older than :data:`HOLD_S` and those ended, oldest first; whether any is left."""
        held, limit, tokens_by, inputs_by = self._held, now - HOLD_S, self._held_tokens, self._held_inputs
        while held and (held[0][0] < limit or held[0][1] <= 0):
            _, tokens, cls, size = held.popleft()
            tokens_by[int(cls)] -= tokens
            inputs_by[int(cls)] -= tokens / size
        if not held:
            tokens_by[:] = [0.0] * len(tokens_by)  # (no rounding left behind)
            inputs_by[:] = [0.0] * len(inputs_by)
            return False
        return True

    def _held_before(self, priority: int, now: float, since: float) -> tuple[int, float]:
        """:meth:`_held_ahead`, of the holds taken before ``since`` only."""
        if not self._held_ahead(priority, now)[0]:  # (drops the expired ones)
            return 0, 0.0
        tokens, inputs = 0.0, 0.0
        for at, left, cls, size in self._held:
            if at >= since:
                break
            if cls <= priority and left > 0:
                tokens += left
                inputs += left / size
        return int(tokens), inputs

    def _release(self, tokens: int, priority: int) -> None:
        """A request of ``priority`` and ``tokens`` tokens is being admitted: its hold (the oldest of
        its class, as near as estimates allow) ends."""
        left = float(tokens)
        for h in self._held:
            if h[2] == priority and h[1] > 0:
                take = min(h[1], left)
                h[1] -= take
                self._held_tokens[priority] -= take
                self._held_inputs[priority] -= take / h[3]
                left -= take
                if left <= 0:
                    break

    def _burst_room(self, now: float) -> bool:
        """Whether a queue that keeps emptying admits any newcomer, whatever its class, tenant or size:
        :meth:`wait_s` at its most — every queued and every held token ahead of it (the queue's tokens
        count as all its inputs there), every held input — within ``burst_wait_s``. Sound, not exact
        (False says only that this bound fails: :meth:`_check_wait` judges;
        ``test_a_check_on_room_for_everything_waiting_is_the_check_made_in_full``)."""
        coef = self._cost.coef
        if coef.overhead_s < 0 or coef.per_token_s < 0:
            return False  # (predictions would not grow with what waits: no worst case to take)
        held_tokens = held_inputs = 0.0
        if self._held and self._prune(now):  # (as _held_ahead would: what failed before admission goes)
            held_tokens = sum(filter(_POSITIVE, self._held_tokens))
            held_inputs = sum(filter(_POSITIVE, self._held_inputs))
        return self.wait_s(self._queue.tokens, now, held_tokens, held_inputs) <= self.config.burst_wait_s

    def _check_wait(
        self, first: int, total: int, inputs: int, tenant: str, weight: float, priority: int,
        now: float, arrived: float | None, ahead: int | None = None, held: tuple[int, float] | None = None,
        *, standing: bool | None = None,
    ) -> Refusal | None:
        """Refuse a request whose first input would start later than the regime admits, counting what
        it waited before admission. ``ahead``: ``tokens_ahead`` of its first input, and ``held``: the
        held tokens before it and their inputs (:meth:`_held_ahead`), when known; ``standing``: the
        regime observed at ``now``, when it was."""
        cfg = self.config
        if ahead is None:
            ahead = self._queue.tokens_ahead(tenant, weight, priority, first)
        held_tokens, held_inputs = self._held_ahead(priority, now) if held is None else held
        if ahead + held_tokens == 0:
            return None  # nothing waits before it: a running batch is no backlog, however slow
        elapsed = 0.0 if arrived is None else max(0.0, now - arrived)
        wait = self.wait_s(ahead, now, held_tokens, held_inputs)
        if standing is None:
            standing = self.regime.observe(now)
        # (The batch it rides in counts only against a standing queue's bound: not predicted otherwise.)
        verdict = judge_wait(standing, elapsed, wait, self.batch_s(first) if standing else 0.0, cfg)
        if verdict is None:
            return None
        reason, allowed, what = verdict
        retry = self._pacer.after(now, self.room_in(wait, allowed), total / self.capacity())
        return Refusal(reason, f"{what}; retry in {retry:.3f} s.", retry)

    def room_in(self, wait: float, allowed: float) -> float:
        """Seconds until a queue that makes a newcomer wait ``wait`` has drained to half of the
        ``allowed`` wait. The whole queue counts, standing or not: what a burst put in it before it
        stood is served, not dropped (:meth:`late`), and a caller told to come back before it has
        drained was refused again (it once counted a standing queue as cut to the bound)."""
        return wait - max(allowed, 0.0) / 2

    def late(self, waiting: Sequence[Entry], start: float, now: float) -> list[Entry]:
        """Of ``waiting`` (in fair order), the first inputs of requests that were admitted under a
        standing queue's promise (``strict``, set on a request's ``lead`` while it stood or within
        :attr:`.overload.Regime.STRICT` intervals after) and can no longer keep it: under a standing
        queue, those whose first result cannot come within ``max_queue_wait_s`` of their arrival if
        their batch starts at ``start`` (the next anchor by its forward alone, the others by the batch
        they would ride in). They are answered (429 ``late``), not computed late, so that those behind
        them keep the bound. (The anchor's batch is not sized to what it has left: under a standing
        queue ``Scheduler._next`` runs batches of :attr:`batch_limit_s` whatever the anchor has left,
        so an anchor that waited nearly to the bound finishes past it. Judged by that batch, most of a
        standing queue's anchors, which have waited most of the bound, would be dropped; a known gap,
        not measured apart.)

        Not an input admitted as a burst, into a queue that kept emptying, while the queue stands only
        for a moment: a burst still arriving (a thousand calls take a starved client seconds to send)
        stands while it does, and that does not undo their admission — dropping them, with their
        callers' retries judged against the same queue, lost up to 150 of a simulated thousand-chunk
        ingestion on a busy machine. Once it has stood for a whole interval
        (:meth:`.overload.Regime.confirmed`), it is an overload whose first interval only looked like a
        burst, and what that start put in the queue is held to the bound too (serving it all kept a 4×
        overload's admitted p99 past 2 s in the simulator). Until then it waits behind what the standing
        queue admits (:meth:`.fair.FairQueue.split_off`): served first, it made those wait past the
        bound (the simulated soak's 2× phases: p99 0.73–0.78 s). Nor anything while the queue keeps
        emptying: it drains in order, so dropping its oldest inputs (say, past ``burst_wait_s`` on a
        machine slower than predicted) helps none of those behind them, and sends their callers to the
        back of the queue; deadlines drop what is hopeless.

        Except, under a standing queue, ``high`` inputs, and ``normal`` ones while ``low`` ones wait:
        fair order weights them ahead of the lower classes, so the queue is hardly what made them late
        (a running batch, a gateway busy refusing a flood is), and dropping them would refuse a ``high``
        query for a ``low`` flood's sake — even when the flood's inputs in the queue were all just
        refused or dropped. Admission at the door is what sheds a flood of ``high`` requests."""
        if not self.on or not waiting:
            return []
        cfg = self.config
        if not self.regime.observe(now):
            return []
        anchor = waiting[0]
        alone = self._cost.predict(self._padded_cost(1, anchor.n_tokens)) * self._ride()
        limit = cfg.max_queue_wait_s - self.batch_s(0)
        lowest = max(PRIORITIES["normal"], *(e.priority for e in waiting))
        confirmed = self.regime.confirmed(now)  # an overload: what a burst was admitted is held too

        def bound(e: Entry) -> bool:  # held to the standing bound (``strict`` is only ever on a lead)
            return (e.lead if confirmed else e.strict) and e.priority == lowest

        floor = LATE_AFTER * cfg.max_queue_wait_s  # (its own wait, whatever the predictions say)
        limit, alone_limit = max(limit, floor), max(cfg.max_queue_wait_s - alone, floor)
        late = [e for e in waiting[1:] if bound(e) and start - e.arrival > limit]
        if bound(anchor) and start - anchor.arrival > alone_limit:
            late.insert(0, anchor)
        return late

    def late_retry(self, now: float, dropped: list[Entry]) -> list[float]:
        """Retry-After for each first input dropped as ``late``, one after the other."""
        self.regime.capacity = rate = self.capacity()  # no admission may have updated it for a while
        room = self.room_in(self.drain_s(now), self.config.max_queue_wait_s)
        return [self._pacer.after(now, room, e.n_tokens / rate) for e in dropped]

    def capacity(self) -> float:
        """Tokens per second the model serves in batches as full as the limits allow, of inputs like
        those waiting (of 16 tokens when none waits), padded as recent batches were: the regime
        compares arrivals with it, and refused callers are paced on it.

        Padded, as :meth:`wait_s` counts the queue: real batches run their inputs at the longest one's
        length, and a rate of unpadded tokens overstated what the model serves by as much as the
        padding, so an overload's arrivals looked like the model's own rate: the queue was slow to
        "stand" and quick to leave it, admitting a burst's worth into an overload meanwhile
        (``test_overload_of_mixed_lengths_is_judged_on_the_padded_rate_the_model_serves``)."""
        queue = self._queue
        mean = max(queue.tokens / queue.items if queue.items else 16.0, 1.0)
        n = self.config.max_batch_size
        return n * mean / max(self._padded_s(1, n * mean), 1e-9)

    @property
    def batch_limit_s(self) -> float:
        """The longest forward a standing queue runs: one that holds the model (the forward at the drain
        pace) half the wait bound, when it runs as slow as forwards run now (at the spread, under a
        confirmed overload: :meth:`_ride`); the other half is the queue."""
        return self.config.max_queue_wait_s / 2 / self._ride()

    def batch_s(self, first: int) -> float:
        """Predicted seconds of the batch a new input of ``first`` tokens would ride in: under load the
        queue runs in batches as full as the limits allow, of inputs like those waiting — but never
        more than half the wait bound (or its own forward alone, if longer): adaptive batching keeps a
        batch within what its oldest input has left of the target, so on a machine where a full batch
        takes longer than the bound, batches are smaller, not late. Under a confirmed overload, at the
        slow end of the forwards running now (the cost model's spread, :meth:`_ride`): the door promises
        a first result by it, and :meth:`late` drops what can no longer make the bound by it."""
        queue = self._queue
        n = min(self.config.max_batch_size, queue.items + 1)
        longest = max(first, queue.tokens // queue.items if queue.items else 0, 1)
        full = self._cost.predict(self._padded_cost(n, longest))
        alone = self._cost.predict(self._padded_cost(1, max(first, 1)))
        return min(full, max(alone, self.batch_limit_s)) * self._ride()

    def drained(self, seconds: float | None, now: float, backlog: bool) -> None:
        """A batch whose forward took ``seconds`` (None: it failed) finished at ``now``; ``backlog``:
        work still waits.

        Under a standing queue the wait a request is promised is a sum of forwards, but the queue drains
        at the wall time between one completion and the next while work waits: the forward and whatever
        holds the model besides (the event loop's turn between batches, a thread's wake-up, answering).
        The cost model is told the forwards only, so predictions that counted nothing else promised
        starts the queue did not keep: admitted requests were dropped ``late`` (decoded, tokenised and
        queued for nothing) or served past the bound. The drain pace — that wall time ÷ the forwards,
        over the recent batches that finished with work waiting — scales what a standing queue is
        predicted to wait and to hold the model (:meth:`wait_s`, :meth:`drain_s`, :meth:`batch_s`), and
        shortens its batches to match (:attr:`batch_limit_s`). A completion after the queue ran dry
        starts a new run (idle time is not the model's). A slower forward is the cost model's pace, not
        this one's."""
        last, self._last_done = self._last_done, now if backlog and seconds is not None else None
        if last is None or seconds is None or seconds <= 0:
            return
        self._drain.append(((now - last) * self._side, seconds))  # (side by side: each held them all)
        if len(self._drain) >= DRAIN_AFTER:
            held = math.fsum(t for t, _ in self._drain)
            forwards = math.fsum(t for _, t in self._drain)
            lo, hi = DRAIN_BOUNDS
            self.drain_pace = min(max(held / max(forwards, 1e-12), lo), hi)

    def dispatched(self, tokens: int, padded: int) -> None:
        """A batch of ``tokens`` real tokens ran as ``padded`` (the cost model's unit): predicted waits
        count the queue's tokens as the recent batches padded them."""
        if tokens > 0:
            self._padding += 0.1 * (padded / tokens - self._padding)

    def wait_s(self, ahead_tokens: int, now: float, held_tokens: float = 0.0, held_inputs: float = 0.0
               ) -> float:
        """Predicted seconds until ``ahead_tokens`` waiting tokens (``FairQueue.tokens_ahead``) and
        ``held_tokens`` held ones, ``held_inputs`` inputs, have run, after the batches already running.

        Held inputs count as many as were checked, not as inputs of the queue's mean size or of 16
        tokens: a burst arrives held, before the queue holds any of it, and on a model whose forward is
        mostly fixed overhead (a GPU) a thousand 128-token chunks read as 16-token inputs were eight
        times the forwards, 2.8 s predicted for 0.6 s of work, and most of the burst was refused at
        ``burst_wait_s`` (``test_a_held_burst_of_long_inputs_is_counted_as_its_inputs``). On a CPU,
        where a forward is mostly per-token cost, the count moves a prediction by a few per cent."""
        queue = self._queue
        # (Queued tokens ahead, at the queue's mean size; none queued: inputs of 16 tokens.)
        inputs = ahead_tokens * queue.items / queue.tokens if queue.tokens else ahead_tokens / 16
        run = self._run_s(inputs + held_inputs, ahead_tokens + held_tokens)
        return (self._busy_s(now) + run) * self._pace()

    def drain_s(self, now: float) -> float:
        """Predicted seconds until everything already admitted has run."""
        return (self._busy_s(now) + self._run_s(self._queue.items, self._queue.tokens)) * self._pace()

    def _pace(self) -> float:
        """What a predicted wait is scaled by: the drain pace under a confirmed overload (a queue that
        has stood a whole interval more: :attr:`.overload.Regime.overload`, as of its last observation),
        at the slow end of a few forwards in a row (the cost model's run spread: a wait is the batches
        ahead), else 1. Not under a queue that stands only for a moment: a burst still arriving stands
        while it does, and its callers, paced back by Retry-After into that queue, met a bound tightened
        by the pace with little slack left (one thousand-call burst lost 54 calls after their retries
        when the pace applied to any standing queue: 2975dd4). A burst's bound is generous and its wait
        no promise; an overload's promise is what the pace keeps."""
        return self.drain_pace * self._cost.run_spread if self.regime.overload else 1.0

    def _ride(self) -> float:
        """What a predicted forward of the batch a request rides in is scaled by: under a confirmed
        overload the drain pace (as :meth:`_pace`, and for its reasons) and the cost model's spread
        (:attr:`.cost.CostModel.spread`: by a slow forward, not a mean one), else 1."""
        return self.drain_pace * self._cost.spread if self.regime.overload else 1.0

    def _run_s(self, inputs: float, tokens: float) -> float:
        """Seconds to run ``inputs`` waiting inputs of ``tokens`` tokens: padded as recent batches
        were, in batches as large as the limits allow — under a standing queue, as large as fit
        :attr:`batch_limit_s`."""
        coef, size = self._cost.coef, self.config.max_batch_size
        if self.regime.standing and inputs:
            per_input = coef.per_token_s * self._padding * tokens / inputs
            size = max(1, min(size, int((self.batch_limit_s - coef.overhead_s) / max(per_input, 1e-9))))
        return self._padded_s(math.ceil(inputs / size), tokens)

    def _padded_s(self, batches: int, tokens: float) -> float:
        """Seconds of ``batches`` forwards over ``tokens`` real tokens, padded as recent batches were, and
        run as many at once as forwards run side by side."""
        coef = self._cost.coef
        return (batches * coef.overhead_s + tokens * self._padding * coef.per_token_s) / self._side


def judge_wait(
    standing: bool, elapsed: float, wait: float, own: float, cfg: AdmissionConfig
) -> tuple[Reason, float, str] | None:
    """None if a request that has waited ``elapsed`` s since its head arrived, whose first input would
    wait ``wait`` s more and then run ``own`` s, is admitted by the regime; else (reason, the wait its
    regime admits, why). Under a standing queue every second counts against ``max_queue_wait_s``; into
    a queue that keeps emptying, the queue's own wait is what ``burst_wait_s`` bounds (the time a
    request spent before admission counts against its deadline, which admission checks too; ``own`` is
    not read, and callers need not predict it). The one
    rule, for the engine's admission and a gateway's check on the engine's last report alike."""
    if standing:
        promise = DOOR * cfg.max_queue_wait_s
        allowed = promise - own
        if elapsed + wait <= allowed:
            return None
        return "overloaded", allowed, (
            f"The queue stands: this request would have its first result about "
            f"{elapsed + wait + own:.3f} s after it arrived (admitted within {promise:.3f} s)")
    # A burst: the queue is what is bounded (the time already spent counts against the deadline).
    if wait <= cfg.burst_wait_s:
        return None
    return "queue_full", cfg.burst_wait_s, (f"The queue ahead needs about {wait:.3f} s before this request "
                                            f"would start (bound {cfg.burst_wait_s:.3f} s)")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The admission knobs of :class:`.scheduler.SchedulerConfig` (which documents each)."""

    max_batch_size: int
    max_queued_tokens: int
    tenant_max_queued_tokens: int
    max_queue_wait_s: float
    burst_wait_s: float
    queue_target_s: float
    queue_interval_s: float
    forwards: int = 1
