"""The result cache on the real model: a repeated input is answered from the cache with the same
vector and the same usage, different prompts or truncation never share an entry, and ``--cache-mb 0``
turns it off."""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
from coalesce.service.settings import build

from ..conftest import ServerThread

MODEL = "all-MiniLM-L6-v2"


def _metric(text: str, name: str) -> float:
    return sum(
        float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith((name + "{", name + " "))
    )


async def _embed(url: str, body: dict[str, Any]) -> tuple[np.ndarray, int]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/embeddings", json={"model": MODEL, **body}) as r,
    ):
        assert r.status == 200
        got = await r.json()
    return np.asarray([d["embedding"] for d in got["data"]]), got["usage"]["prompt_tokens"]


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def test_a_repeated_input_is_a_hit_with_the_same_answer(serve: Any) -> None:
    srv: ServerThread = serve(build([], environ={}))
    first, tokens = await _embed(srv.url, {"input": ["cached sentence", "another one"]})
    again, tokens_again = await _embed(srv.url, {"input": ["another one", "cached sentence"]})
    np.testing.assert_array_equal(again[::-1], first)
    assert tokens_again == tokens, "usage counts every input, hit or not"
    text = await _metrics(srv.url)
    assert _metric(text, "coalesce_cache_hits_total") == 2
    assert _metric(text, "coalesce_inputs_total") == 2, "the hits never reached the model"
    assert _metric(text, "coalesce_cache_bytes") > 0
    # Truncated to other dimensions: the cached full-width row serves it (cut and re-normalised).
    cut, _ = await _embed(srv.url, {"input": "cached sentence", "dimensions": 64})
    np.testing.assert_allclose(cut[0], first[0][:64] / np.linalg.norm(first[0][:64]), rtol=1e-5)
    assert _metric(await _metrics(srv.url), "coalesce_cache_hits_total") == 3


async def test_cache_off_computes_every_request(serve: Any) -> None:
    srv: ServerThread = serve(build(["--cache-mb", "0"], environ={}))
    first, _ = await _embed(srv.url, {"input": "not cached"})
    again, _ = await _embed(srv.url, {"input": "not cached"})
    np.testing.assert_allclose(again, first, rtol=1e-5)
    text = await _metrics(srv.url)
    assert _metric(text, "coalesce_cache_hits_total") == 0
    assert _metric(text, "coalesce_inputs_total") == 2
