"""Classification, zero-shot classification and reranking against a real server that serves the
packaged MiniLM, a tiny random classifier and a tiny random cross-encoder side by side."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from ..conftest import ServerThread
from .tiny_models import (
    GATE,
    LABELS,
    classifier_dir,
    metric,
    reranker_dir,
    shared_server,
    stop_shared_server,
)

EMBEDDER = "all-MiniLM-L6-v2"
TEXTS = ["I loved this film.", "Terrible service, never again.", "It was fine, I guess.", "ok"]
QUERY = "how do plants make oxygen"
DOCS = [
    "Photosynthesis splits water and releases oxygen.",
    "The printing press spread books across Europe.",
    "Chlorophyll absorbs red and blue light.",
]


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    yield shared_server()
    stop_shared_server()


@pytest.fixture(scope="module")
def hf_classifier() -> tuple[Any, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = classifier_dir()
    return AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(
        path
    ).eval()


@pytest.fixture(scope="module")
def cross_encoder() -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(reranker_dir(), device="cpu", local_files_only=True)


def hf_logits(hf: tuple[Any, Any], texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
    import torch

    tokenizer, model = hf
    with torch.inference_mode():
        features = tokenizer(texts, pairs, padding=True, truncation=True, return_tensors="pt")
        out: np.ndarray = model(**features).logits.numpy()
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


async def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def refused(url: str, path: str, body: Any) -> tuple[int, str, str, str]:
    """(status, dialect, message, code) of an error answer, whichever dialect the route speaks."""
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        got = await r.json(content_type=None)
        code = r.headers["x-error-code"]
    if set(got) == {"message"}:
        return r.status, "cohere", got["message"], code
    if set(got) == {"error", "error_type"}:
        return r.status, "tei", got["error"], code
    assert got["error"]["code"] == code
    return r.status, "openai", got["error"]["message"], code


def by_label(row: list[dict[str, Any]]) -> np.ndarray:
    scores = {p["label"]: p["score"] for p in row}
    return np.array([scores[label] for label in LABELS])


async def test_classify_matches_transformers(server: ServerThread, hf_classifier: Any) -> None:
    want = softmax(hf_logits(hf_classifier, TEXTS))
    status, body = await post(server.url, "/classify", {"model": "clf", "input": TEXTS})
    assert status == 200, body
    assert body["model"] == "clf" and len(body["data"]) == len(TEXTS)
    for row, w in zip(body["data"], want, strict=True):
        assert [p["score"] for p in row] == sorted((p["score"] for p in row), reverse=True)
        np.testing.assert_allclose(by_label(row), w, atol=1e-5)
    status, raw = await post(server.url, "/classify", {"model": "clf", "input": TEXTS, "raw_scores": True})
    assert status == 200
    for row, w in zip(raw["data"], hf_logits(hf_classifier, TEXTS), strict=True):
        np.testing.assert_allclose(by_label(row), w, atol=1e-4)


async def test_tei_predict_shapes_and_pairs(server: ServerThread, hf_classifier: Any) -> None:
    status, single = await post(server.url, "/predict", {"inputs": TEXTS[0]})
    assert status == 200 and isinstance(single[0], dict)  # one input: a flat list, TEI's shape
    np.testing.assert_allclose(by_label(single), softmax(hf_logits(hf_classifier, TEXTS[:1]))[0], atol=1e-5)
    status, pair = await post(server.url, "/predict", {"inputs": ["a question", "an answer"]})
    assert status == 200 and isinstance(pair[0], dict)
    want_pair = softmax(hf_logits(hf_classifier, ["a question"], ["an answer"]))[0]
    np.testing.assert_allclose(by_label(pair), want_pair, atol=1e-5)
    status, batch = await post(server.url, "/predict", {"inputs": [[TEXTS[1]], ["a question", "an answer"]]})
    assert status == 200 and len(batch) == 2 and isinstance(batch[0], list)
    np.testing.assert_allclose(
        by_label(batch[0]), softmax(hf_logits(hf_classifier, TEXTS[1:2]))[0], atol=1e-5
    )
    np.testing.assert_allclose(by_label(batch[1]), want_pair, atol=1e-5)
    status, err = await post(server.url, "/predict", {"inputs": ["a", "b", "c"]})
    assert status == 422 and err["error_type"] == "Validation" and "'inputs'" in err["error"]


async def test_rerank_matches_cross_encoder_in_both_shapes(server: ServerThread, cross_encoder: Any) -> None:
    want = cross_encoder.predict([(QUERY, d) for d in DOCS])
    best_first = sorted(want.tolist(), reverse=True)
    status, cohere = await post(
        server.url,
        "/rerank",
        {
            "model": "rr",
            "query": QUERY,
            "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2]],
            "top_n": 2,
            "return_documents": True,
        },
    )
    assert status == 200, cohere
    assert [r["relevance_score"] for r in cohere["results"]] == pytest.approx(best_first[:2], abs=1e-5)
    for r in cohere["results"]:
        assert r["relevance_score"] == pytest.approx(float(want[r["index"]]), abs=1e-5)
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert cohere["model"] == "rr" and cohere["usage"]["prompt_tokens"] > 0
    status, tei = await post(server.url, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True})
    assert status == 200 and isinstance(tei, list)
    assert [r["score"] for r in tei] == pytest.approx(best_first, abs=1e-5)
    assert all(
        r["text"] == DOCS[r["index"]] and r["score"] == pytest.approx(float(want[r["index"]]), abs=1e-5)
        for r in tei
    )
    status, raw = await post(server.url, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True})
    logits = cross_encoder.predict([(QUERY, d) for d in DOCS], activation_fn=lambda x: x)
    assert [r["score"] for r in raw] == pytest.approx(sorted(logits.tolist(), reverse=True), abs=1e-4)


async def test_concurrent_classify_and_rerank_batch_together_and_stay_matched(
    server: ServerThread, hf_classifier: Any, cross_encoder: Any
) -> None:
    texts = [f"review number {i}: {'great' if i % 3 else 'awful'} food, {i % 7} stars" for i in range(24)]
    docs = [f"passage {i} about {'oxygen and plants' if i % 2 else 'old printing'}" for i in range(24)]
    want_cls = softmax(hf_logits(hf_classifier, texts))
    want_rr = cross_encoder.predict([(QUERY, d) for d in docs])
    async with aiohttp.ClientSession() as s:
        before = await (await s.get(server.url + "/metrics")).text()

        async def classify_one(text: str) -> np.ndarray:
            async with s.post(server.url + "/classify", json={"model": "clf", "input": text}) as r:
                assert r.status == 200, await r.text()
                return by_label((await r.json())["data"][0])

        async def rerank_two(i: int) -> list[tuple[int, float]]:
            body = {"model": "rr", "query": QUERY, "documents": [docs[i], docs[i + 1]]}
            async with s.post(server.url + "/rerank", json=body) as r:
                assert r.status == 200, await r.text()
                return [(i + x["index"], x["relevance_score"]) for x in (await r.json())["results"]]

        GATE.clear()  # hold the device: every request below must queue before any batch runs
        try:
            calls = asyncio.gather(
                *(classify_one(t) for t in texts), *(rerank_two(i) for i in range(0, len(docs), 2))
            )
            # ≤ 20 s: wait until requests pile up behind the held batch — in both queues, or for as
            # long as they keep coming (the held batch may be one model's every request: its queue
            # then stays empty, and waiting for it once took the whole 20 s)
            seen: tuple[float, ...] = ()
            still = 0
            for _ in range(400):
                text = await (await s.get(server.url + "/metrics")).text()
                depth = tuple(metric(text, "coalesce_queue_depth", m) for m in ("clf", "rr"))
                still = still + 1 if depth == seen else 0
                seen = depth
                if min(depth) >= 4 or (sum(depth) >= 4 and still >= 10):
                    break
                await asyncio.sleep(0.05)
        finally:
            GATE.set()
        results = await calls
        after = await (await s.get(server.url + "/metrics")).text()
    for got, want in zip(results[: len(texts)], want_cls, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    for pairs in results[len(texts) :]:
        for index, score in pairs:
            assert score == pytest.approx(float(want_rr[index]), abs=1e-5)
    for model, n in (("clf", len(texts)), ("rr", len(docs))):
        inputs = metric(after, "coalesce_inputs_total", model) - metric(
            before, "coalesce_inputs_total", model
        )
        batches = metric(after, "coalesce_batches_total", model) - metric(
            before, "coalesce_batches_total", model
        )
        assert inputs == n
        assert batches < n, f"{model}: queued inputs must batch together"


async def test_zero_shot_with_the_packaged_model_ranks_the_obvious_label_first(server: ServerThread) -> None:
    labels = ["sports", "cooking", "finance", "weather"]
    labelled = [
        ("The striker scored twice and the team won the championship final.", "sports"),
        ("The tennis player served an ace to win the match.", "sports"),
        ("Whisk the eggs with sugar, then fold in the flour and bake for thirty minutes.", "cooking"),
        ("Chop the onions and simmer them slowly in butter for the soup.", "cooking"),
        ("The central bank raised interest rates and stock markets fell.", "finance"),
        ("Investors bought government bonds as the share price dropped.", "finance"),
        ("Heavy rain and strong winds are forecast for tomorrow afternoon.", "weather"),
        ("It will be sunny and warm all weekend with a light breeze.", "weather"),
    ]
    texts = [t for t, _ in labelled]
    status, body = await post(server.url, "/classify", {"input": texts, "labels": labels})
    assert status == 200, body
    assert body["model"] == EMBEDDER
    assert [row[0]["label"] for row in body["data"]] == [label for _, label in labelled]
    for row in body["data"]:
        assert sum(p["score"] for p in row) == pytest.approx(1.0)
        assert [p["score"] for p in row] == sorted((p["score"] for p in row), reverse=True)
    # The label embeddings are cached: a second call computes the inputs only.
    _, again = await post(server.url, "/classify", {"model": EMBEDDER, "input": texts, "labels": labels})
    for row, first in zip(again["data"], body["data"], strict=True):  # other batch, other padding: ≈
        assert [p["label"] for p in row] == [p["label"] for p in first]
        assert [p["score"] for p in row] == pytest.approx([p["score"] for p in first], abs=1e-5)
    assert again["usage"]["prompt_tokens"] < body["usage"]["prompt_tokens"]
    _, cos = await post(server.url, "/classify", {"input": texts[:1], "labels": labels, "raw_scores": True})
    assert all(-1.0 <= p["score"] <= 1.0 for p in cos["data"][0]) and cos["data"][0][0]["label"] == "sports"


@pytest.mark.parametrize(
    ("path", "body", "status", "dialect", "code"),
    [
        ("/rerank", {"model": EMBEDDER, "query": "q", "documents": ["d"]}, 400, "cohere", "wrong_task"),
        ("/rerank", {"model": "clf", "query": "q", "texts": ["d"]}, 422, "tei", "wrong_task"),
        ("/classify", {"model": "rr", "input": ["x"]}, 400, "openai", "wrong_task"),
        ("/classify", {"model": EMBEDDER, "input": ["x"]}, 400, "openai", "missing_labels"),
        ("/classify", {"model": "clf", "input": ["x"], "labels": ["a"]}, 400, "openai", "unexpected_labels"),
        ("/classify", {"input": ["x"], "labels": ["a", "a"]}, 400, "openai", "duplicate_labels"),
        ("/predict", {"model": EMBEDDER, "inputs": "x"}, 422, "tei", "wrong_task"),
        ("/embed", {"model": "clf", "inputs": "x"}, 422, "tei", "wrong_task"),
        ("/v1/embeddings", {"model": "clf", "input": "x"}, 400, "openai", "wrong_task"),
        ("/v1/embeddings", {"model": "rr", "input": ["x"]}, 400, "openai", "wrong_task"),
        ("/rerank", {"query": "q", "documents": ["d"], "texts": ["d"]}, 422, "tei", "invalid_request"),
        ("/rerank", {"query": "q", "documents": []}, 400, "cohere", "empty_input"),
        ("/rerank", {"query": "", "documents": ["d"]}, 400, "cohere", "empty_input"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, 400, "cohere", "invalid_top_n"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": "x"}, 400, "cohere", "invalid_type"),
        ("/rerank", {"query": "q", "texts": ["d", ""]}, 400, "tei", "empty_input"),
        ("/rerank", {"query": "q", "texts": "d"}, 422, "tei", "invalid_type"),
    ],
)
async def test_wrong_task_and_bad_input_get_a_precise_error_in_the_routes_dialect(
    server: ServerThread, path: str, body: Any, status: int, dialect: str, code: str
) -> None:
    got_status, got_dialect, message, got_code = await refused(server.url, path, body)
    assert (got_status, got_dialect, got_code) == (status, dialect, code), message
    if code == "wrong_task":
        assert "needs" in message and "rr (rerank)" in message


async def test_unknown_model_is_404(server: ServerThread) -> None:
    got = await refused(server.url, "/rerank", {"model": "nope", "query": "q", "documents": ["d"]})
    assert (got[0], got[1], got[3]) == (404, "cohere", "model_not_found")


async def test_pairs_too_long_are_truncated_or_named(server: ServerThread) -> None:
    long_doc = "word " * 600
    status, body = await post(server.url, "/rerank", {"query": "q", "texts": ["short", long_doc]})
    assert status == 200 and len(body) == 2  # the server truncates by default
    status, err = await post(
        server.url, "/rerank", {"query": "q", "texts": ["short", long_doc], "truncate": False}
    )
    assert status == 422 and err["error_type"] == "Validation" and err["error"].startswith("texts[1] has ")


def test_task_override_loads_a_cross_encoder_as_a_classifier() -> None:
    from coalesce.kernels.loader import RunnerOptions, load_runner
    from coalesce.kernels.protocol import Task

    runner = load_runner(reranker_dir(), "as-classifier", RunnerOptions(device="cpu"), task="classify")
    assert runner.info.task is Task.CLASSIFY and runner.info.activation == "sigmoid"  # one output: sigmoid
    with pytest.raises(ValueError, match="one relevance score"):
        load_runner(classifier_dir(), "x", RunnerOptions(device="cpu"), task="rerank")
