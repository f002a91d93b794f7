"""The engine's turn (``engine/server.py``'s ``Turn``): every gateway's messages read in one event-loop
turn are admitted in one pass, each answer goes back to the gateway that asked, and a message that acts
on earlier jobs of the same turn — a cancellation, the gateway's loss — still finds them. The engine's
real path (messages, admission, batcher, device thread) with a forward that costs nothing."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from coalesce.loadtests.nullmodel import factory
from coalesce.service.engine import messages as wire
from coalesce.service.engine.core import Engine
from coalesce.service.engine.server import GatewayLink, Turn, _offer
from coalesce.service.metrics import Metrics
from coalesce.service.settings import Settings


class Rig:
    """An engine and gateways' links sharing one turn, their sockets never bound: what each link
    would have sent is decoded into ``answered`` ((gateway, job id) → rows) and ``failed``
    ((gateway, job id) → the error's kind)."""

    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics, gateways: int, tmp: str) -> None:
        self.engine = engine
        self.turn = Turn(engine)
        self.links = [GatewayLink(g, wire.endpoint(tmp, g), engine, metrics, self.turn)
                      for g in range(gateways)]
        self.answered: dict[tuple[int, int], int] = {}
        self.failed: dict[tuple[int, int], str] = {}
        self.changed = asyncio.Event()
        offers = [_offer(m, settings) for m in engine.models]
        for link in self.links:
            link.welcome(offers)
            link._send = self._sender(link.index)  # type: ignore[method-assign]
        self.batches: list[int] = []  # the requests of each enqueue_many call
        batcher = engine.models[0].batcher
        enqueue_many = batcher.enqueue_many

        def spy(requests: Any, reply: Any) -> Any:
            self.batches.append(len(requests))
            return enqueue_many(requests, reply)

        batcher.enqueue_many = spy  # type: ignore[method-assign]

    def _sender(self, gateway: int) -> Any:
        def send(parts: list[Any]) -> None:
            msg = wire.gateway_decoder.decode(parts[0])
            if isinstance(msg, wire.Results):
                for done in msg.done:
                    assert (gateway, done.id) not in self.answered, f"job {done.id} answered twice"
                    self.answered[gateway, done.id] = done.n
                for failed in msg.failed:
                    self.failed[gateway, failed.id] = failed.error.kind
                self.changed.set()
        return send

    def submit(self, gateway: int, ids: list[int], words: int = 1) -> None:
        """One message from ``gateway``: a job per id, ``words`` distinct one-word sequences each."""
        jobs, sizes, frames = [], [], []
        deadline = time.monotonic() + 60
        for job_id in ids:
            seqs = [[101, 2000 + 97 * job_id + w, 102] for w in range(words)]
            marked, frame = wire.pack_job(seqs)  # as the gateway packs it
            jobs.append(wire.Job(job_id, 0, words, marked, "default", 1.0, 1, deadline))
            sizes.append(len(frame) // 4)
            frames.append(frame)
        self.links[gateway]._on_message([memoryview(wire.encoder.encode(wire.Submit(jobs, sizes))),
                                         memoryview(b"".join(frames))])

    def cancel(self, gateway: int, ids: list[int]) -> None:
        self.links[gateway]._on_message([memoryview(wire.encoder.encode(wire.Cancel(ids)))])

    async def until(self, ids: set[tuple[int, int]]) -> None:
        """Every one of ``ids`` ((gateway, job id)) answered or failed (5 s at most)."""
        async def wait() -> None:
            while not ids <= set(self.answered) | set(self.failed):
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), 5)


@pytest.fixture
async def rig(minilm_path: str) -> AsyncIterator[Rig]:
    settings = Settings(cache_mb=0, runner_factory="coalesce.loadtests.nullmodel:factory")
    metrics = Metrics()
    engine = Engine(settings, metrics, factory)
    await engine.load()
    with tempfile.TemporaryDirectory() as tmp:
        r = Rig(engine, settings, metrics, 3, tmp)
        yield r
        for link in r.links:
            link.close()
    await engine.close()


async def test_messages_of_one_turn_from_every_gateway_are_admitted_together(rig: Rig) -> None:
    rig.submit(0, [1, 2])
    rig.submit(1, [1])  # the same job id as gateway 0's: ids are each gateway's own
    rig.submit(2, [7, 8, 9], words=3)
    assert rig.batches == []  # nothing admitted until the turn's reads are over
    await rig.until({(0, 1), (0, 2), (1, 1), (2, 7), (2, 8), (2, 9)})
    assert rig.batches == [6]  # one admission pass for the three messages
    assert rig.failed == {}
    # Each answer to the gateway that asked, with that job's own rows.
    assert rig.answered == {(0, 1): 1, (0, 2): 1, (1, 1): 1, (2, 7): 3, (2, 8): 3, (2, 9): 3}


async def test_each_gateway_gets_its_own_answers(rig: Rig) -> None:
    seen: dict[int, list[int]] = {0: [], 1: []}
    for g in (0, 1):
        send = rig.links[g]._send

        def record(parts: list[Any], g: int = g, send: Any = send) -> None:
            msg = wire.gateway_decoder.decode(parts[0])
            if isinstance(msg, wire.Results):
                seen[g] += [d.id for d in msg.done]
            send(parts)

        rig.links[g]._send = record  # type: ignore[method-assign]
    rig.submit(0, [10, 11])
    rig.submit(1, [20])
    await rig.until({(0, 10), (0, 11), (1, 20)})
    assert sorted(seen[0]) == [10, 11] and seen[1] == [20]


async def test_a_job_cancelled_in_the_turn_it_arrived_in_is_never_answered(rig: Rig) -> None:
    rig.submit(0, [1, 2, 3])
    rig.cancel(0, [2])  # same turn: the job is not admitted yet when the cancellation is read
    await rig.until({(0, 1), (0, 3)})
    rig.submit(0, [4])  # a later job: once it is answered, a computed job 2 would have been too
    await rig.until({(0, 4)})
    assert set(rig.answered) == {(0, 1), (0, 3), (0, 4)} and rig.failed == {}


async def test_a_gateway_lost_in_the_turn_of_its_message_has_its_jobs_dropped(rig: Rig) -> None:
    rig.submit(1, [50, 51])
    rig.submit(0, [5])
    rig.links[1]._on_lost()  # its socket closed in the same turn
    await rig.until({(0, 5)})
    rig.submit(0, [6])
    await rig.until({(0, 6)})
    assert set(rig.answered) == {(0, 5), (0, 6)}  # gateway 1's jobs never computed, never answered
    assert rig.links[1]._jobs == {}


async def test_an_admission_that_breaks_fails_the_turns_jobs_instead_of_stranding_them(rig: Rig) -> None:
    batcher = rig.engine.models[0].batcher

    def broken(requests: Any, reply: Any) -> Any:
        raise RuntimeError("a bug")

    batcher.enqueue_many = broken  # type: ignore[method-assign]
    rig.submit(0, [1])
    rig.submit(1, [2])
    await rig.until({(0, 1), (1, 2)})
    assert rig.failed == {(0, 1): "CoalesceError", (1, 2): "CoalesceError"}
