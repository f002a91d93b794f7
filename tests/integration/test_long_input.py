"""Inputs longer than the model, chunked: every window embedded as one more input and pooled back.

Each vector is checked against the same computation done by hand with the model's own
sentence-transformers modules: the text's tokens cut into windows that fill the model once the prompt
and special tokens are added, each window pooled (before the Normalize module), the token-weighted
mean normalised. Mean-pooled (the packaged model, on the graph-safe forward), CLS-pooled (the same
weights behind a CLS Pooling), and a prompt the pooling leaves out (the eager runner) are covered;
then refusals in each route's dialect, the input bound, and how the old truncate fields combine.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.loadtests.bench_longinput import long_texts
from coalesce.service.settings import build

from ..conftest import ServerThread

MOST = 3000  # --max-input-tokens here
QUERY = "query: "


def _copy(src: str, dest: Path, *, cls: bool = False, prompts: bool = False) -> str:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("README.md"))
    pooling_file = dest / "1_Pooling" / "config.json"
    pooling = json.loads(pooling_file.read_text())
    if cls:
        pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    if prompts:
        pooling["include_prompt"] = False
        config_file = dest / "config_sentence_transformers.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "prompts": {"query": QUERY}}))
    pooling_file.write_text(json.dumps(pooling))
    return str(dest)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("long")
    return {"cls": _copy(minilm_path, root / "cls", cls=True),
            "instr": _copy(minilm_path, root / "instr", prompts=True)}


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[ServerThread]:
    settings = build(
        ["--model", "plain=default", "--model", f"cls={dirs['cls']}", "--model", f"instr={dirs['instr']}",
         "--default-prompt-name", "instr=query", "--long-input", "chunk", "--max-input-tokens", str(MOST)],
        environ={},
    )
    srv = ServerThread(settings).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def st_models(dirs: dict[str, str], minilm_path: str) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    paths = {"plain": minilm_path, **dirs}
    return {name: SentenceTransformer(path, device="cpu") for name, path in paths.items()}


@pytest.fixture(scope="module")
def texts(st_models: dict[str, Any]) -> list[str]:
    tok = st_models["plain"].tokenizer
    return long_texts(2, 1200, lambda t: len(tok(t, add_special_tokens=False)["input_ids"]), seed=5)


def by_hand(st: Any, text: str, *, prompt: str = "", overlap: int = 0) -> tuple[np.ndarray, int]:
    """(the chunked vector of ``text``, tokens embedded) computed with ``st``'s own modules."""
    import torch

    tok = st.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    head = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    room = st.max_seq_length - 2 - len(head)
    starts = list(range(0, max(len(ids) - overlap, 1), room - overlap))
    modules = list(st)
    pool_modules = modules[1:-1] if type(modules[-1]).__name__ == "Normalize" else modules[1:]
    vectors, weights, tokens = [], [], 0
    for start in starts:
        window = [tok.cls_token_id, *head, *ids[start : start + room], tok.sep_token_id]
        features: dict[str, Any] = {
            "input_ids": torch.tensor([window]),
            "attention_mask": torch.ones(1, len(window), dtype=torch.int64),
            "token_type_ids": torch.zeros(1, len(window), dtype=torch.int64),
        }
        left_out = 0
        if head and not modules[1].include_prompt:
            left_out = 1 + len(head)
            features["prompt_length"] = left_out  # sentence-transformers' own way to leave a prompt out
        with torch.inference_mode():
            out = modules[0](features)
            for module in pool_modules:
                out = module(out)
        vectors.append(out["sentence_embedding"][0].double().numpy())
        weights.append(len(window) - left_out)
        tokens += len(window)
    v = np.average(np.stack(vectors), axis=0, weights=np.asarray(weights, dtype=np.float64))
    return v / np.linalg.norm(v), tokens


def _close(got: Any, want: Any, floor: float = 0.99999) -> None:
    got, want = np.atleast_2d(np.asarray(got, np.float64)), np.atleast_2d(np.asarray(want, np.float64))
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= floor, cos


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_mean_pooled_chunks_equal_the_hand_computation(
    server: ServerThread, st_models: dict[str, Any], texts: list[str]
) -> None:
    st = st_models["plain"]
    short = "a short query"
    status, body = await _post(server.url + "/v1/embeddings", {"model": "plain", "input": [texts[0], short]})
    assert status == 200, body
    want, tokens = by_hand(st, texts[0])
    _close(body["data"][0]["embedding"], want)
    _close(body["data"][1]["embedding"], st.encode([short]))  # an input that fits runs as it always did
    assert body["usage"]["prompt_tokens"] == tokens + len(st.tokenize([short])["input_ids"][0])
    assert tokens > 1000  # every window counted, not the 256 a truncated text embeds
    # Not what truncation gives: the whole text counts.
    status, cut = await _post(server.url + "/v1/embeddings",
                              {"model": "plain", "input": texts[0], "long_input": "truncate"})
    _close(cut["data"][0]["embedding"], st.encode([texts[0]]))
    assert np.dot(cut["data"][0]["embedding"], want) < 0.9999


async def test_cls_pooled_chunks_with_overlap_equal_the_hand_computation(
    server: ServerThread, st_models: dict[str, Any], texts: list[str]
) -> None:
    status, rows = await _post(server.url + "/embed",
                               {"model": "cls", "inputs": texts, "long_input": "chunk", "chunk_overlap": 32})
    assert status == 200, rows
    _close(rows, [by_hand(st_models["cls"], t, overlap=32)[0] for t in texts])


async def test_windows_carry_the_prompt_and_pooling_leaves_it_out(
    server: ServerThread, st_models: dict[str, Any], texts: list[str]
) -> None:
    status, body = await _post(server.url + "/v1/embeddings", {"model": "instr", "input": texts[1]})
    assert status == 200, body
    want, tokens = by_hand(st_models["instr"], texts[1], prompt=QUERY)
    _close(body["data"][0]["embedding"], want)
    assert body["usage"]["prompt_tokens"] == tokens


async def test_similarity_and_cohere_chunk_too(
    server: ServerThread, st_models: dict[str, Any], texts: list[str]
) -> None:
    st = st_models["plain"]
    long_vec = by_hand(st, texts[0])[0]
    status, scores = await _post(server.url + "/similarity", {
        "model": "plain", "inputs": {"source_sentence": "licence terms", "sentences": [texts[0]]}})
    assert status == 200, scores
    assert scores[0] == pytest.approx(float(np.dot(st.encode(["licence terms"])[0], long_vec)), abs=1e-4)
    status, body = await _post(server.url + "/v2/embed", {"model": "plain", "texts": [texts[0]],
                                                           "long_input": "chunk"})
    assert status == 200, body
    _close(body["embeddings"]["float"], long_vec)


async def test_error_mode_refuses_in_each_dialect(server: ServerThread, texts: list[str]) -> None:
    status, body = await _post(server.url + "/v1/embeddings",
                               {"model": "plain", "input": texts[0], "long_input": "error"})
    assert status == 400 and body["error"]["code"] == "input_too_long", body
    assert body["error"]["param"] == "input[0]"
    # TEI's own truncate field keeps its meaning whatever --long-input says: false refuses.
    status, body = await _post(server.url + "/embed",
                               {"model": "plain", "inputs": texts[0], "truncate": False})
    assert status == 422 and body["error_type"] == "Validation", body
    status, body = await _post(server.url + "/v2/embed",
                               {"model": "plain", "texts": [texts[0]], "truncate": "NONE"})
    assert status == 400 and "tokens" in body["message"], body
    status, body = await _post(server.url + "/similarity", {
        "model": "plain", "inputs": {"source_sentence": texts[0], "sentences": ["x"]},
        "parameters": {"long_input": "error"}})
    assert status == 422, body
    status, body = await _post(server.url + "/v1/embeddings",
                               {"model": "plain", "input": "x", "long_input": "split"})
    assert status == 400 and body["error"]["param"] == "long_input", body


async def test_truncate_true_still_truncates(
    server: ServerThread, st_models: dict[str, Any], texts: list[str]
) -> None:
    status, rows = await _post(server.url + "/embed",
                               {"model": "plain", "inputs": texts[0], "truncate": True})
    assert status == 200
    _close(rows, st_models["plain"].encode([texts[0]]))


async def test_an_input_past_max_input_tokens_is_refused_in_each_dialect(
    server: ServerThread, texts: list[str]
) -> None:
    huge = " ".join(texts * 2)  # about 4,800 tokens, past --max-input-tokens 3000
    status, body = await _post(server.url + "/v1/embeddings", {"model": "plain", "input": ["ok", huge]})
    assert status == 400 and body["error"]["code"] == "input_too_large", body
    assert body["error"]["param"] == "input[1]"
    status, body = await _post(server.url + "/embed", {"model": "plain", "inputs": huge})
    assert status == 413 and body["error_type"] == "Validation", body
    status, body = await _post(server.url + "/v2/embed", {"model": "plain", "texts": [huge]})
    assert status == 400 and str(MOST) in body["message"], body


async def test_overlap_that_leaves_no_room_and_embed_all_chunk_are_refused(
    server: ServerThread, texts: list[str]
) -> None:
    status, body = await _post(server.url + "/v1/embeddings",
                               {"model": "plain", "input": texts[0], "chunk_overlap": 254})
    assert status == 400 and body["error"]["param"] == "chunk_overlap", body
    status, body = await _post(server.url + "/embed_all",
                               {"model": "plain", "inputs": texts[0], "long_input": "chunk"})
    assert status == 422 and "embed_all" in body["error"], body
    # Under --long-input chunk, /embed_all refuses a long input by name rather than cutting it silently.
    status, body = await _post(server.url + "/embed_all", {"model": "plain", "inputs": texts[0]})
    assert status == 422 and "inputs[0]" in body["error"], body


def test_the_openai_client_chunks_through_extra_body(
    server: ServerThread, st_models: dict[str, Any], texts: list[str]
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    resp = client.embeddings.create(model="plain", input=texts[1], extra_body={"long_input": "chunk"})
    want, tokens = by_hand(st_models["plain"], texts[1])
    _close(resp.data[0].embedding, want)  # base64, the client's default, carries the pooled vector
    assert resp.usage.prompt_tokens == tokens
