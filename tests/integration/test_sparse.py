"""Sparse vectors: a SPLADE-style ``SparseEncoder`` is detected as task ``sparse`` and served at TEI's
``POST /embed_sparse`` (non-zero weights only) equal to ``SparseEncoder.encode``; its inputs batch like
every other; the embedding routes point a caller to the right route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.kernels.hf_runners import detect_task
from coalesce.kernels.protocol import Task
from coalesce.service.settings import build

from ..conftest import ServerThread, metric
from .tiny_models import splade_dir

TEXTS = ["how do plants make oxygen", "the striker scored twice in the second half", "a b c"]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread(build(["--model", f"splade={splade_dir()}", "--model", "dense=default"], environ={}))
    yield srv.start()
    srv.stop()


def _want(texts: list[str]) -> list[dict[int, float]]:
    from sentence_transformers import SparseEncoder

    dense = SparseEncoder(splade_dir(), device="cpu").encode(texts).to_dense().numpy()
    return [{int(i): float(row[i]) for i in np.nonzero(row)[0]} for row in dense]


def _same(got: list[dict[str, Any]], want: dict[int, float]) -> None:
    assert [g["index"] for g in got] == sorted(want), "the same non-zero indices, in index order"
    np.testing.assert_allclose([g["value"] for g in got], [want[g["index"]] for g in got], atol=1e-4)


def test_a_sparse_encoder_is_detected_as_sparse() -> None:
    assert detect_task(splade_dir()) is Task.SPARSE


async def test_embed_sparse_equals_sparse_encoder_encode(server: ServerThread) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/embed_sparse", json={"inputs": TEXTS}) as r,
    ):
        assert r.status == 200
        got = await r.json()
    want = _want(TEXTS)
    assert all(0 < len(w) < 1000 for w in want), "the tiny model is sparse like a trained one"
    for row, expected in zip(got, want, strict=True):
        _same(row, expected)


async def test_sparse_inputs_from_many_callers_batch_together(server: ServerThread) -> None:
    texts = [f"request {i} about {'plants' if i % 2 else 'football'}" for i in range(16)]
    async with aiohttp.ClientSession() as s:
        before = await (await s.get(server.url + "/metrics")).text()
        answers = await asyncio.gather(
            *(s.post(server.url + "/embed_sparse", json={"inputs": t}) for t in texts)
        )
        got = [(await a.json())[0] for a in answers]
        after = await (await s.get(server.url + "/metrics")).text()
    for row, expected in zip(got, _want(texts), strict=True):
        _same(row, expected)

    batches = (metric(after, "coalesce_batches_total", "splade")
               - metric(before, "coalesce_batches_total", "splade"))
    assert batches < len(texts), "concurrent sparse inputs share batches"


async def test_the_embedding_routes_name_the_sparse_route(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/embeddings", json={"model": "splade", "input": "x"}) as r:
            body = await r.json()
            assert r.status == 400 and "/embed_sparse" in body["error"]["message"]
        async with s.post(server.url + "/embed_sparse", json={"inputs": "x", "model": "dense"}) as r:
            body = await r.json()
            assert r.status == 422 and body["error_type"] == "Validation"
        async with s.get(server.url + "/info?model=splade") as r:
            info = await r.json()
            assert info["model_type"] == {"embedding": {"pooling": "splade"}}
