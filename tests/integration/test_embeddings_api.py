"""The OpenAI embeddings API against a real server on loopback with the real packaged model."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.service.settings import build

from ..conftest import ServerThread, metric

MODEL = "all-MiniLM-L6-v2"
POISON = 5  # an [unusedN] id: a batch containing it makes the wrapped runner raise


class PoisonableRunner:
    """The real runner, except that any batch holding the POISON token id fails in forward."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, prepared: Any) -> Any:
        if bool((prepared.ids == POISON).any()):
            raise RuntimeError("injected device fault")
        return self.inner.forward(prepared)


@pytest.fixture(scope="module")
def real_runner() -> Any:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    return load_runner(None, None, RunnerOptions(device="cpu"))


@pytest.fixture(scope="module")
def server(real_runner: Any) -> Iterator[ServerThread]:
    settings = build(["--max-body-bytes", str(1 << 20), "--max-batch-size", "32"], environ={})
    srv = ServerThread(settings, lambda spec: PoisonableRunner(real_runner)).start()
    yield srv
    srv.stop()


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


async def post(url: str, body: Any, **kw: Any) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/embeddings", json=body, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "short",
    "A considerably longer passage about batching, " * 40,  # past 256 tokens: truncated
]


# A number standing as an array element: not the digits inside the hex request id, which may run long.
_NUMBER = re.compile(rb"(?<=[\[,])-?\d[\d.eE+-]*(?=[,\]])")


@pytest.mark.parametrize(
    ("path", "body", "rows"),
    [
        ("/v1/embeddings", {"model": MODEL, "input": TEXTS[:3]},
         lambda b: [d["embedding"] for d in b["data"]]),
        ("/embed", {"inputs": TEXTS[:3]}, lambda b: b),
        ("/v2/embed", {"model": MODEL, "texts": TEXTS[:3], "input_type": "search_document",
                       "embedding_types": ["float"]}, lambda b: b["embeddings"]["float"]),
    ],
    ids=["openai", "tei", "cohere-v2"],
)
async def test_float_output_is_float32_in_its_shortest_form(
    server: ServerThread, path: str, body: dict[str, Any], rows: Any
) -> None:
    """Every number parses back to exactly the float32 the model computed (base64 carries its bits), in
    at most 9 significant digits: not the 17 of its float64 widening, which makes bodies 40% larger."""
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + path, json=body) as r:
            assert r.status == 200
            raw = await r.read()
        packed = {"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64"}
        async with s.post(server.url + "/v1/embeddings", json=packed) as r:
            packed_rows = (await r.json())["data"]
    exact = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed_rows]
    got = np.asarray(rows(json.loads(raw)), dtype=np.float32)
    np.testing.assert_array_equal(got, np.stack(exact))
    assert max(len(n) for n in _NUMBER.findall(raw)) <= 15, raw[:200]


async def test_float_and_base64_match_sentence_transformers(server: ServerThread, st_model: Any) -> None:
    expected = st_model.encode(TEXTS, convert_to_numpy=True)
    status, body, headers = await post(server.url, {"model": MODEL, "input": TEXTS})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    for d, want in zip(body["data"], expected, strict=True):
        assert cos(np.array(d["embedding"], dtype=np.float32), want) >= 0.99999
    status, b64, _ = await post(server.url, {"model": MODEL, "input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    for d, want in zip(b64["data"], expected, strict=True):
        vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert vec.shape == (384,)
        assert cos(vec, want) >= 0.99999
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert body["usage"]["prompt_tokens"] <= 256 * len(TEXTS)
    assert body["model"] == MODEL
    for h in ("x-queue-time", "x-inference-time", "x-request-id", "x-total-time"):
        assert h in headers


async def test_token_arrays_match_text(server: ServerThread, real_runner: Any) -> None:
    ids = real_runner.tokenize(["Embeddings map text to vectors."])[0]
    _, by_text, _ = await post(server.url, {"model": MODEL, "input": "Embeddings map text to vectors."})
    status, by_ids, _ = await post(server.url, {"model": MODEL, "input": [ids]})
    assert status == 200
    assert cos(np.array(by_text["data"][0]["embedding"]), np.array(by_ids["data"][0]["embedding"])) >= 0.99999
    status, single, _ = await post(server.url, {"model": MODEL, "input": ids})
    assert status == 200 and len(single["data"]) == 1


async def test_dimensions_are_truncated_and_renormalised(server: ServerThread, st_model: Any) -> None:
    status, body, _ = await post(server.url, {"model": MODEL, "input": "hello", "dimensions": 64})
    assert status == 200
    vec = np.array(body["data"][0]["embedding"])
    assert vec.shape == (64,)
    assert np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)
    full = st_model.encode(["hello"])[0][:64]
    assert cos(vec, full) >= 0.99999


def test_official_openai_client_works_unchanged(server: ServerThread, st_model: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model=MODEL, input=["first text", "second text"])  # base64 by default
    want = st_model.encode(["first text", "second text"])
    assert [d.index for d in got.data] == [0, 1]
    for d, w in zip(got.data, want, strict=True):
        assert cos(np.array(d.embedding), w) >= 0.99999
    assert got.usage.prompt_tokens > 0
    floats = client.embeddings.create(model=MODEL, input="x y z", encoding_format="float", dimensions=32)
    assert len(floats.data[0].embedding) == 32
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert "does not exist" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[""])
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_concurrent_requests_batch_together_and_each_gets_its_own_vector(
    server: ServerThread, st_model: Any
) -> None:
    texts = [f"request number {i} talks about topic {i * 7 % 13}" for i in range(64)]
    want = st_model.encode(texts)
    async with aiohttp.ClientSession() as s:
        metrics_before = await (await s.get(server.url + "/metrics")).text()

        async def one(text: str) -> np.ndarray:
            async with s.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": text}) as r:
                assert r.status == 200
                return np.array((await r.json())["data"][0]["embedding"])

        got = await asyncio.gather(*(one(t) for t in texts))
        metrics_after = await (await s.get(server.url + "/metrics")).text()
    for g, w in zip(got, want, strict=True):
        assert cos(g, w) >= 0.99999
    batches = metric(metrics_after, "coalesce_batches_total") - metric(
        metrics_before, "coalesce_batches_total"
    )
    inputs = metric(metrics_after, "coalesce_inputs_total") - metric(metrics_before, "coalesce_inputs_total")
    assert inputs == 64
    assert batches < 64, "batches of more than one input must form under concurrency"
    assert metric(metrics_after, "coalesce_batch_size_count") > 0


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": MODEL, "input": ""}, 400, "input[0]", "empty_input"),
        ({"model": MODEL, "input": []}, 400, "input", "empty_input"),
        ({"model": MODEL, "input": ["a", 3]}, 400, "input", "invalid_type"),
        ({"model": MODEL, "input": {"text": "a"}}, 400, "input", "invalid_type"),
        ({"model": MODEL, "input": "a", "encoding_format": "hex"}, 400, "encoding_format", "invalid_type"),
        ({"model": MODEL, "input": "a", "dimensions": 0}, 400, "dimensions", "invalid_dimensions"),
        ({"model": MODEL, "input": "a", "dimensions": 385}, 400, "dimensions", "invalid_dimensions"),
        ({"model": MODEL, "input": [[101, 30522]]}, 400, "input[0]", "invalid_token_id"),
        ({"model": MODEL, "input": [[-1]]}, 400, "input[0]", "invalid_token_id"),
        ({"model": MODEL, "input": ["a"] * 2049}, 400, "input", "too_many_inputs"),
        ({"model": "nope", "input": "a"}, 404, "model", "model_not_found"),
        ({"input": "a"}, 400, "model", "missing_model"),
    ],
)
async def test_bad_input_gets_a_precise_error(
    server: ServerThread, body: Any, status: int, param: str, code: str
) -> None:
    got_status, got, _ = await post(server.url, body)
    assert got_status == status, got
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["param"] == param
    assert got["error"]["code"] == code
    assert got["error"]["message"]


async def test_malformed_json_and_oversized_body(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/embeddings", data=b'{"model": "x", "input": [') as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_json"
        big = b'{"model": "%s", "input": ["%s"]}' % (MODEL.encode(), b"a" * (2 << 20))
        async with s.post(server.url + "/v1/embeddings", data=big) as r:
            assert r.status == 413
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.get(server.url + "/v1/embeddings") as r:
            assert r.status == 405
            assert "error" in await r.json()


async def test_bad_inputs_never_disturb_good_ones_in_flight(server: ServerThread, st_model: Any) -> None:
    good = [f"good request {i}" for i in range(12)]
    bad = [{"model": MODEL, "input": [[101, 99999]]}, {"model": MODEL, "input": ""}] * 6
    results = await asyncio.gather(
        *(post(server.url, {"model": MODEL, "input": t}) for t in good), *(post(server.url, b) for b in bad)
    )
    want = st_model.encode(good)
    for (status, body, _), w in zip(results[: len(good)], want, strict=True):
        assert status == 200
        assert cos(np.array(body["data"][0]["embedding"]), w) >= 0.99999
    assert all(status == 400 for status, _, _ in results[len(good) :])


async def test_runner_failure_answers_its_batch_and_the_next_request_succeeds(
    server: ServerThread, st_model: Any
) -> None:
    status, body, _ = await post(server.url, {"model": MODEL, "input": [[101, POISON, 102]]})
    assert status == 500
    assert body["error"]["code"] == "inference_failed"
    assert "injected device fault" in body["error"]["message"]
    status, body, _ = await post(server.url, {"model": MODEL, "input": "still serving"})
    assert status == 200
    assert cos(np.array(body["data"][0]["embedding"]), st_model.encode(["still serving"])[0]) >= 0.99999


async def test_probes_and_request_id(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/health") as r:
            assert r.status == 200
        async with s.get(server.url + "/ready") as r:
            assert r.status == 200
            assert (await r.json())["models"] == [MODEL]
        async with s.post(
            server.url + "/embeddings",
            json={"model": MODEL, "input": "alias route"},
            headers={"X-Request-ID": "abc-123"},
        ) as r:
            assert r.status == 200
            assert r.headers["x-request-id"] == "abc-123"
        async with s.get(server.url + "/metrics") as r:
            text = await r.text()
            for name in (
                "coalesce_queue_depth",
                "coalesce_batch_size_bucket",
                "coalesce_forward_seconds_count",
                "coalesce_requests_total",
                "coalesce_request_duration_seconds_bucket",
                "coalesce_batch_padding_ratio_bucket",
                "coalesce_queue_wait_seconds_bucket",
                "coalesce_tokens_total",
                "coalesce_inflight_requests",
                'coalesce_graph_batches{model="all-MiniLM-L6-v2",path="eager"}',
                "coalesce_cost_per_token_seconds",
                "coalesce_cost_spread",
                "coalesce_cost_run_spread",
            ):
                assert name in text, name


async def test_no_truncate_names_the_input_that_is_too_long(real_runner: Any, serve: Any) -> None:
    srv = serve(build(["--no-truncate"], environ={}), lambda spec: real_runner)
    long_text = "word " * 300
    status, body, _ = await post(srv.url, {"model": MODEL, "input": ["fine", long_text]})
    assert status == 400
    assert body["error"]["param"] == "input[1]"
    assert body["error"]["code"] == "input_too_long"
    status, _, _ = await post(srv.url, {"model": MODEL, "input": ["fine", "word " * 200]})
    assert status == 200


async def test_served_model_name_and_alias(real_runner: Any, serve: Any) -> None:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    srv = serve(
        build(["--served-model-name", "embedder"], environ={}),
        lambda spec: load_runner(spec.path, spec.name, RunnerOptions(device="cpu")),
    )
    status, body, _ = await post(srv.url, {"model": "embedder", "input": "x"})
    assert status == 200 and body["model"] == "embedder"
    status, _, _ = await post(srv.url, {"model": MODEL, "input": "x"})
    assert status == 404
