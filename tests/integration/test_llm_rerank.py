"""LLM rerankers (Qwen3-Reranker style) against a real server: a tiny random ``Qwen3ForCausalLM`` served
with ``--task llm=rerank``, its seq-cls conversion (detected), and a cross-encoder side by side. Every
score is checked against the Qwen3-Reranker model card's reference code run on one pair at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from ..conftest import ServerThread
from .tiny_llm import llm_reranker_dir, llm_reranker_seq_cls_dir, reference_scores
from .tiny_models import GATE, load, metric, reranker_dir

QUERY = "how do plants make oxygen"
DOCS = [
    "Photosynthesis splits water and releases oxygen.",
    "The printing press spread books across Europe.",
    "Chlorophyll absorbs red and blue light.",
    "ok",
]
INSTRUCTION = "Find passages written for children"
TOL = 1e-4
# The model card's own batching code passes max_length with padding=True, which transformers warns about.
pytestmark = pytest.mark.filterwarnings("ignore:`max_length` is ignored:UserWarning")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from coalesce.service.settings import build

    argv = ["--model", f"llm={llm_reranker_dir()}", "--task", "llm=rerank",
            "--model", f"seqcls={llm_reranker_seq_cls_dir()}", "--model", f"rr={reranker_dir()}",
            "--max-batch-size", "32", "--request-timeout-ms", "600000",
            "--max-queue-wait-ms", "0"]  # a test holds the device: no wait bound, no deadline to shed by
    srv = ServerThread(build(argv, environ={}), load).start()
    yield srv
    srv.stop()


async def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


def scores_of(body: Any) -> dict[int, float]:
    """index → score of any rerank answer shape (Cohere's results, or TEI's bare array)."""
    items = body["results"] if isinstance(body, dict) else body
    return {r["index"]: r.get("relevance_score", r.get("score")) for r in items}


async def test_scores_equal_the_model_card_alone_and_come_best_first(server: ServerThread) -> None:
    want = reference_scores([(QUERY, d) for d in DOCS])
    for i, doc in enumerate(DOCS):  # alone: one pair per request
        status, body = await post(server.url, "/rerank", {"model": "llm", "query": QUERY, "documents": [doc]})
        assert status == 200, body
        assert body["results"][0]["relevance_score"] == pytest.approx(want[i], abs=TOL)
    status, body = await post(server.url, "/v1/rerank", {"model": "llm", "query": QUERY, "documents": DOCS})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in body["results"])
    assert scores_of(body) == pytest.approx(dict(enumerate(want)), abs=TOL)
    assert body["usage"]["prompt_tokens"] > 60 * len(DOCS)  # the template's tokens are computed and counted


async def test_concurrent_mixed_batches_give_each_pair_its_own_score(server: ServerThread) -> None:
    docs = [f"passage {i}: " + "plants make oxygen from light and water " * (1 + i % 5) for i in range(12)]
    want = reference_scores([(QUERY, d) for d in docs])
    async with aiohttp.ClientSession() as s:
        before = await (await s.get(server.url + "/metrics")).text()

        async def rerank(model: str, i: int) -> dict[int, float]:
            body = {"model": model, "query": QUERY, "documents": docs[i : i + 2]}
            async with s.post(server.url + "/rerank", json=body) as r:
                assert r.status == 200, await r.text()
                return {i + k: v for k, v in scores_of(await r.json()).items()}

        GATE.clear()  # hold the device: every request below queues before any batch runs
        try:
            calls = asyncio.gather(*(rerank(m, i) for i in range(0, len(docs), 2) for m in ("llm", "rr")))
            # Until all 12 requests are in (the scrape is the 13th) and queued behind the held forwards: a
            # model whose requests all came in one turn runs them as one batch, held with none queued,
            # so the two queues hold 10 between them, or 20 (each model's first request went out alone),
            # or none (both came whole: then it goes on a second after all are in; ≤ 20 s in all).
            # (Waiting for the llm queue alone to reach 6 sat out the 20 s whenever its requests came in
            # one turn.)
            polls_in = 0
            for _ in range(400):
                text = await (await s.get(server.url + "/metrics")).text()
                if metric(text, "coalesce_inflight_requests") >= 13:
                    queued = sum(metric(text, "coalesce_queue_depth", m) for m in ("llm", "rr"))
                    polls_in += 1
                    if queued >= 10 or polls_in >= 20:
                        break
                await asyncio.sleep(0.05)
        finally:
            GATE.set()
        results = await calls
        after = await (await s.get(server.url + "/metrics")).text()
    llm = {k: v for got in results[::2] for k, v in got.items()}
    assert llm == pytest.approx(dict(enumerate(want)), abs=TOL)
    batches = metric(after, "coalesce_batches_total", "llm") - metric(before, "coalesce_batches_total", "llm")
    assert batches < len(docs), "pairs of different lengths from many callers must batch together"


async def test_instruction_changes_scores_on_every_route(server: ServerThread) -> None:
    want = reference_scores([(QUERY, d) for d in DOCS], instruction=INSTRUCTION)
    default = reference_scores([(QUERY, d) for d in DOCS])
    assert max(abs(a - b) for a, b in zip(want, default, strict=True)) > 0.05  # the check can fail
    for path, body in (
        ("/rerank", {"model": "llm", "query": QUERY, "documents": DOCS, "instruction": INSTRUCTION}),
        ("/rerank", {"model": "llm", "query": QUERY, "texts": DOCS, "instruction": INSTRUCTION}),
        ("/v1/rerank", {"model": "llm", "query": QUERY, "documents": DOCS, "instruction": INSTRUCTION}),
        ("/v2/rerank", {"model": "llm", "query": QUERY, "documents": DOCS, "instruction": INSTRUCTION}),
    ):
        status, got = await post(server.url, path, body)
        assert status == 200, (path, got)
        assert scores_of(got) == pytest.approx(dict(enumerate(want)), abs=TOL), path


def test_python_and_cohere_clients_send_the_instruction(server: ServerThread) -> None:
    import cohere
    from coalesce.service.client import Client

    want = reference_scores([(QUERY, d) for d in DOCS], instruction=INSTRUCTION)
    with Client(server.url) as client:
        ranked = client.rerank(QUERY, DOCS, model="llm", instruction=INSTRUCTION, top_n=2)
    assert [r.index for r in ranked] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert [r.score for r in ranked] == pytest.approx(sorted(want, reverse=True)[:2], abs=TOL)
    v2 = cohere.ClientV2(base_url=server.url, api_key="unused").rerank(
        model="llm", query=QUERY, documents=DOCS,
        request_options={"additional_body_parameters": {"instruction": INSTRUCTION}},
    )
    assert {r.index: r.relevance_score for r in v2.results} == pytest.approx(dict(enumerate(want)), abs=TOL)


async def test_seq_cls_conversion_scores_like_the_causal_model(server: ServerThread) -> None:
    want = reference_scores([(QUERY, d) for d in DOCS], instruction=INSTRUCTION)
    body = {"query": QUERY, "documents": DOCS, "instruction": INSTRUCTION}
    status, got = await post(server.url, "/rerank", {"model": "seqcls", **body})
    assert status == 200, got
    assert scores_of(got) == pytest.approx(dict(enumerate(want)), abs=TOL)
    tei = {"query": QUERY, "texts": DOCS, "raw_scores": True}
    _, causal = await post(server.url, "/rerank", {"model": "llm", **tei})
    _, seq_cls = await post(server.url, "/rerank", {"model": "seqcls", **tei})
    assert scores_of(seq_cls) == pytest.approx(scores_of(causal), abs=TOL)  # log-odds, yes − no


async def test_truncation_cuts_the_document_and_keeps_the_template(server: ServerThread) -> None:
    long_doc = "oxygen " * 300 + "printing " * 300  # over the model's 512 tokens with the template
    want = reference_scores([(QUERY, long_doc)], max_length=512)  # the card cuts the formatted pair's end
    status, got = await post(server.url, "/rerank", {"model": "llm", "query": QUERY, "texts": [long_doc]})
    assert status == 200, got
    assert got[0]["score"] == pytest.approx(want[0], abs=TOL)
    status, err = await post(
        server.url, "/rerank", {"model": "llm", "query": QUERY, "texts": ["ok", long_doc], "truncate": False}
    )
    assert status == 422 and err["error"].startswith("texts[1] makes a pair of "), err
    status, err = await post(
        server.url, "/v2/rerank", {"model": "llm", "query": long_doc, "documents": ["ok"]}
    )
    assert status == 400 and "leaves no room for a document" in err["message"]
    words = "alpha beta gamma delta epsilon"  # one token each
    body = {"model": "llm", "query": QUERY, "documents": [words], "max_tokens_per_doc": 2}
    status, cut = await post(server.url, "/v2/rerank", body)
    assert status == 200, cut
    assert cut["results"][0]["relevance_score"] == pytest.approx(
        reference_scores([(QUERY, "alpha beta")])[0], abs=TOL
    )


async def test_instruction_is_refused_where_it_means_nothing(server: ServerThread) -> None:
    status, err = await post(server.url, "/rerank", {"model": "rr", "query": QUERY, "documents": DOCS,
                                                     "instruction": INSTRUCTION})
    assert status == 400 and "cross-encoder" in err["message"]
    status, err = await post(server.url, "/predict", {"model": "llm", "inputs": "a single text"})
    assert status == 422 and "pairs" in err["error"]
    status, pair = await post(server.url, "/predict", {"model": "llm", "inputs": [QUERY, DOCS[0]]})
    assert status == 200
    assert pair[0]["score"] == pytest.approx(reference_scores([(QUERY, DOCS[0])])[0], abs=TOL)


async def test_server_instruction_and_max_rerank_tokens(serve: Any) -> None:
    from coalesce.service.settings import build

    argv = ["--model", f"llm={llm_reranker_dir()}", "--task", "llm=rerank",
            "--rerank-instruction", f"llm={INSTRUCTION}", "--max-rerank-tokens", "160"]
    srv = serve(build(argv, environ={}), load)
    long_doc = "oxygen and light " * 40  # cut to fit 160 tokens with the template (the model takes 512)
    want = reference_scores([(QUERY, DOCS[0]), (QUERY, long_doc)], instruction=INSTRUCTION, max_length=160)
    got = await post(srv.url, "/rerank", {"model": "llm", "query": QUERY, "documents": [DOCS[0], long_doc]})
    assert got[0] == 200, got
    assert scores_of(got[1]) == pytest.approx(dict(enumerate(want)), abs=TOL)
    own = await post(srv.url, "/rerank", {"model": "llm", "query": QUERY, "documents": [DOCS[0]],
                                          "instruction": "Judge relevance"})
    assert scores_of(own[1])[0] == pytest.approx(
        reference_scores([(QUERY, DOCS[0])], instruction="Judge relevance")[0], abs=TOL
    )


async def test_a_template_file_given_by_flag_wins_over_the_card(serve: Any, tmp_path: Any) -> None:
    """--rerank-template NAME=PATH: the file's fields (here its default instruction) read every pair,
    and the model is served as an LLM reranker without --task."""
    import json

    from coalesce.service.settings import build

    template = tmp_path / "template.json"
    template.write_text(json.dumps({"instruction": INSTRUCTION}))
    srv = serve(build(["--model", f"llm={llm_reranker_dir()}", "--rerank-template", f"llm={template}"],
                      environ={}), load)
    status, got = await post(srv.url, "/rerank", {"model": "llm", "query": QUERY, "documents": DOCS})
    assert status == 200, got
    want = reference_scores([(QUERY, d) for d in DOCS], instruction=INSTRUCTION)
    assert scores_of(got) == pytest.approx(dict(enumerate(want)), abs=TOL)
    with pytest.raises(SystemExit, match="--rerank-template names nope"):
        build(["--model", f"llm={llm_reranker_dir()}", "--rerank-template", f"nope={template}"], environ={})


async def test_gateway_processes_build_pairs_from_what_the_engine_sends(replica: Any) -> None:
    """Under --workers 2 the gateways have only the engine's ModelInfo and tokenizer spec: the template
    and the server's instruction must reach them, and scores stay the card's."""
    from ..conftest import wait_all_gateways

    r = replica(2, ["--model", f"llm={llm_reranker_dir()}", "--task", "llm=rerank",
                    "--rerank-instruction", f"llm={INSTRUCTION}"])
    await wait_all_gateways(r)
    want = reference_scores([(QUERY, d) for d in DOCS], instruction=INSTRUCTION)
    for _ in range(4):  # a new connection each: the kernel spreads them over the gateways
        status, got = await post(r.url, "/v2/rerank", {"model": "llm", "query": QUERY, "documents": DOCS})
        assert status == 200, got
        assert scores_of(got) == pytest.approx(dict(enumerate(want)), abs=TOL)


async def test_an_instruction_for_a_cross_encoder_fails_the_start() -> None:
    from coalesce.service.settings import build

    srv = ServerThread(build(["--model", f"rr={reranker_dir()}", "--rerank-instruction", "rr=x"], environ={}),
                       load).launch()
    try:
        for _ in range(600):  # ≤ 30 s
            async with aiohttp.ClientSession() as s, s.get(srv.url + "/ready") as r:
                body = await r.json()
            if body["status"] != "starting":
                break
            await asyncio.sleep(0.05)
        assert body["status"] == "failed" and "not an LLM reranker" in body["error"], body
    finally:
        srv.stop()
