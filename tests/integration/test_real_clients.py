"""Real clients, unchanged, against the real server: the official ``openai`` client, LangChain,
LlamaIndex, ``huggingface_hub`` (what Haystack's TEI embedders call; its errors and similarity too),
and our own client — including under a storm of 429s. (Cohere's clients: test_rerank_paths.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.service.client import APIError, AsyncClient, Client
from coalesce.service.settings import build

from ..conftest import ServerThread
from ..fakes import FakeRunner, GatedFake
from .tiny_models import metric, shared_server, stop_shared_server

EMBEDDER = "all-MiniLM-L6-v2"
TEXTS = ["Coalesce batches requests.", "Vectors for retrieval.", "A third, longer sentence about RAG."]


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    yield shared_server()
    stop_shared_server()


def close_to(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    for g, w in zip(got.reshape(-1, want.shape[-1]), want.reshape(-1, want.shape[-1]), strict=True):
        assert float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w))) >= 0.99999


def test_official_openai_client(server: ServerThread, st_model: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model=EMBEDDER, input=TEXTS)  # base64 on the wire by default
    close_to([d.embedding for d in got.data], st_model.encode(TEXTS))
    assert [m.id for m in client.models.list().data] == [EMBEDDER, "clf", "rr"]


def test_langchain_openai_embeddings(server: ServerThread, st_model: Any) -> None:
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    emb = langchain_openai.OpenAIEmbeddings(
        model=EMBEDDER, base_url=server.url + "/v1", api_key="unused", check_embedding_ctx_length=False
    )
    close_to(emb.embed_documents(TEXTS), st_model.encode(TEXTS))
    close_to(emb.embed_query(TEXTS[0]), st_model.encode(TEXTS[0]))


def test_llamaindex_text_embeddings_inference(server: ServerThread, st_model: Any) -> None:
    tei = pytest.importorskip(
        "llama_index.embeddings.text_embeddings_inference",
        reason="llama-index-embeddings-text-embeddings-inference is not installed",
    )
    emb = tei.TextEmbeddingsInference(model_name=EMBEDDER, base_url=server.url, timeout=30)
    close_to(emb.get_text_embedding_batch(TEXTS), st_model.encode(TEXTS))
    close_to(emb.get_query_embedding(TEXTS[1]), st_model.encode(TEXTS[1]))


def test_huggingface_hub_inference_client_as_haystack_uses_it(
    server: ServerThread, st_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import InferenceClient, constants

    # Offline mode blocks every request of huggingface_hub, even to a loopback URL; this one goes to
    # the test server only.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    got = InferenceClient(model=server.url, timeout=30).feature_extraction(TEXTS[2])
    close_to(got, st_model.encode([TEXTS[2]]))


def test_huggingface_hub_reads_our_tei_errors_and_similarity(
    server: ServerThread, st_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import InferenceClient, constants
    from huggingface_hub.errors import HfHubHTTPError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as above: the test server only
    client = InferenceClient(model=server.url, timeout=30)
    long_text = "word " * 300
    with pytest.raises(HfHubHTTPError) as info:
        client.feature_extraction(long_text, truncate=False)
    assert info.value.response.status_code == 422
    assert info.value.server_message == (  # TEI's flat body: the client shows our message as is
        f"inputs[0] has 302 tokens; model '{EMBEDDER}' takes at most 256. Shorten it, or send "
        '"truncate": true.'
    )
    close_to(client.feature_extraction(long_text, truncate=True), st_model.encode([long_text]))
    scores = client.sentence_similarity(TEXTS[0], TEXTS[1:])
    vecs = st_model.encode(TEXTS, normalize_embeddings=True)
    assert scores == pytest.approx([float(vecs[0] @ v) for v in vecs[1:]], abs=1e-5)


def test_our_client_embeds_classifies_and_reranks(server: ServerThread, st_model: Any) -> None:
    with Client(server.url) as client:
        assert client.models() == {EMBEDDER: "embed", "clf": "classify", "rr": "rerank"}
        vectors = client.embed(TEXTS)
        assert vectors.dtype == np.float32 and vectors.shape == (3, 384)
        close_to(vectors, st_model.encode(TEXTS))
        assert client.embed(TEXTS[0], dimensions=8).shape == (1, 8)
        zero_shot = client.classify(["The match ended in a draw."], labels=["sports", "cooking"])
        assert zero_shot[0][0].label == "sports"
        whole = client.classify(TEXTS, model="clf")
        docs = [f"document {i} about {'plants' if i % 2 else 'printing'}" for i in range(7)]
        whole_rank = client.rerank("plants", docs)
        assert len(client.rerank("plants", docs, top_n=3)) == 3
    with Client(server.url, batch_size=2) as split:  # the same calls, split into requests of two
        for row, want in zip(split.classify(TEXTS, model="clf"), whole, strict=True):
            assert {p.label: p.score for p in row} == pytest.approx(
                {p.label: p.score for p in want}, abs=1e-5
            )
        parts = split.rerank("plants", docs)
        assert {r.index: r.score for r in parts} == pytest.approx(
            {r.index: r.score for r in whole_rank}, abs=1e-5
        )
        assert [r.score for r in parts] == sorted((r.score for r in parts), reverse=True)
        with pytest.raises(APIError) as info:
            split.rerank("plants", docs, model=EMBEDDER)
        assert info.value.status == 400 and info.value.code == "wrong_task"
        assert "needs a reranking model" in info.value.message


def test_our_async_client(server: ServerThread, st_model: Any) -> None:
    async def go() -> None:
        async with AsyncClient(server.url, batch_size=2) as client:
            got = await client.embed(TEXTS * 3)
            close_to(got, st_model.encode(TEXTS * 3))
            ranked = await client.rerank("q", ["a", "b", "c"])
            assert sorted(r.index for r in ranked) == [0, 1, 2]
            assert len(await client.classify(TEXTS, model="clf")) == 3

    asyncio.run(go())


def test_our_client_splits_to_the_servers_cap(serve: Any) -> None:
    fake = FakeRunner()
    srv = serve(build(["--max-inputs", "4"], environ={}), lambda spec: fake)
    texts = [f"text number {i}" for i in range(10)]
    with Client(srv.url) as client:
        got = client.embed(texts)
    np.testing.assert_allclose(got, np.stack([fake.expected(t) for t in texts]), atol=1e-6)
    with Client(srv.url, batch_size=5) as too_big, pytest.raises(APIError) as info:
        too_big.embed(texts)
    assert info.value.code == "too_many_inputs" and "at most 4" in info.value.message


async def _wait_for(url: str, name: str, minimum: float) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):  # ≤ 10 s
            if metric(await (await s.get(url + "/metrics")).text(), name) >= minimum:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never reached {minimum}")


def test_our_client_rides_out_a_429_storm(serve: Any) -> None:
    fake = GatedFake(batch_seconds=0.02)
    # Each call is 4 tokens; at most 3 calls may wait. The gate holds the device while 24 callers
    # arrive, so most are refused at once with 429 + Retry-After, whatever the machine's speed.
    srv = serve(build(["--max-queued-tokens", "12", "--max-batch-size", "2"], environ={}), lambda spec: fake)
    retries: list[tuple[APIError, float]] = []
    texts = [f"storm {i}" for i in range(24)]

    async def go() -> list[np.ndarray]:
        async with AsyncClient(
            srv.url, max_retries=30, on_retry=lambda e, w: retries.append((e, w))
        ) as client:
            await client.models()
            fake.gate.clear()
            try:
                calls = asyncio.gather(*(client.embed(t, model="fake") for t in texts))
                await _wait_for(srv.url, "coalesce_rejected_total", 1)
            finally:
                fake.gate.set()
            return list(await asyncio.wait_for(calls, 120))

    got = asyncio.run(go())
    for vec, text in zip(got, texts, strict=True):
        np.testing.assert_allclose(vec[0], fake.expected(text), atol=1e-6)
    assert retries, "the storm must have been refused at least once"
    for err, wait in retries:
        assert err.status == 429 and err.code == "queue_full"
        assert err.retry_after is not None and err.retry_after > 0  # retry-after-ms: exact, may be < 1 s
        assert wait >= err.retry_after  # the hint honoured


def test_our_client_surfaces_the_429_once_its_retries_are_spent(serve: Any) -> None:
    fake = GatedFake()
    # One call (4 tokens) may wait. With one call held on the device and one waiting, any other is
    # refused for as long as the test holds the device: every retry meets the same 429.
    srv = serve(build(["--max-queued-tokens", "4"], environ={}), lambda spec: fake)

    async def hold_and_try() -> tuple[APIError, float]:
        async with AsyncClient(srv.url, max_retries=0) as other:
            await other.models()
            fake.gate.clear()
            try:
                running = asyncio.ensure_future(other.embed("one two", model="fake"))
                assert await asyncio.to_thread(fake.entered.wait, 10), "the first call must reach the device"
                waiting = asyncio.ensure_future(other.embed("three four", model="fake"))
                await _wait_for(srv.url, "coalesce_queue_depth", 1)
                with Client(srv.url, max_retries=1) as client:
                    t0 = time.monotonic()
                    try:
                        await asyncio.to_thread(client.embed, "five six", model="fake")
                    except APIError as err:
                        return err, time.monotonic() - t0
                raise AssertionError("the call must fail: the queue stays full while the device is held")
            finally:
                fake.gate.set()
                await asyncio.gather(running, waiting, return_exceptions=True)

    err, elapsed = asyncio.run(hold_and_try())
    assert err.status == 429 and err.code == "queue_full"
    assert "tokens are waiting" in err.message and "retry later" in err.message
    assert err.retry_after is not None and elapsed >= err.retry_after  # it waited the hint once
