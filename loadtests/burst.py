"""RAG ingestion as people write it, against any OpenAI-compatible server: the official ``openai``
client (its default two retries, which honour ``Retry-After``), one request per chunk, every chunk under
one ``asyncio.gather``. Prints one JSON line: calls, failures (after the client's retries) by kind,
wall seconds.

    python -m coalesce.loadtests.burst http://127.0.0.1:8080 --chunks 1000

The base URL is the one the client is given (the server must answer ``POST {base}/embeddings``).
Run it in a process of its own, as the bench does, so that its client's CPU is not the caller's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from coalesce.loadtests.workload import TextSource


def chunks(n: int, seed: int = 1) -> list[str]:
    """``n`` distinct chunks of 20 to 60 words (a result cache cannot answer any of them)."""
    rng = random.Random(seed)
    source = TextSource(rng)
    return [f"{source.text(rng.randint(20, 60))} (chunk {seed}-{i})" for i in range(n)]


async def ingest(base_url: str, model: str, texts: list[str], timeout: float) -> dict[str, object]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout)

    async def embed(text: str) -> str | None:
        try:
            await client.embeddings.create(model=model, input=text)
            return None
        except openai.APIError as exc:
            return type(exc).__name__

    t0 = time.perf_counter()
    outcomes = await asyncio.gather(*(embed(t) for t in texts))
    wall = time.perf_counter() - t0
    await client.close()
    failed: dict[str, int] = {}
    for kind in outcomes:
        if kind is not None:
            failed[kind] = failed.get(kind, 0) + 1
    return {"calls": len(texts), "failed": sum(failed.values()), "failed_by_kind": failed, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base_url")
    p.add_argument("--chunks", type=int, default=1000)
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="the client's per-call timeout (its default)")
    args = p.parse_args(argv)
    result = asyncio.run(ingest(args.base_url, args.model, chunks(args.chunks, args.seed), args.timeout))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
