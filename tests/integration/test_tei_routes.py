"""TEI-compatible routes (``/embed``, ``/embed_all``, ``/similarity``, ``/info``, ``/tokenize``, ``/decode``,
``/``) against a real server: the values they return, checked against sentence-transformers and the
model's tokenizer. (Every route's statuses and schemas, errors included: test_tei_contract.py.)"""

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
    status, err, headers = await call(
        server.url, "POST", "/embed", {"inputs": ["ok", long_text], "truncate": False}
    )
    assert status == 422 and err["error_type"] == "Validation" and headers["x-error-code"] == "input_too_long"
    assert err["error"].startswith("inputs[1] has 303 tokens")


@pytest.mark.parametrize(
    ("body", "status", "error_type", "names"),
    [
        ({"inputs": []}, 400, "Empty", "'inputs'"),
        ({"inputs": ["a", ""]}, 400, "Empty", "inputs[1]"),
        ({"inputs": "a", "prompt_name": "query"}, 422, "Validation", "prompt"),
        ({"inputs": "a", "truncation_direction": "middle"}, 422, "Validation", "'truncation_direction'"),
        ({"inputs": "a", "dimensions": 385}, 422, "Validation", "'dimensions'"),
        ({"inputs": 3}, 422, "Validation", "$.inputs"),
    ],
)
async def test_embed_rejects_bad_input_precisely(
    server: ServerThread, body: Any, status: int, error_type: str, names: str
) -> None:
    got, err, _ = await call(server.url, "POST", "/embed", body)
    assert (got, err["error_type"]) == (status, error_type)
    assert names in err["error"]


async def test_info_describes_each_model_and_lists_all(server: ServerThread) -> None:
    status, info, _ = await call(server.url, "GET", "/info")
    assert status == 200
    assert info["model_id"] == EMBEDDER and "embedding" in info["model_type"]
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 2048
    assert info["model_dtype"] == "float32" and info["served_model_name"] == EMBEDDER
    assert info["max_batch_requests"] == 32 and info["max_batch_tokens"] == 16384
    assert info["tokenization_workers"] == 2  # two tokenizer threads per model in the one process
    assert info["max_concurrent_requests"] == 524288 // 3  # the queue bound over the shortest input
    assert info["auto_truncate"] is True and info["prompts"] is None and info["model_sha"] is None
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


async def test_embed_all_matches_sentence_transformers_token_embeddings(
    server: ServerThread, st_model: Any
) -> None:
    texts = [*TEXTS, "Short.", "word " * 300 + "ending"]  # the last is cut to 256 tokens, at the end
    want = st_model.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    status, body, headers = await call(server.url, "POST", "/embed_all", {"inputs": texts})
    assert status == 200 and len(body) == len(texts)
    for got, w in zip(body, want, strict=True):
        w = w.float().numpy()
        assert np.asarray(got).shape == w.shape  # one vector per token, specials in, padding out
        assert min(cos(g, x) for g, x in zip(got, w, strict=True)) >= 0.99999
    assert int(headers["x-compute-tokens"]) == sum(len(w) for w in want)
    _, one, _ = await call(server.url, "POST", "/embed_all", {"inputs": TEXTS[0]})
    assert np.allclose(one[0], body[0], atol=1e-5)
    ids = st_model.tokenizer(texts[-1], add_special_tokens=False)["input_ids"]
    _, left, _ = await call(
        server.url, "POST", "/embed_all", {"inputs": texts[-1], "truncation_direction": "left"}
    )
    _, tokens, _ = await call(server.url, "POST", "/tokenize", {"inputs": texts[-1]})
    assert len(left[0]) == 256 and len(tokens[0]) == len(ids) + 2  # /tokenize never truncates
    status, err, _ = await call(server.url, "POST", "/embed_all", {"inputs": texts[-1], "truncate": False})
    assert status == 422 and "inputs[0] has 303 tokens" in err["error"]


async def test_similarity_is_the_cosine_of_sentence_transformers_embeddings(
    server: ServerThread, st_model: Any
) -> None:
    source, others = "A cat sits on the mat.", ["A kitten rests on a rug.", "Stock markets fell.", "Cats."]
    vecs = st_model.encode([source, *others])
    want = [cos(vecs[0], v) for v in vecs[1:]]
    body = {"inputs": {"source_sentence": source, "sentences": others}}
    for path in ("/similarity", "/"):  # the root takes TEI's similarity body as huggingface_hub sends it
        status, got, _ = await call(server.url, "POST", path, body)
        assert status == 200 and got == pytest.approx(want, abs=1e-5), path
    assert got[0] > got[1]


async def test_decode_inverts_tokenize(server: ServerThread, st_model: Any) -> None:
    text = "Hello, tokenizers!"
    ids = st_model.tokenizer(text)["input_ids"]
    status, body, _ = await call(server.url, "POST", "/decode", {"ids": ids})
    assert status == 200 and body == [st_model.tokenizer.decode(ids, skip_special_tokens=True)]
    assert body == ["hello, tokenizers!"]  # the model lowercases
    _, both, _ = await call(
        server.url, "POST", "/decode", {"ids": [ids, ids[1:3]], "skip_special_tokens": False}
    )
    assert both == [st_model.tokenizer.decode(ids), st_model.tokenizer.decode(ids[1:3])]
    assert both[0].startswith("[CLS]")
    status, err, headers = await call(server.url, "POST", "/decode", {"ids": [[101], [5, 30522]]})
    assert (status, err["error_type"], headers["x-error-code"]) == (422, "Tokenizer", "invalid_token_id")
    assert "30522" in err["error"] and "sequence 1" in err["error"]
