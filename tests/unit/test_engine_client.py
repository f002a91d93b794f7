"""A gateway reading the engine's replies: each request gets its own rows out of the message's one
frame, and a frame that does not hold what the message says fails those requests, loudly, never with
someone else's rows."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from coalesce.service.engine import messages as wire
from coalesce.service.errors import InferenceFailed, Overloaded
from coalesce.service.gateway.remote import EngineClient


async def _waiting(client: EngineClient, ids: list[int]) -> list[asyncio.Future[Any]]:
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in ids]
    client._waiting.update(zip(ids, futures, strict=True))
    return futures


async def test_one_reply_answers_each_request_with_its_own_rows_and_refusals() -> None:
    client = EngineClient("/nonexistent.sock", 0, lambda _: None)
    try:
        one, two, refused = await _waiting(client, [1, 2, 3])
        rows = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
        full = wire.failure(Overloaded("full", retry_after=1, code="queue_full"))
        msg = wire.Results([wire.Done(2, 2, 4, 0.1, 0.2), wire.Done(1, 1, 4, 0.0, 0.0)],
                           [wire.Failed(3, full)], [])
        client._results(msg, [memoryview(rows.tobytes())])
        np.testing.assert_array_equal(two.result().rows, rows[:2])
        np.testing.assert_array_equal(one.result().rows, rows[2:])
        assert two.result().queue_s == 0.1
        assert isinstance(refused.exception(), Overloaded)
    finally:
        await client.close()


async def test_rows_that_do_not_match_the_reply_fail_its_requests() -> None:
    client = EngineClient("/nonexistent.sock", 0, lambda _: None)
    try:
        (one,) = await _waiting(client, [1])
        msg = wire.Results([wire.Done(1, 2, 4, 0.0, 0.0)], [], [])
        client._results(msg, [memoryview(np.zeros(4, dtype=np.float32).tobytes())])  # one row, not two
        exc = one.exception()
        assert isinstance(exc, InferenceFailed) and "cannot read" in exc.message
    finally:
        await client.close()
