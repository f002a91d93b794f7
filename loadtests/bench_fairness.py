"""The ``fairness`` bench section: bulk ingestion beside interactive queries (issue 17's measure).

One client sends bulk requests of 512 short chunks back to back (a RAG pipeline indexing) while
single-sentence queries arrive open-loop at 5/s (people searching). Each server runs three phases of the
same length: queries alone, bulk alone, both together. Reported: query p50/p99 (from each query's
scheduled send time, so a queue shows) and bulk inputs/s, for Coalesce with its default batching,
Coalesce ``--batching fixed`` (first come, first served within a window, like the peers), and Infinity
when installed. Targets: query p99 together ≤ 3× alone; bulk inputs/s together ≥ 0.9× alone.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from coalesce.loadtests import servers
from coalesce.loadtests.bench_sections import _met, _model_dir, _spec
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.workload import WORDS

BULK_CHUNKS = 512
QUERY_RATE = 5.0
MODEL = "all-MiniLM-L6-v2"


@dataclass(frozen=True, slots=True)
class Phase:
    query_ms: list[float]  # each query's latency from its scheduled send
    bulk_inputs_per_s: float | None
    errors: int


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


async def _phase(url: str, seconds: float, queries: bool, bulk: bool, seed: int) -> Phase:
    """Run queries and/or bulk requests against ``url`` (an embeddings URL) for ``seconds``."""
    rng = random.Random(seed)
    query_ms: list[float] = []
    errors = 0
    chunks_done = 0
    last_done = 0.0
    timeout = aiohttp.ClientTimeout(total=max(300.0, 4 * seconds))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + seconds

        async def post(inputs: str | list[str]) -> bool:
            nonlocal errors
            async with session.post(url, json={"model": MODEL, "input": inputs}) as resp:
                await resp.read()
                if resp.status != 200:
                    errors += 1
                return resp.status == 200

        async def bulk_client() -> None:
            nonlocal chunks_done, last_done
            n = 0
            while loop.time() < end:
                chunks = [
                    f"document {n} part {i}: {_text(rng, rng.randint(10, 20))}" for i in range(BULK_CHUNKS)
                ]
                n += 1
                if await post(chunks):
                    chunks_done += BULK_CHUNKS
                    last_done = loop.time()

        async def query(due: float, text: str) -> None:
            await asyncio.sleep(max(0.0, due - loop.time()))
            if await post(text):
                query_ms.append((loop.time() - due) * 1000)

        tasks = []
        if bulk:
            tasks.append(asyncio.ensure_future(bulk_client()))
        if queries:
            t = start
            while (t := t + rng.expovariate(QUERY_RATE)) < end:
                tasks.append(asyncio.ensure_future(query(t, f"question {len(tasks)}: {_text(rng, 8)}?")))
        await asyncio.gather(*tasks)
    # Bulk throughput: the chunks of every request completed, over the time to the last completion (a
    # request cut by the end of the phase would otherwise round the rate down by a whole request).
    rate = chunks_done / (last_done - start) if bulk and chunks_done else None
    return Phase(sorted(query_ms), rate, errors)


def _pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def _measure(spec: servers.ServerSpec, out: Path, seconds: float, ready_timeout: float) -> dict[str, Phase]:
    with servers.running(spec, out / "logs", ready_timeout) as srv:
        asyncio.run(_phase(srv.url, 3.0, True, True, seed=0))  # warm-up, not reported
        return {
            "alone": asyncio.run(_phase(srv.url, seconds, True, False, seed=1)),
            "bulk": asyncio.run(_phase(srv.url, seconds, False, True, seed=2)),
            "together": asyncio.run(_phase(srv.url, seconds, True, True, seed=3)),
        }


def fairness(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "fairness"
    seconds = 30.0 if args.duration >= 20 else float(args.duration)
    specs = [
        ("coalesce (default)", _spec(args, "coalesce", ["--log-level", "warning"])),
        (
            # The trade-off the default makes: bulk batches of 20 ms, not 50, on the same load.
            "coalesce --interactive-batch-ms 20",
            _spec(args, "coalesce-ib20", ["--interactive-batch-ms", "20", "--log-level", "warning"]),
        ),
        (
            "coalesce --batching fixed",
            _spec(args, "coalesce-fixed", ["--batching", "fixed", "--log-level", "warning"]),
        ),
    ]
    binary = Path(args.infinity_bin)
    if binary.exists():
        specs.append(("infinity", servers.infinity_spec(str(binary), _model_dir(), MODEL)))
    rows, figures = [], []
    for name, spec in specs:
        try:
            r = _measure(spec, out, seconds, args.ready_timeout)
        except servers.ServerError as exc:
            rows.append([name, "failed", str(exc).splitlines()[0], "", "", "", ""])
            continue
        alone99, together99 = _pct(r["alone"].query_ms, 0.99), _pct(r["together"].query_ms, 0.99)
        bulk_alone, bulk_together = r["bulk"].bulk_inputs_per_s, r["together"].bulk_inputs_per_s
        p99_ratio = together99 / alone99 if together99 and alone99 else None
        bulk_ratio = bulk_together / bulk_alone if bulk_together and bulk_alone else None
        rows.append(
            [
                name,
                fmt(_pct(r["alone"].query_ms, 0.5)),
                fmt(alone99),
                fmt(_pct(r["together"].query_ms, 0.5)),
                fmt(together99),
                fmt(bulk_alone, 0),
                fmt(bulk_together, 0),
                str(sum(p.errors for p in r.values())),
            ]
        )
        figures.append(
            [
                name,
                f"{p99_ratio:.2f}× ({_met(p99_ratio <= 3)})" if p99_ratio else "-",
                f"{bulk_ratio:.2f}× ({_met(bulk_ratio >= 0.9)})" if bulk_ratio else "-",
            ]
        )
    missing = (
        ""
        if binary.exists()
        else f" Infinity was not run: no executable at `{binary}` (see the peers section)."
    )
    body = (
        f"One client sends bulk requests of {BULK_CHUNKS} short chunks back to back while one-sentence "
        f"queries arrive open loop at {QUERY_RATE:g}/s; each server runs {seconds:g} s of queries alone, "
        f"of bulk alone, and of both together (after a 3 s warm-up). Query latency counts from each "
        f"query's scheduled send time. No tenant, no priority header: the default a user gets.{missing}\n\n"
        + markdown_table(
            [
                "server",
                "query p50 alone",
                "query p99 alone",
                "query p50 with bulk",
                "query p99 with bulk",
                "bulk inputs/s alone",
                "bulk inputs/s with queries",
                "errors",
            ],
            rows,
        )
        + "\n\n"
        + markdown_table(
            [
                "server",
                "query p99 with bulk ÷ alone (target ≤ 3×)",
                "bulk inputs/s with queries ÷ alone (target ≥ 0.9×)",
            ],
            figures,
        )
        + "\n"
    )
    return "Fairness: bulk ingestion beside interactive queries (CPU)", body
