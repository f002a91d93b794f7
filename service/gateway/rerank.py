"""``POST /rerank``: score documents against a query with a cross-encoder, in two wire shapes.

* Cohere (and Infinity): ``{model, query, documents, top_n, return_documents}`` →
  ``{id, results: [{index, relevance_score, document?}], model, usage}``;
* TEI: ``{query, texts, raw_scores, return_text, truncate}`` → a bare array ``[{index, score, text?}]``.

The shape is told by the field carrying the documents (``documents`` or ``texts``). Each (query,
document) pair is one input to the batcher, charged its full pair length against the token budget, so
pairs from many callers batch together like any other input. Scores are the model's logits through
its activation (sigmoid for a published cross-encoder, as sentence-transformers' ``CrossEncoder``
gives); TEI's ``raw_scores`` returns the logits. Results come best first.
"""

from __future__ import annotations

import uuid

from aiohttp import web
from coalesce.kernels.protocol import Task

from ..errors import InvalidRequest
from ..schemas import RerankDocument, RerankRequest, RerankResponse, RerankResult, TeiRank, Usage, decode
from .admission import admission
from .inputs import checked_items, encode_pairs, truncating
from .models import pick_model
from .responses import activate, respond
from .state import SETTINGS


async def rerank(request: web.Request) -> web.Response:
    """``POST /rerank`` (and ``/v1/rerank``), Cohere's shape or TEI's."""
    adm = admission(request)
    req = decode(await request.read(), RerankRequest)
    if (req.documents is None) == (req.texts is None):
        raise InvalidRequest(
            "Send the candidates as 'documents' (Cohere's shape) or as 'texts' (TEI's shape), not both.",
            param="documents",
            code="invalid_request",
        )
    tei = req.texts is not None
    field = "texts" if tei else "documents"
    raw = (
        req.texts
        if req.texts is not None
        else [d if isinstance(d, str) else d.text for d in req.documents or []]
    )
    docs = checked_items(raw, field, request.app[SETTINGS].max_inputs)
    if not req.query:
        raise InvalidRequest("'query' must not be empty.", param="query", code="empty_input")
    if req.top_n is not None and req.top_n < 1:
        raise InvalidRequest(
            f"'top_n' must be at least 1; got {req.top_n}.", param="top_n", code="invalid_top_n"
        )
    model = pick_model(request, req.model, (Task.RERANK,), "/rerank")
    seqs = await encode_pairs(
        model, adm, [(req.query, d) for d in docs], cut=truncating(request, req.truncate), field=field
    )
    result = await model.infer(seqs, adm)
    scores = (result.rows if req.raw_scores else activate(result.rows, model.info.activation))[:, 0]
    order = sorted(range(len(docs)), key=lambda i: -float(scores[i]))[: req.top_n]
    tokens = sum(len(s) for s in seqs)
    if tei:
        ranks = [
            TeiRank(index=i, score=float(scores[i]), text=docs[i] if req.return_text else None) for i in order
        ]
        return respond(ranks, result, tokens)
    body = RerankResponse(
        id=uuid.uuid4().hex,
        results=[
            RerankResult(
                index=i,
                relevance_score=float(scores[i]),
                document=RerankDocument(text=docs[i]) if req.return_documents else None,
            )
            for i in order
        ],
        model=model.info.name,
        usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return respond(body, result, tokens)


def add_routes(app: web.Application) -> None:
    """Register the rerank routes on ``app``."""
    app.router.add_post("/rerank", rerank)
    app.router.add_post("/v1/rerank", rerank)
