"""``POST /v2/embed``, Cohere's v2 embed, through the real ``cohere`` client: binary types are
sentence-transformers' own (``quantize_embeddings``), int8/uint8 one symmetric scale from the built-in
corpus (an integer dot product ranks like the float one), the same text always gets the same bytes,
``input_type`` picks the model's prompt, and bad input is a 400 in Cohere's shape naming the field."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.kernels.calibration import CORPUS, TOPICS
from coalesce.service.settings import build

from ..conftest import ServerThread

TEXTS = ["how do plants make oxygen", "The striker scored twice.", "Book the flight early."]
ALL_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]


@pytest.fixture(scope="module")
def e5_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> str:
    dest = tmp_path_factory.mktemp("e5") / "e5"
    shutil.copytree(minilm_path, dest, ignore=shutil.ignore_patterns("README.md"))
    config = json.loads((dest / "config_sentence_transformers.json").read_text())
    prompts = {"query": "query: ", "passage": "passage: "}
    (dest / "config_sentence_transformers.json").write_text(json.dumps({**config, "prompts": prompts}))
    return str(dest)


@pytest.fixture(scope="module")
def server(e5_dir: str) -> Iterator[ServerThread]:
    srv = ServerThread(build(["--model", "default", "--model", f"e5={e5_dir}"], environ={})).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    import cohere

    return cohere.ClientV2(base_url=server.url, api_key="unused")


def _quantize(rows: np.ndarray, kind: str, calibration: np.ndarray | None = None) -> np.ndarray:
    try:
        from sentence_transformers.util.quantization import quantize_embeddings
    except ImportError:  # sentence-transformers < 5
        from sentence_transformers.quantization import quantize_embeddings

    return np.asarray(quantize_embeddings(rows, precision=kind, calibration_embeddings=calibration))


def _symmetric_int8(rows: np.ndarray, calibration: np.ndarray) -> np.ndarray:
    """What the README promises: round(x / scale), scale = the 99.99th percentile of the corpus's |x|
    over 127, clipped to ±127."""
    scale = np.percentile(np.abs(calibration), 99.99) / 127
    return np.clip(np.rint(rows / scale), -127, 127).astype(int)


def _recall_at_10(truth: np.ndarray, scores: np.ndarray) -> float:
    """Mean share of each row's top 10 by ``truth`` that ``scores`` also ranks top 10 (self left out)."""
    truth, scores = truth.astype(np.float64), scores.astype(np.float64)
    np.fill_diagonal(truth, -np.inf)
    np.fill_diagonal(scores, -np.inf)
    top = np.argsort(-truth, axis=1, kind="stable")[:, :10]
    got = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top, got, strict=True)]))


def test_every_embedding_type_is_sentence_transformers_own(client: Any, st_model: Any) -> None:
    resp = client.embed(
        model="all-MiniLM-L6-v2", texts=TEXTS, input_type="search_document", embedding_types=ALL_TYPES
    )
    emb = resp.embeddings
    floats = np.asarray(emb.float_)
    want = st_model.encode(TEXTS)
    assert ((floats * want).sum(1) / np.linalg.norm(want, axis=1)).min() >= 0.99999
    decoded = np.stack([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in emb.base64])
    np.testing.assert_allclose(decoded, floats, rtol=1e-6, atol=1e-7)
    # Binary: sign bits; a value within rounding of zero may flip, nothing else.
    for kind in ("ubinary", "binary"):
        got, theirs = np.asarray(getattr(emb, kind)), _quantize(want, kind)
        assert got.shape == (3, 384 // 8)
        assert (np.unpackbits(got.astype(np.uint8)) != np.unpackbits(theirs.astype(np.uint8))).mean() < 0.01
    # int8: one symmetric scale from the corpus embedded at warm-up; a value on a step's edge may land
    # one over. uint8 is int8 + 128, exactly.
    int8 = np.asarray(emb.int8)
    diff = np.abs(int8 - _symmetric_int8(want, st_model.encode(list(CORPUS))))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.02
    assert int8.min() >= -127 and int8.max() <= 127
    np.testing.assert_array_equal(np.asarray(emb.uint8), int8 + 128)
    assert resp.meta.billed_units.input_tokens == sum(
        len(st_model.tokenize([t])["input_ids"][0]) for t in TEXTS
    )


def test_the_same_text_gets_the_same_bytes_whatever_its_neighbours(client: Any) -> None:
    alone = client.embed(
        model="all-MiniLM-L6-v2",
        texts=[TEXTS[0]],
        input_type="search_query",
        embedding_types=["int8", "ubinary"],
    )
    crowd = client.embed(
        model="all-MiniLM-L6-v2",
        texts=[*CORPUS[:20], TEXTS[0]],
        input_type="search_query",
        embedding_types=["int8", "ubinary"],
    )
    assert alone.embeddings.int8[0] == crowd.embeddings.int8[-1]
    assert alone.embeddings.ubinary[0] == crowd.embeddings.ubinary[-1]


def test_input_type_picks_the_models_prompt(client: Any, e5_dir: str) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(e5_dir, device="cpu")
    for input_type, prompt in (("search_query", "query"), ("search_document", "passage")):
        resp = client.embed(model="e5", texts=TEXTS, input_type=input_type, embedding_types=["float"])
        got, want = np.asarray(resp.embeddings.float_), st.encode(TEXTS, prompt_name=prompt)
        assert ((got * want).sum(1) / np.linalg.norm(want, axis=1)).min() >= 0.99999


def test_output_dimension_truncates_and_quantises_at_that_width(client: Any, st_model: Any) -> None:
    resp = client.embed(
        model="all-MiniLM-L6-v2",
        texts=TEXTS,
        input_type="search_query",
        embedding_types=["float", "int8", "ubinary"],
        output_dimension=128,
    )
    floats = np.asarray(resp.embeddings.float_)
    assert floats.shape == (3, 128)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, rtol=1e-5)
    cut = st_model.encode(list(CORPUS))[:, :128]
    calibration = cut / np.linalg.norm(cut, axis=1, keepdims=True)
    diff = np.abs(np.asarray(resp.embeddings.int8) - _symmetric_int8(floats, calibration))
    assert diff.max() <= 1
    assert np.asarray(resp.embeddings.ubinary).shape == (3, 16)


def test_binary_neighbours_find_most_of_the_float_ones(client: Any) -> None:
    """The retrieval check BENCHMARKS.md reports: each corpus sentence's top 10 by Hamming distance on
    ubinary against its top 10 by cosine on float (its own topic has 11 other sentences)."""
    resp = client.embed(
        model="all-MiniLM-L6-v2",
        texts=list(CORPUS),
        input_type="search_document",
        embedding_types=["float", "ubinary"],
    )
    floats = np.asarray(resp.embeddings.float_)
    bits = np.unpackbits(np.asarray(resp.embeddings.ubinary, dtype=np.uint8), axis=1).astype(np.int32)
    cos = floats @ floats.T
    hamming = (bits[:, None, :] != bits[None, :, :]).sum(-1)
    np.fill_diagonal(cos, -np.inf)
    np.fill_diagonal(hamming, 10**6)
    recall = np.mean(
        [
            len(set(np.argsort(-cos[i])[:10]) & set(np.argsort(hamming[i], kind="stable")[:10])) / 10
            for i in range(len(CORPUS))
        ]
    )
    assert recall >= 0.6, recall
    assert len(CORPUS) == 12 * len(TOPICS)


def test_int8_and_shifted_uint8_rank_like_float_with_a_plain_dot_product(client: Any) -> None:
    """Each corpus sentence's top 10 by an integer dot product of int8 (and of uint8 shifted back by
    128) against its top 10 by cosine: a per-dimension offset would bias each sentence's products."""
    resp = client.embed(
        model="all-MiniLM-L6-v2", texts=list(CORPUS), input_type="search_document",
        embedding_types=["float", "int8", "uint8"],
    )
    floats = np.asarray(resp.embeddings.float_)
    int8 = np.asarray(resp.embeddings.int8, dtype=np.int64)
    uint8 = np.asarray(resp.embeddings.uint8, dtype=np.int64) - 128
    np.testing.assert_array_equal(uint8, int8)
    assert _recall_at_10(floats @ floats.T, int8 @ int8.T) >= 0.98
    # Zero stays zero: a row's int8 is its float row over one scale, so the cosine barely moves.
    cos = (floats * int8).sum(1) / np.linalg.norm(floats, axis=1) / np.linalg.norm(int8, axis=1)
    assert cos.min() >= 0.999


async def test_bad_input_is_a_400_in_cohere_shape_naming_the_field(server: ServerThread) -> None:
    long_text = " ".join(["word"] * 400)
    cases = [
        ({"embedding_types": ["float", "int4"]}, "embedding_types[1]"),
        ({"model": "e5", "input_type": "classification"}, "input_type"),
        ({"output_dimension": 1000}, "output_dimension"),
        ({"output_dimension": 0}, "output_dimension"),
        ({"texts": [long_text], "truncate": "NONE"}, "texts[0]"),
        ({"truncate": "MIDDLE"}, "truncate"),
        ({"images": ["data:image/png;base64,AAAA"]}, "images"),
    ]
    async with aiohttp.ClientSession() as s:
        for extra, field in cases:
            body = {"model": "all-MiniLM-L6-v2", "texts": TEXTS, "input_type": "search_query", **extra}
            async with s.post(server.url + "/v2/embed", json=body) as r:
                got = await r.json()
                assert r.status == 400, (extra, got)
                assert set(got) == {"message"} and field in got["message"], (extra, got)
                assert r.headers["x-error-code"]


async def test_info_shows_the_int8_scale(server: ServerThread, st_model: Any) -> None:
    async with aiohttp.ClientSession() as s, s.get(server.url + "/info") as r:
        info = await r.json()
    calibration = st_model.encode(list(CORPUS))
    assert info["quantization_scale"] == pytest.approx(np.percentile(np.abs(calibration), 99.99) / 127,
                                                       rel=1e-4)
