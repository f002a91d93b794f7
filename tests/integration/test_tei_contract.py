"""The contract of every TEI route, and of the Cohere and OpenAI routes beside them, against a real
server with small limits: valid, invalid, empty, too large, overloaded and not ready, each checked for
status, body shape and field types.

TEI's schemas are written here from its documented field lists (``Info``, ``SimpleToken``, ``Rank``,
``Prediction``, ``ErrorResponse``) as strict msgspec types, independent of the server's own Structs.
The server: the packaged MiniLM, the tiny classifier ``clf`` and cross-encoder ``rr``; at most 4
inputs and 64 KiB per request, 64 tokens waiting per model, one input per batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec
import pytest

from ..conftest import ServerThread
from .tiny_models import GATE, classifier_dir, load, metric, reranker_dir

EMBEDDER = "all-MiniLM-L6-v2"
# One forward at a time (`--cpu-forwards 1`): the full-queue test holds the device with one batch a model
# running, so each queue keeps what it needs to be full. With two side by side (the auto choice on two
# cores) whichever model's request came first could have two of its inputs out of the queue, which under
# a busy CPU (a slower machine, the suite beside other work) left its queue short of full.
LIMITS = ["--max-inputs", "4", "--max-body-bytes", "65536", "--max-queued-tokens", "64",
          "--max-batch-size", "1", "--cpu-forwards", "1"]


# -- TEI's schemas, from its documented field lists --------------------------------------------------
class ErrorResponse(msgspec.Struct, forbid_unknown_fields=True):
    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


class SimpleToken(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class Rank(msgspec.Struct, forbid_unknown_fields=True):
    index: int
    score: float
    text: str | None = None


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    label: str
    score: float


class EmbeddingModel(msgspec.Struct, forbid_unknown_fields=True):
    pooling: str


class ClassifierModel(msgspec.Struct, forbid_unknown_fields=True):
    id2label: dict[str, str]
    label2id: dict[str, int]


class ModelType(msgspec.Struct, forbid_unknown_fields=True):
    classifier: ClassifierModel | None = None
    embedding: EmbeddingModel | None = None
    reranker: ClassifierModel | None = None


class Info(msgspec.Struct):  # extra fields (ours: models) are allowed; every TEI field is required
    model_id: str
    model_sha: str | None
    model_dtype: str
    model_type: ModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None
    served_model_name: str | None
    prompts: dict[str, str] | None


class CohereError(msgspec.Struct, forbid_unknown_fields=True):
    message: str


class OpenAIErrorDetail(msgspec.Struct, forbid_unknown_fields=True):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct, forbid_unknown_fields=True):
    error: OpenAIErrorDetail


Vectors = list[list[float]]


@dataclass(frozen=True)
class Route:
    path: str
    valid: Any
    answer: Any  # the type a valid request's body must convert to
    invalid: Any  # the wrong type somewhere: 422 Validation
    empty: Any  # an empty batch or input: 400 Empty
    too_many: Any  # 5 inputs, one over --max-inputs: 413 Validation


TEXT = "The quick brown fox."
ROUTES = [
    Route("/embed", {"inputs": [TEXT, "two"]}, Vectors, {"inputs": 3}, {"inputs": []}, {"inputs": ["a"] * 5}),
    Route("/embed_all", {"inputs": TEXT}, list[Vectors], {"inputs": "a", "truncation_direction": "up"},
          {"inputs": [""]}, {"inputs": ["a"] * 5}),
    Route("/similarity", {"inputs": {"source_sentence": TEXT, "sentences": ["a fox", "a car"]}}, list[float],
          {"inputs": {"source_sentence": "a"}}, {"inputs": {"source_sentence": "a", "sentences": []}},
          {"inputs": {"source_sentence": "a", "sentences": ["b"] * 5}}),
    Route("/decode", {"ids": [[101, 2023, 102], [2023]]}, list[str], {"ids": [1, [2]]}, {"ids": []},
          {"ids": [[2023]] * 5}),
    Route("/tokenize", {"inputs": TEXT}, list[list[SimpleToken]], {"inputs": [1]}, {"inputs": []},
          {"inputs": ["a"] * 5}),
    Route("/predict", {"inputs": [[TEXT], ["a question", "an answer"]]}, list[list[Prediction]],
          {"inputs": ["a", "b", "c"]}, {"inputs": []}, {"inputs": [["a"]] * 5}),
    Route("/rerank", {"query": "fox", "texts": [TEXT, "a car"], "return_text": True}, list[Rank],
          {"query": "q", "texts": "d"}, {"query": "q", "texts": []}, {"query": "q", "texts": ["d"] * 5}),
    Route("/", {"inputs": TEXT}, Vectors, {"inputs": 3}, {"inputs": []}, {"inputs": ["a"] * 5}),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from coalesce.service.settings import build

    argv = ["--model", "default", "--model", f"clf={classifier_dir()}", "--model", f"rr={reranker_dir()}"]
    srv = ServerThread(build([*argv, *LIMITS], environ={}), load).start()
    yield srv
    srv.stop()


async def send(
    url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None
) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of one request with a JSON body (or ``raw`` bytes)."""
    kwargs: dict[str, Any] = {"json": body}
    if raw is not None:
        kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, **kwargs) as r:
        return r.status, await r.json(content_type=None), r.headers


def tei_error(status: int, body: Any, headers: Any, want_status: int, error_type: str) -> ErrorResponse:
    err = msgspec.convert(body, ErrorResponse)
    assert (status, err.error_type) == (want_status, error_type), body
    assert err.error and headers["x-error-code"]
    return err


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
async def test_tei_route_answers_its_schema(server: ServerThread, route: Route) -> None:
    status, body, headers = await send(server.url, "POST", route.path, route.valid)
    assert status == 200, body
    msgspec.convert(body, route.answer)
    assert headers["Content-Type"].startswith("application/json")


async def test_info_has_every_field_teis_document_requires(server: ServerThread) -> None:
    for model, kind in ((EMBEDDER, "embedding"), ("clf", "classifier"), ("rr", "reranker")):
        status, body, _ = await send(server.url, "GET", f"/info?model={model}")
        assert status == 200
        info = msgspec.convert(body, Info)
        kinds = ("classifier", "embedding", "reranker")
        given = [k for k in kinds if getattr(info.model_type, k) is not None]
        assert given == [kind]
        assert info.model_id == info.served_model_name == model and info.model_dtype == "float32"
        assert (info.max_client_batch_size, info.max_batch_requests, info.tokenization_workers) == (4, 1, 2)
        assert info.max_batch_tokens == 16384 and info.max_concurrent_requests == 64 // 3
    tei_error(*await send(server.url, "GET", "/info?model=nope"), 404, "Validation")


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
async def test_tei_route_refuses_bad_input_in_teis_shape(server: ServerThread, route: Route) -> None:
    tei_error(*await send(server.url, "POST", route.path, route.invalid), 422, "Validation")
    tei_error(*await send(server.url, "POST", route.path, route.empty), 400, "Empty")
    tei_error(*await send(server.url, "POST", route.path, raw=b"{not json"), 422, "Validation")
    tei_error(*await send(server.url, "GET", route.path), 405, "Validation")


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.path)
async def test_tei_route_refuses_what_is_over_the_limits_with_413(server: ServerThread, route: Route) -> None:
    err = tei_error(*await send(server.url, "POST", route.path, route.too_many), 413, "Validation")
    assert "at most 4" in err.error
    big = b'{"inputs": "' + b"x" * 70000 + b'"}'
    err = tei_error(*await send(server.url, "POST", route.path, raw=big), 413, "Validation")
    assert "65536 bytes" in err.error


async def test_a_request_over_the_queue_bound_is_413(server: ServerThread) -> None:
    words = " ".join(["word"] * 20)  # 4 × 23 tokens: more than the 64 this model ever queues
    inputs = [f"{topic} {words}" for topic in ("red", "green", "blue", "white")]  # distinct: all queue
    err = tei_error(*await send(server.url, "POST", "/embed", {"inputs": inputs}), 413, "Validation")
    assert "split it" in err.error


async def test_a_server_that_is_not_ready_is_unhealthy(server: ServerThread) -> None:
    from coalesce.service.gateway.state import LIFECYCLE, Phase

    life = server.app[LIFECYCLE]

    async def to(phase: Phase) -> None:
        life.set(phase)

    server.call(to(Phase.STARTING))
    try:
        for route in ROUTES:
            status, body, headers = await send(server.url, "POST", route.path, route.valid)
            tei_error(status, body, headers, 503, "Unhealthy")
            assert headers["Retry-After"] == "2"
    finally:
        server.call(to(Phase.READY))


# What holds each model's queue full: four inputs of 16 tokens (the bound is 64); one input runs (held
# at the gate) and 48 tokens wait, so any request of more than 16 tokens is refused. The four differ
# (identical inputs in flight are computed once, and would queue once).
FILL = [" ".join("abcdefghijklmn"[i:] + "abcdefghijklmn"[:i]) for i in range(4)]  # 16 tokens each
DOCS = [" ".join("ghijklm"[i:] + "ghijklm"[:i]) for i in range(4)]  # 16 tokens each behind the query
OVER = " ".join("abcdefghijklmnopqrst")  # 22 tokens
FILLERS = {
    EMBEDDER: ("/embed", {"inputs": FILL}),
    "clf": ("/predict", {"inputs": [[f] for f in FILL]}),
    "rr": ("/rerank", {"query": "a b c d e f", "texts": DOCS}),
}
OVERLOADING = {  # path → (dialect, body), every one more than 16 tokens for a full model
    "/embed": ("tei", {"inputs": OVER}),
    "/embed_all": ("tei", {"inputs": OVER}),
    "/similarity": ("tei", {"inputs": {"source_sentence": OVER, "sentences": ["a"]}}),
    "/": ("tei", {"inputs": OVER}),
    "/predict": ("tei", {"inputs": OVER}),
    "/rerank": ("tei", {"query": OVER, "texts": ["a"]}),
    "/v2/rerank": ("cohere", {"model": "rr", "query": OVER, "documents": ["a"]}),
    "/v1/rerank": ("cohere", {"model": "rr", "query": OVER, "documents": ["a"]}),
    "/v1/embeddings": ("openai", {"model": EMBEDDER, "input": OVER}),
}


async def test_a_full_queue_is_429_overloaded_with_retry_after_in_every_dialect(server: ServerThread) -> None:
    async with aiohttp.ClientSession() as s:
        GATE.clear()  # hold the device: each filler's first input runs, the rest wait
        try:
            fillers = [asyncio.ensure_future(send(server.url, "POST", p, b)) for p, b in FILLERS.values()]
            for _ in range(400):  # ≤ 20 s
                text = await (await s.get(server.url + "/metrics")).text()
                if all(metric(text, "coalesce_queued_tokens", m) >= 48 for m in FILLERS):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the fillers never queued")
            for path, (dialect, body) in OVERLOADING.items():
                status, got, headers = await send(server.url, "POST", path, body)
                assert status == 429, (path, got)
                assert int(headers["Retry-After"]) >= 1 and headers["x-error-code"] == "queue_full"
                if dialect == "tei":
                    assert msgspec.convert(got, ErrorResponse).error_type == "Overloaded"
                elif dialect == "cohere":
                    assert "tokens are waiting" in msgspec.convert(got, CohereError).message
                else:
                    assert msgspec.convert(got, OpenAIError).error.code == "queue_full"
        finally:
            GATE.set()
        for status, _, _ in await asyncio.gather(*fillers):
            assert status == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v2/rerank", {"model": "rr", "query": "q", "documents": ["d"] * 5}, 400, "too_many_inputs"),
        ("/v2/rerank", {"model": "rr", "query": "q", "documents": "d"}, 400, "invalid_type"),
        ("/v2/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, 404, "model_not_found"),
        ("/v1/rerank", {"model": "rr", "query": "q", "documents": []}, 400, "empty_input"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, 400, "invalid_top_n"),
    ],
)
async def test_cohere_routes_answer_coheres_shape_at_our_status(
    server: ServerThread, path: str, body: Any, status: int, code: str
) -> None:
    got_status, got, headers = await send(server.url, "POST", path, body)
    msgspec.convert(got, CohereError)
    assert (got_status, headers["x-error-code"]) == (status, code)


async def test_openai_routes_keep_openais_shape(server: ServerThread) -> None:
    for body, status, code in (
        ({"model": EMBEDDER, "input": ["a"] * 5}, 400, "too_many_inputs"),
        ({"model": EMBEDDER, "input": []}, 400, "empty_input"),
        ({"model": "nope", "input": "a"}, 404, "model_not_found"),
    ):
        got_status, got, _ = await send(server.url, "POST", "/v1/embeddings", body)
        assert (got_status, msgspec.convert(got, OpenAIError).error.code) == (status, code)
    big = b'{"input": "' + b"x" * 70000 + b'"}'
    got_status, got, _ = await send(server.url, "POST", "/v1/embeddings", raw=big)
    assert (got_status, msgspec.convert(got, OpenAIError).error.code) == (413, "payload_too_large")
