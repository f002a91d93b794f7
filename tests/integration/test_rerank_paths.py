"""The rerank paths clients call, against the shared server's tiny cross-encoder ``rr``: Cohere's v2
(``cohere.ClientV2``, unchanged) and v1 clients, Jina's and vLLM's ``/v1/rerank`` shape, and the
errors each path answers in Cohere's dialect."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from ..conftest import ServerThread
from .tiny_models import reranker_dir, shared_server, stop_shared_server

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
def want() -> list[float]:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(reranker_dir(), device="cpu", local_files_only=True)
    return [float(x) for x in model.predict([(QUERY, d) for d in DOCS])]


async def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body) as r:
        return r.status, await r.json(content_type=None), r.headers


def test_cohere_v2_client_reranks_unchanged(server: ServerThread, want: list[float]) -> None:
    import cohere

    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    got = client.rerank(model="rr", query=QUERY, documents=DOCS, top_n=2)
    best = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r.index for r in got.results] == best[:2]
    for r in got.results:
        assert r.relevance_score == pytest.approx(want[r.index], abs=1e-5)
    assert got.id and got.meta is not None and got.meta.api_version is not None
    assert got.meta.api_version.version == "2" and got.meta.tokens is not None
    everything = client.rerank(model="rr", query=QUERY, documents=DOCS)
    assert [r.index for r in everything.results] == best


def test_cohere_clients_raise_their_error_types_with_our_message(server: ServerThread) -> None:
    import cohere
    from cohere.errors import BadRequestError, NotFoundError

    client = cohere.ClientV2(base_url=server.url, api_key="unused")
    with pytest.raises(BadRequestError) as bad:
        client.rerank(model="all-MiniLM-L6-v2", query=QUERY, documents=DOCS)
    assert set(bad.value.body) == {"message"} and "needs a reranking model" in bad.value.body["message"]
    assert bad.value.headers is not None and bad.value.headers["x-error-code"] == "wrong_task"
    with pytest.raises(NotFoundError) as missing:
        client.rerank(model="rerank-v3.5", query=QUERY, documents=DOCS)
    assert "'rerank-v3.5' does not exist" in missing.value.body["message"]
    with pytest.raises(BadRequestError) as top_n:
        cohere.Client(base_url=server.url, api_key="unused").rerank(
            model="rr", query=QUERY, documents=DOCS, top_n=-1
        )
    assert top_n.value.body == {"message": "'top_n' must be at least 1; got -1."}


def test_cohere_v1_client_gets_the_documents_back(server: ServerThread, want: list[float]) -> None:
    import cohere

    got = cohere.Client(base_url=server.url, api_key="unused").rerank(
        model="rr", query=QUERY, documents=DOCS, return_documents=True
    )
    assert {r.index: r.relevance_score for r in got.results} == pytest.approx(dict(enumerate(want)), abs=1e-5)
    assert all(r.document is not None and r.document.text == DOCS[r.index] for r in got.results)


async def test_v1_rerank_speaks_jinas_and_vllms_shape(server: ServerThread, want: list[float]) -> None:
    body = {"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 2}
    status, got, _ = await call(server.url, "POST", "/v1/rerank", body)
    assert status == 200 and got["model"] == "rr" and got["usage"]["total_tokens"] > 0
    assert len(got["results"]) == 2
    for r in got["results"]:  # documents come back unless asked not to, as Jina and vLLM answer
        assert r["document"] == {"text": DOCS[r["index"]]}
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
    _, bare, _ = await call(server.url, "POST", "/v1/rerank", {**body, "return_documents": False})
    assert all(set(r) == {"index", "relevance_score"} for r in bare["results"])
    _, every, _ = await call(server.url, "POST", "/v1/rerank", {**body, "top_n": 0})  # vLLM: 0 = all
    assert len(every["results"]) == len(DOCS)
    objects = {"model": "rr", "query": QUERY, "documents": [{"text": d} for d in DOCS]}  # Jina's objects
    _, same, _ = await call(server.url, "POST", "/v1/rerank", objects)
    assert [r["index"] for r in same["results"]] == [r["index"] for r in every["results"]]
    _, plain, _ = await call(server.url, "POST", "/rerank", objects)  # Cohere v1 on /rerank: no documents
    assert all("document" not in r for r in plain["results"])


async def test_max_tokens_per_doc_cuts_each_document(server: ServerThread) -> None:
    doc = "chlorophyll absorbs light and plants release oxygen"
    _, tokens, _ = await call(server.url, "POST", "/tokenize", {"inputs": doc, "add_special_tokens": False})
    first_two = doc[: tokens[0][1]["stop"]]  # "chlorophyll" is several word pieces
    cut = {"model": "rr", "query": QUERY, "documents": [doc], "max_tokens_per_doc": 2}
    _, v2, _ = await call(server.url, "POST", "/v2/rerank", cut)
    _, short, _ = await call(server.url, "POST", "/v2/rerank", {**cut, "documents": [first_two]})
    _, full, _ = await call(server.url, "POST", "/v2/rerank", {**cut, "max_tokens_per_doc": None})

    def score(body: Any) -> float:
        return float(body["results"][0]["relevance_score"])

    assert score(v2) == pytest.approx(score(short), abs=1e-6)
    assert score(v2) != pytest.approx(score(full), abs=1e-4)
    status, err, _ = await call(server.url, "POST", "/v2/rerank", {**cut, "max_tokens_per_doc": 0})
    assert status == 400 and err == {"message": "'max_tokens_per_doc' must be at least 1; got 0."}


@pytest.mark.parametrize(
    ("method", "path", "status", "body"),
    [
        ("GET", "/v2/rerank", 405, {"message": "Method GET is not allowed on /v2/rerank."}),
        ("POST", "/v2/rerank", 400, {"message": "The request body is empty; send a JSON object."}),
        ("GET", "/rerank", 405,
         {"error": "Method GET is not allowed on /rerank.", "error_type": "Validation"}),
    ],
)
async def test_aiohttps_own_refusals_follow_the_paths_dialect(
    server: ServerThread, method: str, path: str, status: int, body: Any
) -> None:
    assert (await call(server.url, method, path))[:2] == (status, body)


async def test_a_path_nobody_serves_is_openais_404(server: ServerThread) -> None:
    status, body, headers = await call(server.url, "POST", "/v3/rerank", {})
    assert status == 404 and body["error"]["code"] == "not_found" and headers["x-error-code"] == "not_found"
