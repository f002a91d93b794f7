"""Admission that tells a burst from overload, on a real `coalesce serve` with the packaged model: the
three cases of its issue (a RAG ingestion burst from the `openai` client, a mixed burst into an idle
server, a sustained overload), one process and two gateways. Only behaviour is asserted — who was
answered what, with which headers, what the regime gauge said — never a latency or a rate: those live
in the bench's overload section."""

from __future__ import annotations

import asyncio
import collections
import random
import time
from typing import Any

import aiohttp
import openai
import pytest
from coalesce.loadtests.workload import TextSource
from coalesce.service.batching.overload import Regime

from ..conftest import Replica, metric, metrics_text, wait_all_gateways, wait_ready
from . import rawhttp

MODEL = "all-MiniLM-L6-v2"


def texts(n: int, seed: int, shortest: int = 8, longest: int = 60) -> list[str]:
    """``n`` distinct texts of ``shortest`` to ``longest`` words (the result cache cannot answer them)."""
    rng = random.Random(seed)
    source = TextSource(rng)
    return [f"{source.text(rng.randint(shortest, longest))} #{seed}-{i}" for i in range(n)]


async def start(replica: Any, workers: int = 1) -> Replica:
    r: Replica = replica(workers, ["--cache-mb", "0"])
    if workers > 1:
        await wait_all_gateways(r, workers)
    else:
        await wait_ready(r.url, r.proc)
    return r


async def post(s: aiohttp.ClientSession, url: str, text: str, headers: dict[str, str] | None = None
               ) -> tuple[int, dict[str, str], Any]:
    async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": text}, headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


async def test_a_thousand_chunk_ingestion_from_the_openai_client_loses_no_call(replica: Any) -> None:
    # RAG ingestion as people write it: one request per chunk, all under asyncio.gather, the official
    # client with its default two retries. The old admission refused a third of these for good.
    r = await start(replica)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="unused", timeout=120)
    chunks = texts(1000, seed=1, shortest=20, longest=60)

    async def embed(text: str) -> int:
        resp = await client.embeddings.create(model=MODEL, input=text)
        return len(resp.data[0].embedding)

    dims = await asyncio.gather(*(embed(t) for t in chunks), return_exceptions=True)
    failed = [d for d in dims if not isinstance(d, int)]
    assert failed == [], f"{len(failed)} calls failed, e.g. {failed[0]!r}"
    assert set(dims) == {384}
    await client.close()


async def test_a_mixed_burst_into_an_idle_server_is_admitted_whole(replica: Any) -> None:
    r = await start(replica)
    burst = texts(120, seed=2, shortest=3, longest=200)  # one word to a whole paragraph
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        answers = await asyncio.gather(*(post(s, r.url, t) for t in burst))
    assert [status for status, _, _ in answers] == [200] * len(burst)


async def overload(url: str, clients: int, seconds: float, headers: dict[str, str] | None = None,
                   refusal_pause: float = 0.1) -> list[tuple[int, dict[str, str], Any]]:
    """``clients`` callers each sending one request after another for ``seconds`` (a refused one waits
    ``refusal_pause`` before the next): far more than the model serves, for as long as it lasts."""
    answers: list[tuple[int, dict[str, str], Any]] = []
    end = time.monotonic() + seconds
    source = TextSource(random.Random(3))

    async def caller(s: aiohttp.ClientSession, k: int) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            answer = await post(s, url, f"{source.text(3)} caller {k} request {i} " * 3, headers)
            answers.append(answer)
            if answer[0] != 200:
                await asyncio.sleep(refusal_pause)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(caller(s, k) for k in range(clients)))
    return answers


async def head_only(port: int, slow_s: float) -> rawhttp.Answer | None:
    """The answer to a request head announcing a 1 MB body that never comes, the head's last line sent
    ``slow_s`` seconds after its first (a slow link); None if there is none within 5 s of the whole head
    (the server waits for the body)."""
    reader, writer = await rawhttp.connect(port)
    head = rawhttp.request("POST", "/v1/embeddings", headers={
        "Content-Type": "application/json", "Content-Length": str(1 << 20)})
    try:
        writer.write(head[:-4])
        await writer.drain()
        await asyncio.sleep(slow_s)
        writer.write(head[-4:])
        await writer.drain()
        return await rawhttp.read_answer(reader, timeout=5.0, then_eof=False)
    except TimeoutError:
        return None
    finally:
        writer.close()


async def standing(url: str) -> float:
    return metric(await metrics_text(url), "coalesce_queue_standing", MODEL)


async def callers(url: str) -> int:
    """Callers that keep about a second of work waiting (twice the latency target) on this machine: a
    queue that cannot drain, without flooding the HTTP side past what it parses (refused callers pause
    0.1 s before their next request). From the requests 32 callers get answered in 1.5 s."""
    answers = await overload(url, 32, 1.5)
    return max(100, round(sum(1 for status, _, _ in answers if status == 200) / 1.5))


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-gateways"])
async def test_sustained_overload_is_refused_at_once_and_the_regime_recovers(
    replica: Any, workers: int
) -> None:
    r = await start(replica, workers)
    # Callers resending as soon as they are answered: the queue cannot drain, so it stands, and the
    # excess is refused.
    clients = await callers(r.url)
    seen_standing = False
    heads: list[asyncio.Future[rawhttp.Answer | None]] = []
    for _ in range(2):
        load = asyncio.ensure_future(overload(r.url, clients, 8.0))
        while not load.done():
            now_standing = await standing(r.url) == 1
            seen_standing = seen_standing or now_standing
            if now_standing and len(heads) < 20:
                # A head sent while the gauge says it stands, one every 0.2 s while it does. Its time
                # counts from its first byte: half a second on the way, it can no longer have its first
                # result within the standing queue's promise (--max-queue-wait-ms, 500 ms), however short
                # its input. (A head that came at once may be admitted: a head is judged as its smallest
                # first input, and with two gateways the queue ahead is often well under the bound, as
                # the time requests spend in a gateway before the engine admits them counts too. The
                # queue may also stop standing a moment later. An admitted head is left waiting for its
                # body.)
                heads.append(asyncio.ensure_future(head_only(r.port, slow_s=0.5)))
            await asyncio.sleep(0.2)
        answers = load.result()
        if seen_standing:
            break
        # The queue never stood: the load was not the sustained overload this test is about (the
        # callers come from a 1.5 s probe, and in one clean-clone CI run the queue never stood in the 8
        # s). Twice the callers, once: under that it must stand.
        clients *= 2
    unread = list(await asyncio.gather(*heads))
    # (What the last load got, to tell a server that did not stand from callers that could not keep up:
    # it failed once in two whole-suite runs beside two busy loops, never alone beside them.)
    statuses = collections.Counter(status for status, _, _ in answers)
    assert seen_standing, f"the queue never stood: {clients} callers for 8 s got {dict(statuses)}"
    # Bulk uploads' heads while the queue stands: those the standing queue refuses are refused from the
    # head alone, so their callers need not send the megabyte. Had the server waited for the bodies, no
    # head would have been answered (408 only after --body-timeout-s, 30 s).
    refused = [a for a in unread if a is not None]
    assert refused and {a.status for a in refused} == {429}
    # Judged once the head is whole, half a second after the gauge said the queue stood: refused as a
    # standing queue's (overloaded), or as a burst's past its bound (queue_full) if it had stopped standing
    # meanwhile, which two forwards side by side, draining it faster, make more frequent.
    codes = [(a.json()["error"]["code"], a.headers.get("retry-after")) for a in refused]
    assert all(code in ("overloaded", "queue_full") and int(after or 0) >= 1 for code, after in codes), codes
    refused = [(h, body) for status, h, body in answers if status == 429]
    assert {status for status, _, _ in answers} <= {200, 429}  # every request answered, none failed
    assert refused and any(body["error"]["code"] == "overloaded" for _, body in refused)
    for headers, body in refused:
        assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 1
        assert body["error"]["type"] == "rate_limit_error"
    text = await metrics_text(r.url)
    assert metric(text, "coalesce_rejected_total", MODEL, reason="overloaded") > 0
    # Once the load stops, the queue drains and the regime is good again: a new burst is a burst.
    deadline = time.monotonic() + 30
    while await standing(r.url) != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await standing(r.url) == 0
    # A queue that grows old again within eight intervals of standing stands at once (the overload
    # may be going on): a new burst is a burst once that memory has passed.
    await asyncio.sleep(Regime.MEMORY * 0.5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        after = await asyncio.gather(*(post(s, r.url, t) for t in texts(120, seed=4)))
    assert [status for status, _, _ in after] == [200] * 120


async def test_a_refused_low_priority_flood_does_not_refuse_high_priority_queries(replica: Any) -> None:
    r = await start(replica, 2)  # the engine decides for both gateways
    flood = asyncio.ensure_future(overload(r.url, await callers(r.url), 8.0, {"X-Priority": "low"}))
    await asyncio.sleep(2.0)  # the flood stands by now
    queries: list[tuple[int, Any]] = []
    async with aiohttp.ClientSession() as s:
        while not flood.done():
            status, _, body = await post(s, r.url, f"how do plants make oxygen {len(queries)}",
                                         {"X-Priority": "high"})
            queries.append((status, body))
            await asyncio.sleep(0.1)
    low = [status for status, _, _ in flood.result()]
    assert low.count(429) > 0  # the flood was shed...
    assert queries and [q for q in queries if q[0] != 200] == []  # ...and not one query was
