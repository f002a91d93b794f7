"""Text Embeddings Inference (TEI) embedding routes: ``POST /embed``, ``/embed_all``, ``/similarity``, ``/``.

So clients written for TEI work unchanged: LlamaIndex's ``TextEmbeddingsInference`` posts ``{inputs,
truncate}`` to ``/embed``; Haystack's TEI embedders go through ``huggingface_hub``'s
``InferenceClient``, which posts ``{inputs}`` to the server's root (and ``{inputs: {source_sentence,
sentences}}`` for ``sentence_similarity``). TEI serves one model, so its requests name none: they get
the first served model of the right task; ``model`` may be added to choose another. Every TEI route
answers errors in TEI's dialect (``dialects.py``). ``/info``, ``/tokenize`` and ``/decode`` live in
``tei_meta.py``; ``/predict`` and ``/rerank`` with their tasks (classify.py, rerank.py).
"""

from __future__ import annotations

from functools import partial

import msgspec
import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import OutputKind, Task

from ..dialects import Dialect
from ..errors import InvalidRequest
from ..schemas import (
    Prediction,
    PredictRequest,
    RerankRequest,
    RerankResponse,
    SimilarityParameters,
    SimilarityRequest,
    TeiEmbedAllRequest,
    TeiEmbedRequest,
    TeiRank,
    decode,
)
from . import classify, rerank
from .admission import admission
from .contract import MODEL_ROUTE, Doc
from .embeddings import vector
from .inputs import check_dimensions, checked_items, encode_texts, tokenize_texts
from .models import pick_model
from .responses import float_json, respond
from .routing import add_route
from .state import SETTINGS
from .windows import encode_long, fit_long, long_input

_ALL_TASKS = tuple(Task)


def keeps_end(direction: str, field: str = "truncation_direction") -> bool:
    """TEI's ``truncation_direction`` (``left``/``right``, any case): True when truncation keeps the
    end of the text (``left``)."""
    lowered = direction.lower()
    if lowered not in ("left", "right"):
        raise InvalidRequest(
            f"'{field}' must be left or right; got {direction!r}.", param=field, code="invalid_value"
        )
    return lowered == "left"


async def embed(request: web.Request) -> web.Response:
    """``POST /embed``: ``{inputs, normalize, truncate, truncation_direction, dimensions}`` →
    ``[[float]]``; ours: ``long_input`` (wins over ``truncate``) and ``chunk_overlap`` (see
    ``windows``)."""
    adm = admission(request)
    req = decode(await request.read(), TeiEmbedRequest)
    model = pick_model(request, req.model, (Task.EMBED,), "/embed")
    prompt = model.prompts.pick(model.info.name, req.prompt_name)
    left = keeps_end(req.truncation_direction)
    check_dimensions(req.dimensions, model.info)
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    how = long_input(request, req.long_input, req.truncate, req.chunk_overlap)
    fitted = await encode_long(model, adm, texts, how, field="inputs", left=left, prompt=prompt)
    result = await model.infer(fitted.seqs, adm)
    rows = []
    for row in fitted.rows(result.rows):
        if req.normalize:
            if not model.info.normalized:
                norm = float(np.linalg.norm(row))
                row = row / norm if norm > 0 else row
            row = vector(row, req.dimensions)  # a truncated unit vector is re-normalised
        elif req.dimensions is not None:
            row = row[: req.dimensions]
        rows.append(row)
    return respond(float_json(np.stack(rows)), result, fitted.tokens)


async def embed_all(request: web.Request) -> web.Response:
    """``POST /embed_all``: ``{inputs, truncate, truncation_direction}`` → ``[[[float]]]``: for each
    input, its tokens' last hidden states (special tokens included, padding never), as
    sentence-transformers' ``encode(output_value="token_embeddings")`` gives them. The inputs run in
    batches of token requests only."""
    adm = admission(request)
    req = decode(await request.read(), TeiEmbedAllRequest)
    model = pick_model(request, req.model, (Task.EMBED,), "/embed_all")
    prompt = model.prompts.pick(model.info.name, req.prompt_name)
    left = keeps_end(req.truncation_direction)
    if not model.info.token_embeddings:
        raise InvalidRequest(
            f"Model '{model.info.name}' does not return token embeddings.", param="model", code="unsupported"
        )
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    how = long_input(request, req.long_input, req.truncate)
    if how.mode == "chunk" and req.long_input is not None:
        raise InvalidRequest(
            "/embed_all returns every token's vector, which windows of a long input cannot pool into: "
            "send long_input truncate or error (or use /embed, which chunks).",
            param="long_input",
            code="unsupported",
        )
    # Under --long-input chunk, an input too long for the model is refused by name, never cut silently.
    seqs = await encode_texts(model, adm, texts, cut=how.mode == "truncate", field="inputs", left=left,
                              prompt=prompt)
    result = await model.infer(seqs, adm, OutputKind.TOKENS)
    out = []
    at = 0
    for seq in seqs:
        out.append(float_json(result.rows[at : at + len(seq)]))
        at += len(seq)
    return respond(out, result, at)


async def similarity(request: web.Request) -> web.Response:
    """``POST /similarity``: ``{inputs: {source_sentence, sentences}, parameters}`` → ``[float]``, the
    cosine of each sentence's embedding with the source's. All of them are one request's inputs."""
    adm = admission(request)
    req = decode(await request.read(), SimilarityRequest)
    model = pick_model(request, req.model, (Task.EMBED,), "/similarity")
    params = req.parameters or SimilarityParameters()
    prompt = model.prompts.pick(model.info.name, params.prompt_name, "parameters.prompt_name")
    left = keeps_end(params.truncation_direction, "parameters.truncation_direction")
    source = req.inputs.source_sentence
    if not source:
        raise InvalidRequest(
            "'inputs.source_sentence' must not be empty.", param="inputs.source_sentence", code="empty_input"
        )
    sentences = checked_items(req.inputs.sentences, "inputs.sentences", request.app[SETTINGS].max_inputs)
    raw, prompt_len = await tokenize_texts(model, adm, [source, *sentences], prompt)
    how = long_input(request, params.long_input, params.truncate, params.chunk_overlap,
                     field="parameters.long_input", overlap_field="parameters.chunk_overlap")
    fit = partial(fit_long, model, how=how, left=left, prompt_len=prompt_len)
    first, rest = fit(raw[:1], field="inputs.source_sentence"), fit(raw[1:], field="inputs.sentences")
    result = await model.infer(first.seqs + rest.seqs, adm)
    split = len(first.seqs)
    rows = np.concatenate([first.rows(result.rows[:split]), rest.rows(result.rows[split:])])
    rows = rows.astype(np.float64)
    norms = np.linalg.norm(rows, axis=1)
    unit = rows / np.where(norms > 0, norms, 1.0)[:, None]
    return respond((unit[1:] @ unit[0]).tolist(), result, first.tokens + rest.tokens)


class _RootShape(msgspec.Struct):
    inputs: msgspec.Raw = msgspec.Raw()


_root_shape = msgspec.json.Decoder(_RootShape)


def _is_similarity(body: bytes) -> bool:
    """Whether ``inputs`` is an object (``{source_sentence, sentences}``): a similarity request."""
    try:
        inputs = bytes(_root_shape.decode(body).inputs)
    except msgspec.MsgspecError:
        return False
    return inputs.lstrip().startswith(b"{")


async def root(request: web.Request) -> web.StreamResponse:
    """``POST /``: like TEI, the route of the default (first) model's task — what ``huggingface_hub``'s
    ``InferenceClient`` (and so Haystack) posts to when given the server's URL. For an embedding model,
    a body whose ``inputs`` is ``{source_sentence, sentences}`` is a similarity request (TEI needs
    ``TASK=sentence-similarity`` for that; the body says it plainly)."""
    first = pick_model(request, None, _ALL_TASKS, "/")
    if first.info.task is Task.EMBED:
        if _is_similarity(await request.read()):
            return await similarity(request)
        return await embed(request)
    if first.info.task is Task.RERANK:
        return await rerank.rerank(request)
    return await classify.predict(request)


def add_routes(app: web.Application) -> None:
    """Register the TEI embedding routes on ``app``."""
    add_route(app, "POST", "/embed", embed, Dialect.TEI, doc=Doc(
        "Embed texts (TEI)", "TEI", list[list[float]], TeiEmbedRequest, fails=MODEL_ROUTE, queued=True,
    ))
    add_route(app, "POST", "/embed_all", embed_all, Dialect.TEI, doc=Doc(
        "Every token's embedding (TEI)", "TEI", list[list[list[float]]], TeiEmbedAllRequest,
        fails=MODEL_ROUTE, queued=True,
    ))
    add_route(app, "POST", "/similarity", similarity, Dialect.TEI, doc=Doc(
        "Sentence similarity (TEI)", "TEI", list[float], SimilarityRequest, fails=MODEL_ROUTE, queued=True,
    ))
    # The first model's task decides: a body and an answer of any of its routes' shapes.
    add_route(app, "POST", "/", root, Dialect.TEI, doc=Doc(
        "The first model's route (TEI)", "TEI",
        (list[list[float]], list[float], list[Prediction], list[list[Prediction]], list[TeiRank],
         RerankResponse),
        (TeiEmbedRequest, SimilarityRequest, PredictRequest, RerankRequest),
        fails=MODEL_ROUTE, queued=True, speaks=(Dialect.COHERE,),
    ))
