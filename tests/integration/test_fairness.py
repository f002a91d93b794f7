"""Bulk ingestion never blocks interactive queries, on the real model: a one-sentence query sent while a
2,048-chunk request is being embedded is answered long before that request finishes (the request is a
flow of its own; the query's joins the next batch), with no tenant or priority set. The queue lives in
the engine, so the same holds through two gateways."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from coalesce.service.settings import build

from ..conftest import Replica, wait_all_gateways

MODEL = "all-MiniLM-L6-v2"

CHUNKS = [f"chunk {i} of a long document about rivers, mountains and the towns on them" for i in range(2048)]


async def _bulk_then_query(url: str) -> tuple[float, float]:
    """(seconds the bulk request took, seconds the query sent 1 s into it took)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:

        async def embed(inputs: Any) -> float:
            t0 = time.monotonic()
            async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": inputs}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return time.monotonic() - t0

        bulk = asyncio.ensure_future(embed(CHUNKS))
        await asyncio.sleep(1.0)
        assert not bulk.done(), "the bulk request must still be running when the query arrives"
        query = await embed("how do rivers shape the towns along them?")
        assert not bulk.done(), "the query must not wait for the bulk request"
        return await bulk, query


# The bulk request is tens of seconds of work on a busy 2-core machine: a deadline that outlives it.
SLOW_MACHINE = ["--request-timeout-ms", "300000"]


async def test_a_query_is_not_stuck_behind_a_bulk_request(serve: Any) -> None:
    srv = serve(build(SLOW_MACHINE, environ={}))
    bulk, query = await _bulk_then_query(srv.url)
    assert query < bulk / 3, (query, bulk)


@pytest.mark.parametrize("workers", [2])
async def test_the_same_holds_through_two_gateways(replica: Any, workers: int) -> None:
    r: Replica = replica(workers, ["--log-level", "warning", *SLOW_MACHINE])
    await wait_all_gateways(r)
    bulk, query = await _bulk_then_query(r.url)
    assert query < bulk / 3, (query, bulk)
