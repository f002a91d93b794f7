"""The ``longinput`` bench section: inputs longer than the model, chunked against truncated (issue 27).

Texts of 2,000 tokens (the model's own count) are made of real English: the sentences of the Python
licence that every Python installation carries, shuffled per text so no two texts share a window (a
shared window would be computed once, and flatter chunking). Reported, on one server with the result
cache off:

* throughput: closed loop, a few clients each posting one long text at a time, ``long_input``
  ``truncate`` then ``chunk``: tokens embedded per second (``usage``) and texts per second;
* fairness: one-sentence queries open loop at 5/s, alone and beside clients that post long texts
  back to back with ``long_input: chunk``: query p50/p99 from each query's scheduled send time. Target:
  p99 beside the long inputs ≤ 3× alone (a long document's windows are its request's flow, so it must
  not block queries).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from coalesce.loadtests import servers
from coalesce.loadtests.bench_sections import _met, _model_dir, _spec
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.workload import WORDS

TEXT_TOKENS = 2000
QUERY_RATE = 5.0
THROUGHPUT_CLIENTS = 4
LONG_CLIENTS = 2
MODEL = "all-MiniLM-L6-v2"


def real_sentences() -> list[str]:
    """Sentences of real English text the Python installation carries (its licence); generated ones
    from the load generator's word list where it is missing."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    sentences = [s.strip() for s in re.split(r"(?<=[.;:])\s+", " ".join(text.split())) if len(s.split()) > 3]
    if len(sentences) >= 50:
        return sentences
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 24))) + "." for _ in range(400)]


def long_texts(n: int, tokens: int, count: Callable[[str], int], seed: int = 0) -> list[str]:
    """``n`` texts of at most ``tokens`` tokens each (``count`` counts a text's, without special tokens,
    and so a little above its sentences' sum), each the real sentences in an order of its own."""
    sentences = real_sentences()
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        order = sentences[:]
        rng.shuffle(order)
        parts: list[str] = []
        used = 0
        for s in order * (1 + tokens // 200):
            k = count(s)
            if used + k > tokens:
                break
            parts.append(s)
            used += k
        texts.append(" ".join(parts))
    return texts


def _counter() -> Callable[[str], int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(_model_dir()) / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True, slots=True)
class Throughput:
    tokens_per_s: float
    texts_per_s: float
    errors: int


async def _throughput(url: str, texts: list[str], mode: str, seconds: float) -> Throughput:
    tokens = done = errors = 0
    timeout = aiohttp.ClientTimeout(total=max(300.0, 4 * seconds))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + seconds
        last = start

        async def client(k: int) -> None:
            nonlocal tokens, done, errors, last
            i = k
            while loop.time() < end:
                body = {"model": MODEL, "input": texts[i % len(texts)], "long_input": mode}
                i += THROUGHPUT_CLIENTS
                async with session.post(url, json=body) as resp:
                    answer = await resp.json()
                if resp.status != 200:
                    errors += 1
                    continue
                tokens += answer["usage"]["prompt_tokens"]
                done += 1
                last = loop.time()

        await asyncio.gather(*(client(k) for k in range(THROUGHPUT_CLIENTS)))
    elapsed = max(last - start, 1e-9)
    return Throughput(tokens / elapsed, done / elapsed, errors)


@dataclass(frozen=True, slots=True)
class Queries:
    ms: list[float]
    long_texts: int
    errors: int


async def _queries(url: str, texts: list[str], seconds: float, beside: bool, seed: int) -> Queries:
    rng = random.Random(seed)
    ms: list[float] = []
    errors = long_done = 0
    timeout = aiohttp.ClientTimeout(total=max(300.0, 4 * seconds))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        end = start + seconds

        async def post(body: dict[str, object]) -> bool:
            nonlocal errors
            async with session.post(url, json=body) as resp:
                await resp.read()
            if resp.status != 200:
                errors += 1
            return resp.status == 200

        async def long_client(k: int) -> None:
            nonlocal long_done
            i = k
            while loop.time() < end:
                if await post({"model": MODEL, "input": texts[i % len(texts)], "long_input": "chunk"}):
                    long_done += 1
                i += LONG_CLIENTS

        async def query(due: float, n: int) -> None:
            await asyncio.sleep(max(0.0, due - loop.time()))
            words = " ".join(rng.choices(WORDS, k=8))
            if await post({"model": MODEL, "input": f"question {n}: {words}?"}):
                ms.append((loop.time() - due) * 1000)

        tasks = [asyncio.ensure_future(long_client(k)) for k in range(LONG_CLIENTS if beside else 0)]
        t = start
        while (t := t + rng.expovariate(QUERY_RATE)) < end:
            tasks.append(asyncio.ensure_future(query(t, len(tasks))))
        await asyncio.gather(*tasks)
    return Queries(sorted(ms), long_done, errors)


def _pct(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def longinput(args: argparse.Namespace) -> tuple[str, str]:
    out = args.out / "longinput"
    seconds = 30.0 if args.duration >= 20 else float(args.duration)
    texts = long_texts(64, TEXT_TOKENS, _counter())
    spec = _spec(args, "coalesce-longinput", ["--cache-mb", "0", "--log-level", "warning"])
    with servers.running(spec, out / "logs", args.ready_timeout) as srv:
        url = srv.url  # the embeddings route
        asyncio.run(_throughput(url, texts, "chunk", min(3.0, seconds)))  # warm-up, not reported
        cut = asyncio.run(_throughput(url, texts, "truncate", seconds))
        chunked = asyncio.run(_throughput(url, texts, "chunk", seconds))
        alone = asyncio.run(_queries(url, texts, seconds, beside=False, seed=1))
        beside = asyncio.run(_queries(url, texts, seconds, beside=True, seed=2))
    ratio = chunked.tokens_per_s / cut.tokens_per_s if cut.tokens_per_s else None
    a99, b99 = _pct(alone.ms, 0.99), _pct(beside.ms, 0.99)
    p99_ratio = b99 / a99 if a99 and b99 else None
    body = (
        f"Texts of {TEXT_TOKENS:,} tokens (real English: the Python licence's sentences, shuffled per text; "
        f"the result cache off). Throughput: {THROUGHPUT_CLIENTS} clients post one text at a time for "
        f"{seconds:g} s per mode; tokens counted from `usage` (a truncated text embeds 256 of them, a "
        f"chunked one all of them, special tokens of every window included).\n\n"
        + markdown_table(
            ["long_input", "tokens/s", "texts/s", "errors"],
            [
                ["truncate", fmt(cut.tokens_per_s, 0), fmt(cut.texts_per_s, 2), str(cut.errors)],
                ["chunk", fmt(chunked.tokens_per_s, 0), fmt(chunked.texts_per_s, 2), str(chunked.errors)],
            ],
        )
        + f"\n\nChunked ÷ truncated tokens/s: {f'{ratio:.2f}×' if ratio else '-'}.\n\n"
        f"Queries (one sentence, open loop at {QUERY_RATE:g}/s, latency from the scheduled send) alone, "
        f"and beside {LONG_CLIENTS} clients posting long texts back to back with `long_input: chunk`.\n\n"
        + markdown_table(
            ["queries", "p50 ms", "p99 ms", "long texts done", "errors"],
            [
                ["alone", fmt(_pct(alone.ms, 0.5)), fmt(a99), "-", str(alone.errors)],
                ["beside long chunked inputs", fmt(_pct(beside.ms, 0.5)), fmt(b99), str(beside.long_texts),
                 str(beside.errors)],
            ],
        )
        + "\n\nQuery p99 beside long inputs ÷ alone: "
        + (f"{p99_ratio:.2f}× (target ≤ 3×: {_met(p99_ratio <= 3)})" if p99_ratio else "-")
        + ".\n"
    )
    return "Long inputs: chunked against truncated, and queries beside them (CPU)", body
