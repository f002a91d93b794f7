"""TEI-compatible routes (``/embed``, ``/info``, ``/tokenize``, ``/``) against a real server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from ..conftest import ServerThread
from .tiny_models import shared_server, stop_shared_server

EMBEDDER = "all-MiniLM-L6-v2"
TEXTS = ["The quick brown fox.", "Embeddings map text to vectors."]


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    yield shared_server()
    stop_shared_server()


async def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body) as r:
        return r.status, await r.json(content_type=None), r.headers


def cos(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


async def test_embed_matches_sentence_transformers(server: ServerThread, st_model: Any) -> None:
    want = st_model.encode(TEXTS)
    status, body, headers = await call(server.url, "POST", "/embed", {"inputs": TEXTS, "truncate": True})
    assert status == 200 and len(body) == 2
    for got, w in zip(body, want, strict=True):
        assert len(got) == 384 and cos(got, w) >= 0.99999
    assert "x-inference-time" in headers and int(headers["x-compute-tokens"]) > 0
    status, one, _ = await call(server.url, "POST", "/embed", {"inputs": TEXTS[0], "dimensions": 32})
    assert status == 200 and len(one) == 1 and len(one[0]) == 32
    assert np.linalg.norm(one[0]) == pytest.approx(1.0, abs=1e-5)
    assert cos(one[0], want[0][:32]) >= 0.99999


async def test_embed_truncates_either_side_or_names_the_input(server: ServerThread, st_model: Any) -> None:
    ids = st_model.tokenizer(["word " * 300 + "ending"], add_special_tokens=False)["input_ids"][0]
    long_text = "word " * 300 + "ending"
    status, left, _ = await call(
        server.url, "POST", "/embed", {"inputs": long_text, "truncate": True, "truncation_direction": "Left"}
    )
    assert status == 200
    _, tail, _ = await call(server.url, "POST", "/v1/embeddings", {"model": EMBEDDER, "input": [ids[-254:]]})
    assert cos(left[0], tail["data"][0]["embedding"]) >= 0.99999  # left keeps the end
    _, right, _ = await call(server.url, "POST", "/embed", {"inputs": long_text, "truncate": True})
    assert cos(right[0], st_model.encode([long_text])[0]) >= 0.99999  # right keeps the start, as ST does
    status, err, _ = await call(
        server.url, "POST", "/embed", {"inputs": ["ok", long_text], "truncate": False}
    )
    assert status == 400 and err["error"]["param"] == "inputs[1]" and err["error"]["code"] == "input_too_long"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"inputs": []}, "inputs"),
        ({"inputs": ["a", ""]}, "inputs[1]"),
        ({"inputs": "a", "prompt_name": "query"}, "prompt_name"),
        ({"inputs": "a", "truncation_direction": "middle"}, "truncation_direction"),
        ({"inputs": "a", "dimensions": 385}, "dimensions"),
        ({"inputs": 3}, "inputs"),
    ],
)
async def test_embed_rejects_bad_input_precisely(server: ServerThread, body: Any, param: str) -> None:
    status, err, _ = await call(server.url, "POST", "/embed", body)
    assert status == 400 and err["error"]["param"] == param


async def test_info_describes_each_model_and_lists_all(server: ServerThread) -> None:
    status, info, _ = await call(server.url, "GET", "/info")
    assert status == 200
    assert info["model_id"] == EMBEDDER and "embedding" in info["model_type"]
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 2048
    assert info["models"] == [
        {"id": EMBEDDER, "task": "embed"},
        {"id": "clf", "task": "classify"},
        {"id": "rr", "task": "rerank"},
    ]
    _, clf, _ = await call(server.url, "GET", "/info?model=clf")
    assert clf["model_type"]["classifier"]["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    _, rr, _ = await call(server.url, "GET", "/info?model=rr")
    assert "reranker" in rr["model_type"]
    status, _, _ = await call(server.url, "GET", "/info?model=nope")
    assert status == 404


async def test_tokenize_matches_the_models_tokenizer(server: ServerThread, st_model: Any) -> None:
    text = "Hello, tokenizers!"
    status, body, _ = await call(server.url, "POST", "/tokenize", {"inputs": text})
    assert status == 200 and len(body) == 1
    enc = st_model.tokenizer(text, return_offsets_mapping=True)
    assert [t["id"] for t in body[0]] == enc["input_ids"]
    assert body[0][0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    for tok, (start, stop) in zip(body[0][1:-1], enc["offset_mapping"][1:-1], strict=True):
        assert (tok["start"], tok["stop"]) == (start, stop) and tok["text"] == text[start:stop]
    _, bare, _ = await call(
        server.url, "POST", "/tokenize", {"inputs": [text, "x"], "add_special_tokens": False}
    )
    assert [t["id"] for t in bare[0]] == enc["input_ids"][1:-1] and len(bare) == 2
    assert not any(t["special"] for t in bare[0])


async def test_root_route_serves_the_first_models_task(server: ServerThread, st_model: Any) -> None:
    status, body, _ = await call(server.url, "POST", "/", {"inputs": TEXTS[0]})
    assert status == 200
    assert cos(body[0], st_model.encode(TEXTS[:1])[0]) >= 0.99999
