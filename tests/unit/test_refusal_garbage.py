"""What a refused request leaves behind: nothing for the garbage collector.

Under a sustained overload most requests are refused, so whatever a refusal leaves in a reference
cycle piles up for the collector, whose full passes stop the event loop every admitted request waits
on. A refusal decided after tokenising (the queue filled within the turn) was raised in the batcher,
kept as a value and set on the caller's future; its traceback held the frames down to the batcher and
through them the turn's other requests and their futures, which hold the error: about fifty objects
per refusal (the first test below found 1,151 after its 21 refusals on the code before).
"""

from __future__ import annotations

import asyncio
import gc

from coalesce.service.batching.batcher import Submission
from coalesce.service.errors import CoalesceError
from coalesce.service.gateway.app import create_app
from coalesce.service.settings import build

from ..fakes import FakeRunner, ready_client
from .test_batcher import Rig as BatcherRig


async def test_requests_refused_after_tokenising_leave_nothing_for_the_collector() -> None:
    # A queue of 48 tokens and a forward that holds it: of each wave of 12 requests of about 8 tokens
    # sent together (one turn: every one passes the check before tokenising), a few are admitted and
    # the rest refused when the turn is handed to the batcher.
    app = create_app(build(["--max-queued-tokens", "48"], environ={}),
                     lambda spec: FakeRunner(batch_seconds=0.3))
    client = await ready_client(app)
    try:

        async def wave(k: int) -> list[int]:
            async def one(i: int) -> int:
                body = {"model": "fake", "input": f"wave {k} request {i} of some words"}
                async with client.post("/v1/embeddings", json=body) as resp:
                    await resp.read()
                    return resp.status
            return list(await asyncio.gather(*(one(i) for i in range(12))))

        await wave(0)  # (the first of everything: imports, caches, the client's pool)
        gc.collect()
        gc.disable()
        try:
            statuses = [s for k in range(1, 4) for s in await wave(k)]
            left = gc.collect()
        finally:
            gc.enable()
        refused = statuses.count(429)
        assert refused >= 12 and statuses.count(200) + refused == len(statuses), statuses
        assert left < 2 * refused, f"{left} objects in reference cycles after {refused} refusals"
    finally:
        await client.close()


async def test_a_message_s_refusals_leave_nothing_for_the_collector() -> None:
    # The engine's path (--workers): a message's requests are admitted or refused as values, which the
    # engine sends back to the gateway; refused, one kept its traceback and with it the frames that
    # held the message's outcomes, the refusal among them.
    rig = BatcherRig(FakeRunner(batch_seconds=0.3), max_queued_tokens=48)
    try:
        def reply(tag: object, outcome: object) -> None:
            pass

        def message(k: int) -> list[Submission]:
            return [Submission(rig.seqs(f"message {k} request {i} of some words"), (k, i)) for i in range(12)]

        def admit(k: int) -> int:  # (as the engine's turn: the outcomes go out, the frame ends)
            outcomes = rig.batcher.enqueue_many(message(k), reply)
            return sum(isinstance(o, CoalesceError) for o in outcomes)

        admit(0)
        gc.collect()
        gc.disable()
        try:
            refused = admit(1)
            left = gc.collect()
        finally:
            gc.enable()
        assert refused >= 6
        assert left == 0, f"{left} objects in reference cycles after {refused} refusals"
    finally:
        await rig.aclose()
