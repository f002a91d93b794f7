"""Bulk ingestion never blocks interactive queries, on the real model: a one-sentence query sent once a
2,048-chunk request's first batch has run is answered long before that request finishes (the request is a
flow of its own; the query's joins the next batch), with no tenant or priority set. The queue lives in
the engine, so the same holds through two gateways."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from coalesce.service.settings import build

from ..conftest import Replica, metric, wait_all_gateways

MODEL = "all-MiniLM-L6-v2"

CHUNKS = [f"chunk {i} of a long document about rivers, mountains and the towns on them" for i in range(2048)]


async def _bulk_then_query(url: str) -> tuple[float, float]:
    """(seconds the bulk request took, seconds the query took, sent once the bulk's first batch ran: not
    after a fixed time, which a fast machine spends on the whole request and a slow one on tokenising)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:

        async def batches() -> float:
            async with s.get(url + "/metrics") as r:
                return metric(await r.text(), "coalesce_batches_total", MODEL)

        async def embed(inputs: Any) -> float:
            t0 = time.monotonic()
            async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": inputs}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            return time.monotonic() - t0

        before = await batches()
        bulk = asyncio.ensure_future(embed(CHUNKS))
        for _ in range(1200):  # at most 60 s
            if await batches() > before or bulk.done():
                break
            await asyncio.sleep(0.05)
        assert not bulk.done(), "the bulk request must still be running when the query arrives"
        query = await embed("how do rivers shape the towns along them?")
        assert not bulk.done(), "the query must not wait for the bulk request"
        return await bulk, query


# The bulk request is tens of seconds of work on a busy 2-core machine: a deadline that outlives it.
SLOW_MACHINE = ["--request-timeout-ms", "300000"]


@pytest.fixture(autouse=True)
def one_intra_op_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forwards on one thread, here and in the engine a test starts: with two on a 2-core machine whose
    other core is busy, every forward waits on a descheduled OpenMP thread and the bulk request takes
    minutes (past any sensible deadline) instead of seconds. The comparison holds either way."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


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
