"""Telling a burst from overload: the queue's regime, and when a refused caller should come back.

**The regime** follows CoDel (RFC 8289) and its use for server queues in "Fail at Scale" (Facebook,
2015). A queue that keeps emptying is *good*: whatever waits in it is a burst that drains. A queue
*stands* once its oldest waiting input has been older than ``target_s`` for a whole ``interval_s``
while requests keep arriving at least as fast as the model serves them: it does not drain, and
admitting more only makes everyone later. It stands until nothing waits (a standing queue whose late
inputs were just dropped is young, not drained) or until arrivals fall below the model's rate (what
is left is a burst draining); a queue that grows old again soon after it stood stands at once, for an
overload that goes on is not a new burst. A *confirmed* overload (below) also stands through a
moment with nothing waiting, while arrivals stay above the rate: under a sustained overload shed at
the door, a batch often takes all that waits, and a queue that stopped standing there admitted the
next ``target_s`` of arrivals as a burst, work that was then dropped late after being tokenised and
queued, or served past the bound (in the simulator at 4× capacity it stood 64% of the time, and a
sixth of what it refused was dropped late; standing on, it stands throughout and drops at most a
twenty-fifth: ``test_a_sustained_overload_is_shed_at_the_door_not_late``). Not before it is
confirmed: standing on through any empty moment made the thousand-call burst of
``tests/integration/test_overload.py`` lose callers after their retries (2026-12-02, reverted), since
a burst still arriving stands for a moment too. The signal is how far behind the queue is: the age of
the input that would be first in line were the queue served in admission order (as many inputs on
from the first admitted as have been taken, :meth:`Regime.head_age`), counted from its request's head
arriving (the wait before admission included); not the minimum sojourn of dispatched inputs: fair
queuing sends a fresh query ahead of a backlog, so the minimum sojourn stays low under a flood that
never drains. Served in order, that is the oldest input waiting; served otherwise (a bulk request at
its fair share, the newest first below) the oldest waiting input is older than the queue is behind,
and a burst judged by it stood sooner than in order, refusing its callers while it still arrived and
their retries again. The arrival rate is what tells a burst from overload once the burst has arrived:
both look alike while they arrive, so a queue that has stood for a whole interval more is *confirmed*
an overload (:meth:`Regime.confirmed`): only then is what its start was admitted as a burst held to the
standing bound. Meanwhile, from the moment the queue's head grows old with no overload in memory
(:attr:`Regime.onset`; arrivals outpacing the model), its one-input requests are served newest first
(:attr:`.fair.FairQueue.newest_first`, the adaptive LIFO of "Fail at Scale"): the oldest of what an
overload's onset admitted as a burst could no longer make the bound, the newest still can; once the
queue stands, the requests admitted under its promise go before that backlog, in their own order
(:meth:`.fair.FairQueue.split_off`), so they keep the promise whichever the queue turns out to be.
Confirmed an overload, the queue is served in one fair order again, oldest first, and what can no
longer start in time is dropped late; a burst that stops arriving has its backlog served, in order.
The admission rules for each regime are in :mod:`.admit`.

**Retry-After that works.** A refused caller is told to come back when the queue will have drained
to half of what the regime admits, and callers refused together are told to come back one after the
other, each after the predicted compute of those told before it (and a quarter more, for batches that
run late): a client that honours the hint
(the ``openai`` client does, to the millisecond with ``retry-after-ms``) finds room on its retry, and
a crowd of them returns at the rate the model serves, not as a second burst at the same instant.

Pure: no clock, no asyncio; the scheduler drives it with its own ``now``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

# Arrivals are judged over this long: requests reach admission in clumps (one event-loop turn's
# tokenising at a time), so a shorter window sees gaps in a load that goes on; a burst that has ended
# leaves it within this long.
ARRIVAL_WINDOW_S = 0.25
# A standing queue counts as a burst draining only once arrivals fall this far below the model's rate,
# not at the rate itself: a window of a fraction of a second holds a handful of requests when the model
# is slow, and arrivals near the rate (callers coming back as Retry-After paced them) would flip the
# regime at every dispatch — admitting a burst's worth while good, dropping it as late while standing.
LEAVE_BELOW = 0.9


class _Admitted(Protocol):
    arrival: float


class Regime:
    """Good (the queue keeps emptying) or standing (it has not for a whole interval)."""

    MEMORY = 8  # intervals after standing ends during which a queue that grows old again stands at once
    STRICT = 2  # intervals after standing ends during which what is admitted is held to its bound
    CONFIRM = 1  # intervals a queue must stand on before what a burst put in it is held to the bound too

    def __init__(self, target_s: float, interval_s: float) -> None:
        self.target_s = target_s
        self.interval_s = interval_s
        self.standing = False
        self._above_since: float | None = None  # when the oldest waiting input was first seen too old
        self._ended = -math.inf  # when it last stopped standing
        self._began = math.inf  # when it last began standing
        # Whether it stood as an overload when last observed (:meth:`overload_at`), and when it last
        # stopped doing so.
        self.overload = False
        self._overload_ended = -math.inf
        # The queue has stopped emptying (its head past target_s) while arrivals outpace the model,
        # with no overload in memory: a burst arriving, or an overload's first moments, which look
        # alike until one of them stops.
        self.onset = False
        # Tokens asked for (admitted or refused) in the last ARRIVAL_WINDOW_S: a queue stands only while
        # arrivals go on at least as fast as the model serves (``capacity``, tokens per second).
        self._asked: deque[tuple[float, int]] = deque()
        self._asked_tokens = 0
        self.capacity = math.inf
        # When each input still waiting arrived, in the order they were admitted, were the queue served
        # in that order: as many of the first are let go as inputs have been taken (head_age).
        self._arrivals: deque[float] = deque()
        # Called when standing, overload or onset changes.
        self.listener: Callable[[], None] | None = None
        # How many admitted inputs wait now (the scheduler's queue; by default all of them: none taken).
        self.queued: Callable[[], int] = self._arrivals.__len__

    def recent(self, now: float, intervals: float = MEMORY) -> bool:
        """Whether the queue stands, or stood within the last ``intervals`` intervals (the overload
        may go on: the queue is good only between two refusals of it)."""
        return now < self.recent_until(intervals)

    def recent_until(self, intervals: float = MEMORY) -> float:
        """The time before which :meth:`recent` holds, as things stand (inf while the queue stands): a
        bound to compare many times against, for the price of one call."""
        return math.inf if self.standing else self._ended + intervals * self.interval_s

    def confirmed(self, now: float) -> bool:
        """Whether the queue has stood for :attr:`CONFIRM` whole intervals: an overload, not the
        standing moment of a burst that is still arriving (a starved client takes seconds to send a
        thousand calls, and the queue stands while it does). Only then is what a burst was admitted
        held to the standing bound (:meth:`.admit.Admitter.late`)."""
        return self.standing and now - self._began >= self.CONFIRM * self.interval_s

    def overload_at(self, now: float) -> bool:
        """Whether the queue stands as an overload: :meth:`confirmed`, or standing again within
        :attr:`MEMORY` intervals of having stood as one (a moment's dip in arrivals ended it: the same
        overload, whose confirmation :meth:`confirmed` counts afresh). Such a queue stands through a
        moment with nothing waiting, and its promises count the drain pace (:mod:`.admit`)."""
        return self.standing and (self.confirmed(now)
                                  or now - self._overload_ended < self.MEMORY * self.interval_s)

    def add(self, entries: Iterable[_Admitted]) -> None:
        """Queued inputs, in admission order (only their arrival times are kept: no input is held)."""
        self._arrivals.extend(e.arrival for e in entries)

    def asked(self, tokens: int, now: float) -> None:
        """A request of ``tokens`` tokens arrived (whether admitted or refused)."""
        self._asked.append((now, tokens))
        self._asked_tokens += tokens

    def arrivals(self, now: float) -> float:
        """Tokens per second asked for over the last :data:`ARRIVAL_WINDOW_S`."""
        asked, since = self._asked, now - ARRIVAL_WINDOW_S
        while asked and asked[0][0] < since:
            self._asked_tokens -= asked.popleft()[1]
        return self._asked_tokens / ARRIVAL_WINDOW_S

    def head_age(self, now: float) -> float | None:
        """How far behind the queue is (None: nothing waits): the age of the input first in line were
        it served in admission order, as many inputs on from the first admitted as have been taken
        (batches, drops, withdrawals). Inputs are admitted nearly in head-arrival order (tokenising
        reorders a few), so served in that order it is the oldest waiting one. Served otherwise — the
        newest first while a burst may be arriving (:attr:`.fair.FairQueue.newest_first`), a bulk
        request at its fair share — the oldest input waits on, and its age would say the queue stands
        sooner than it would in order: a burst that stood that much sooner had its callers refused
        while it still arrived, and retries that came back into it refused again."""
        arrivals = self._arrivals
        for _ in range(len(arrivals) - self.queued()):
            arrivals.popleft()
        return now - arrivals[0] if arrivals else None

    def observe(self, now: float) -> bool:
        """Update the regime from the queue as it is at ``now`` (after admissions and dispatches);
        returns whether it is standing."""
        if not (self.standing or self.overload or self.onset or self.queued()):
            # Nothing waits and nothing stood (asked after every dispatch): what the lines below come to.
            self._arrivals.clear()
            self._above_since = None
            return False
        was, was_onset = self.standing, self.onset
        age = self.head_age(now)
        if age is None:  # nothing waits: whatever stood has drained, unless an overload goes on
            self._above_since = None
            if self.standing and not self.overload_at(now):
                self.standing = False
                self._ended = now
        elif age < self.target_s:
            # Young: it keeps emptying, unless it stands and is young only because its late inputs were
            # just dropped or taken (then arrivals decide below).
            self._above_since = None
        elif self._above_since is None:
            self._above_since = now
            # It stood a moment ago (it emptied only by refusing and dropping): the overload goes on,
            # so stand again at once rather than admit another interval's burst (RFC 8289 resumes its
            # dropping state the same way).
            self.standing = self.recent(now)
        elif now - self._above_since >= self.interval_s:
            self.standing = True
        if self.standing and self.arrivals(now) < self.capacity * (LEAVE_BELOW if was else 1.0):
            # Arrivals have fallen below what the model serves: what stands is a burst draining.
            self.standing = False
            if was:  # (a queue that was about to stand and did not has not stood: no memory of it)
                self._ended = now
        if self.standing and not was:
            self._began = now
        overload = self.overload_at(now)
        if self.overload and not overload:
            self._overload_ended = now
        self.onset = (self._above_since is not None and not overload
                      and now - self._overload_ended >= self.MEMORY * self.interval_s
                      and self.arrivals(now) >= self.capacity)
        changed = overload != self.overload or self.standing != was or self.onset != was_onset
        self.overload = overload
        if changed and self.listener is not None:
            self.listener()
        return self.standing


class RetryPacer:
    """Retry-After for refused callers, so that those who honour it are admitted on their retry."""

    # Callers are told to come back a quarter slower than the model is predicted to serve them: batch
    # times vary (padding, the CPU others take), and callers told to come back at exactly the predicted
    # rate arrive, whenever the model runs late, into a queue that stands again and refuses their last
    # retry (tests/unit/test_overload.py: simulated bursts with ±15% batch times lose callers after two
    # retries at 1.0×, none at 1.25×).
    SPACING = 1.25
    # Never tell a caller to come back later than this: the ``openai`` client honours a Retry-After of
    # up to 60 s (two minutes in its 3.x releases) and beyond it backs off on its own (0.5–8 s) or
    # gives up. No shorter: a bound below what a burst needs tells every caller past it the same
    # instant, and they return as one wave that the queue refuses again (with the old 10 s bound, a
    # thousand-chunk burst on a busy CPU lost hundreds of callers after their two retries).
    LONGEST_S = 60.0

    def __init__(self, longest_s: float = LONGEST_S) -> None:
        self.longest_s = longest_s  # never tell a caller to wait longer than this
        self._horizon = 0.0  # when the last caller told to come back was told to

    def after(self, now: float, room_in_s: float, cost_s: float) -> float:
        """Seconds a caller refused at ``now`` should wait: until ``room_in_s`` from now (when the
        queue will have room), and after everyone told before it, whose requests cost ``cost_s`` each."""
        at = max(now + max(room_in_s, 0.0), self._horizon)
        self._horizon = min(at + cost_s * self.SPACING, now + self.longest_s)
        return self._horizon - now
