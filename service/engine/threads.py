"""The CPU forward's thread count, measured: on every core, or on one fewer when that runs faster.

torch runs each operator of a CPU forward on OpenMP threads, one per core, and an operator ends when its
slowest thread does. When something else keeps one of those cores busy — a neighbour on a shared host,
the gateway processes of ``--workers``, a build — the thread on that core runs only in the time slices
the kernel gives it, and every operator of the forward waits for it: on 2 cores with one kept busy, a
lone one-sentence request to one process with ``--cpu-forwards 1`` took a third of a second, where one
thread alone ran it in a few milliseconds (``python -m coalesce.loadtests.neighbour``; BENCHMARKS.md,
issue 25). ``LoopShare`` (kernels/worker.py) judges the service's own load — the event loop's busy share,
or the engine's forward's — and leaves them a thread under it; it cannot see a neighbour, and at a light
load it gives the thread back. This module watches the forward itself.

Each model's cost model keeps a fit per thread count (:meth:`.CostModel.use`), both seeded at start
(``core.Engine.load``: the seed batches once more on one thread fewer). :class:`ThreadChooser` reads
every batch's forward against them:

* on every core, a batch that took more than :data:`SLOWER` times what the same batch is predicted to
  take on one thread fewer, and :data:`MIN_GAP_S` more, counts; :data:`SLOW_BATCHES` in a row cap the
  forward at one thread fewer (a single slow batch — a collection, a page fault — is not a busy core).
  The seeds on every core are read so too, so a server that starts beside a busy core starts capped;
* capped, a probe: one batch now and then runs on every core (``LoopShare.probe``), first
  :data:`PROBE_FIRST_S` after the cap, then twice as long after each probe that ran slower than the
  fewer threads are predicted to run it, up to :data:`PROBE_MAX_S`, and at once when batches grow
  :data:`GROWN` times past the one that last lost. A probe that ran no slower lifts the cap. While the
  neighbour stays, the probe is the one slow batch in :data:`PROBE_MAX_S`.

The rule is the forward's speed, not a busy core as such: where a forward on every core is the slower
one with every core free — on the 2-core VM of issue 25 a lone request on both threads took about three
times as long as on one (the neighbour bench, every core free), its threads waking for every operator —
the cap comes at a light load too, and batches that grow lift it. A batch of hundreds of tokens runs
faster on every free core than on fewer, well under :data:`SLOWER`; beside a busy core, many times
slower, far past it. Event loop only; pure but for the clock it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from ..batching.cost import CostModel

SLOWER = 1.5
# ...and by more than this: a forward slower by less is not worth a thread, nor is a probe's risk (a
# forward of microseconds — a test's, the null model's — is 1.5 times slower by noise alone).
MIN_GAP_S = 0.002
SLOW_BATCHES = 2
PROBE_FIRST_S = 5.0
PROBE_MAX_S = 60.0
GROWN = 4


class Share(Protocol):
    """What the chooser drives (``kernels.worker.LoopShare`` fits)."""

    cores: int
    cap: int

    def limit(self, cap: int) -> None: ...

    def probe(self, threads: int) -> None: ...


class ThreadChooser:
    """Caps a CPU forward at one thread fewer while that runs faster (the module's docstring)."""

    def __init__(self, share: Share, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.all = share.cores
        self.fewer = share.cores - 1
        self._clock = clock
        self._slow = 0  # batches on every core in a row that ran past SLOWER × the fewer threads'
        self._probe_every = PROBE_FIRST_S
        self._probe_at = 0.0
        self._probed = False  # a probe is asked for and its batch not yet seen
        self._lost = 0  # the padded tokens of the batch that last lost on every core

    @property
    def capped(self) -> bool:
        return self.share.cap < self.all

    def forwarded(self, cost: CostModel, threads: int, padded: int, seconds: float) -> None:
        """A batch of ``padded`` tokens ran on ``threads`` in ``seconds`` (``cost``: its model's, which has
        observed it); after it, the next batch may be a probe."""
        fewer = cost.predict_at(self.fewer, padded) if threads == self.all else None
        if fewer is not None:
            if self.capped:  # the probe's batch
                self._probed = False
                if seconds <= fewer:
                    self._slow = 0
                    self.share.limit(self.all)
                    return
                self._probe_every = min(2 * self._probe_every, PROBE_MAX_S)
                self._probe_at = self._clock() + self._probe_every
                self._lost = padded
            elif seconds > SLOWER * fewer and seconds - fewer > MIN_GAP_S:
                self._slow += 1
                if self._slow >= SLOW_BATCHES:
                    self._slow = 0
                    self._probe_every = PROBE_FIRST_S
                    self._probe_at = self._clock() + PROBE_FIRST_S
                    self._lost = padded
                    self.share.limit(self.fewer)
            else:
                self._slow = 0
        elif threads != self.all and self._probed:  # (the probe's batch failed: asked for again in time)
            self._probed = False
            self._probe_at = self._clock() + self._probe_every
        elif threads != self.all and self.capped and padded > GROWN * self._lost:
            # Batches far larger than the one that lost: more threads may pay now (a tiny forward on every
            # core can lose to one thread fewer with every core free). Probe at once, and soon again.
            self._probe_every = PROBE_FIRST_S
            self._probe_at = 0.0
        if self.capped and not self._probed and self._clock() >= self._probe_at:
            self._probed = True
            self.share.probe(self.all)


def chooser(share: Share) -> ThreadChooser | None:
    """The chooser for a ``LoopShare`` of a forward on more than one thread (else None)."""
    return ThreadChooser(share) if share.cores > 1 else None
