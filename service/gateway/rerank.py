"""Reranking: score documents against a query with a cross-encoder, in every shape rerank clients send.

* ``POST /rerank``, in TEI's shape — ``{query, texts, raw_scores, return_text, truncate}`` → a bare
  array ``[{index, score, text?}]`` — or Cohere's v1 (and Infinity's) — ``{model, query, documents,
  top_n, return_documents}`` → ``{id, results: [{index, relevance_score, document?}], model, usage}``;
  the field carrying the candidates tells which, and errors follow it (TEI's or Cohere's dialect);
* ``POST /v1/rerank``, what Jina's, vLLM's and Cohere's v1 clients call: the same two shapes, except
  that ``return_documents`` defaults to true (Jina and vLLM always send the documents back) and
  ``top_n: 0`` means every result, as vLLM reads it;
* ``POST /v2/rerank``, Cohere's v2 (``cohere.ClientV2.rerank``): ``{model, query, documents, top_n,
  max_tokens_per_doc}`` → ``{id, results: [{index, relevance_score}], meta}``.

Each (query, document) pair is one input to the batcher, charged its full pair length against the token
budget, so pairs from many callers batch together like any other input. Scores are the model's logits
through its activation (sigmoid for a published cross-encoder, as sentence-transformers' ``CrossEncoder``
gives); TEI's ``raw_scores`` returns the logits. Results come best first. An LLM reranker (Qwen3-Reranker
style) reads each pair through its template with the request's ``instruction`` (every shape takes it),
the server's, or the template's (``llm_pairs``); its score is P(yes), as its model card computes it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import msgspec
import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task

from ..batching.batcher import RequestResult
from ..dialects import Dialect
from ..errors import InvalidRequest
from ..schemas import (
    ApiVersion,
    MetaTokens,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankV2Meta,
    RerankV2Request,
    RerankV2Response,
    RerankV2Result,
    TeiRank,
    Usage,
    decode,
)
from .admission import Admission, admission
from .contract import MODEL_ROUTE, Doc
from .inputs import checked_items, encode_pairs, truncating
from .llm_pairs import instruction_for, rerank_limit
from .models import pick_model
from .responses import activate, respond
from .routing import add_route, speak
from .state import SETTINGS


class _Shape(msgspec.Struct):
    """Which field carries the candidates, read from a body that failed to decode in full."""

    documents: msgspec.Raw = msgspec.Raw()
    texts: msgspec.Raw = msgspec.Raw()


_shape_decoder = msgspec.json.Decoder(_Shape)


def _given(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


def _dialect(documents: bool, texts: bool) -> Dialect | None:
    """TEI's shape (``texts``) or Cohere's (``documents``); None when the body says neither or both."""
    if texts and not documents:
        return Dialect.TEI
    if documents and not texts:
        return Dialect.COHERE
    return None


def _decode_rerank(request: web.Request, body: bytes) -> RerankRequest:
    """The request, its errors spoken in the dialect of its shape from here on (also when the body is
    malformed elsewhere, as long as the candidates' field can be told)."""
    try:
        req = decode(body, RerankRequest)
    except InvalidRequest:
        try:
            shape = _shape_decoder.decode(body)
        except msgspec.MsgspecError:
            shape = _Shape()  # not even an object: the path's own dialect answers
        said = _dialect(_given(shape.documents), _given(shape.texts))
        if said is not None:
            speak(request, said)
        raise
    said = _dialect(req.documents is not None, req.texts is not None)
    if said is None:
        raise InvalidRequest(
            "Send the candidates as 'documents' (Cohere's shape) or as 'texts' (TEI's shape), not both.",
            param="documents",
            code="invalid_request",
        )
    speak(request, said)
    return req


def _check_top_n(top_n: int | None, *, zero_is_all: bool) -> int | None:
    """How many results to return (None: all)."""
    if top_n is None or (top_n == 0 and zero_is_all):
        return None
    if top_n < 1:
        raise InvalidRequest(f"'top_n' must be at least 1; got {top_n}.", param="top_n", code="invalid_top_n")
    return top_n


async def _score(
    request: web.Request,
    adm: Admission,
    model_name: str | None,
    query: str,
    raw_docs: Sequence[str],
    *,
    field: str,
    truncate: bool | None,
    max_tokens_per_doc: int | None,
    raw_scores: bool,
    instruction: str | None,
) -> tuple[str, list[str], np.ndarray, RequestResult, int]:
    """(model name, documents, score per document, the result's timings, tokens computed)."""
    docs = checked_items(list(raw_docs), field, request.app[SETTINGS].max_inputs)
    if not query:
        raise InvalidRequest("'query' must not be empty.", param="query", code="empty_input")
    if max_tokens_per_doc is not None and max_tokens_per_doc < 1:
        raise InvalidRequest(
            f"'max_tokens_per_doc' must be at least 1; got {max_tokens_per_doc}.",
            param="max_tokens_per_doc",
            code="invalid_value",
        )
    model = pick_model(request, model_name, (Task.RERANK,), request.path)
    seqs = await encode_pairs(
        model, adm, [(query, d) for d in docs], cut=truncating(request, truncate), field=field,
        max_b=max_tokens_per_doc, limit=rerank_limit(request.app[SETTINGS], model),
        instruction=instruction_for(request, model, instruction),
    )
    result = await model.infer(seqs, adm)
    scores = (result.rows if raw_scores else activate(result.rows, model.info.activation))[:, 0]
    return model.info.name, docs, scores, result, sum(len(s) for s in seqs)


def _best_first(scores: np.ndarray, top_n: int | None) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:top_n]


async def _rerank(request: web.Request, *, v1: bool) -> web.Response:
    """``/rerank`` and ``/v1/rerank``: TEI's shape or Cohere's v1, by the body."""
    adm = admission(request)
    req = _decode_rerank(request, await request.read())
    tei = req.texts is not None
    raw = req.texts if req.texts is not None else [
        d if isinstance(d, str) else d.text for d in req.documents or []
    ]
    top_n = _check_top_n(req.top_n, zero_is_all=v1)
    name, docs, scores, result, tokens = await _score(
        request, adm, req.model, req.query, raw, field="texts" if tei else "documents", truncate=req.truncate,
        max_tokens_per_doc=req.max_tokens_per_doc, raw_scores=req.raw_scores, instruction=req.instruction,
    )
    order = _best_first(scores, top_n)
    if tei:
        ranks = [
            TeiRank(index=i, score=float(scores[i]), text=docs[i] if req.return_text else None) for i in order
        ]
        return respond(ranks, result, tokens)
    with_docs = req.return_documents if req.return_documents is not None else v1
    body = RerankResponse(
        id=uuid.uuid4().hex,
        results=[
            RerankResult(
                index=i,
                relevance_score=float(scores[i]),
                document=RerankDocument(text=docs[i]) if with_docs else None,
            )
            for i in order
        ],
        model=name,
        usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return respond(body, result, tokens)


async def rerank(request: web.Request) -> web.Response:
    """``POST /rerank``: TEI's shape or Cohere's v1 (documents only on request)."""
    return await _rerank(request, v1=False)


async def rerank_v1(request: web.Request) -> web.Response:
    """``POST /v1/rerank``: Jina's, vLLM's and Cohere's v1 clients (documents returned by default)."""
    return await _rerank(request, v1=True)


async def rerank_v2(request: web.Request) -> web.Response:
    """``POST /v2/rerank``: Cohere's v2 shape, Cohere's errors."""
    adm = admission(request)
    req = decode(await request.read(), RerankV2Request)
    top_n = _check_top_n(req.top_n, zero_is_all=False)
    _, _, scores, result, tokens = await _score(
        request, adm, req.model, req.query, req.documents, field="documents", truncate=None,
        max_tokens_per_doc=req.max_tokens_per_doc, raw_scores=False, instruction=req.instruction,
    )
    body = RerankV2Response(
        id=uuid.uuid4().hex,
        results=[
            RerankV2Result(index=i, relevance_score=float(scores[i])) for i in _best_first(scores, top_n)
        ],
        meta=RerankV2Meta(api_version=ApiVersion(version="2"), tokens=MetaTokens(input_tokens=tokens)),
    )
    return respond(body, result, tokens)


def add_routes(app: web.Application) -> None:
    """Register the rerank routes on ``app``. ``/rerank`` is TEI's until its body says Cohere's."""
    either = (list[TeiRank], RerankResponse)  # TEI's answer to ``texts``, Cohere's to ``documents``
    add_route(app, "POST", "/rerank", rerank, Dialect.TEI, doc=Doc(
        "Rerank documents (TEI's or Cohere's v1 shape)", "Reranking", either, RerankRequest,
        fails=MODEL_ROUTE, queued=True, speaks=(Dialect.COHERE,),
    ))
    add_route(app, "POST", "/v1/rerank", rerank_v1, Dialect.COHERE, doc=Doc(
        "Rerank documents (Cohere's v1, Jina's and vLLM's shape)", "Reranking", either, RerankRequest,
        fails=MODEL_ROUTE, queued=True, speaks=(Dialect.TEI,),
    ))
    add_route(app, "POST", "/v2/rerank", rerank_v2, Dialect.COHERE, doc=Doc(
        "Rerank documents (Cohere v2)", "Cohere", RerankV2Response, RerankV2Request, fails=MODEL_ROUTE,
        queued=True,
    ))
