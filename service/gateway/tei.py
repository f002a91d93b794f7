"""Text Embeddings Inference (TEI) routes: ``POST /embed``, ``GET /info``, ``POST /tokenize``, ``POST /``.

So clients written for TEI work unchanged: LlamaIndex's ``TextEmbeddingsInference`` posts ``{inputs,
truncate}`` to ``/embed``; Haystack's TEI embedders go through ``huggingface_hub``'s
``InferenceClient``, which posts ``{inputs}`` to the server's root. TEI serves one model, so its
requests name none: they get the first served model of the right task; ``model`` may be added to
choose another. ``/predict`` and ``/rerank`` live with their tasks (classify.py, rerank.py).
"""

from __future__ import annotations

import asyncio

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task
from coalesce.kernels.tokens import TokenizerAdapter

from ..errors import InvalidRequest
from ..schemas import (
    ClassifierModelType,
    EmbeddingModelType,
    ServedTask,
    SimpleToken,
    TeiEmbedRequest,
    TeiInfo,
    TokenizeRequest,
    decode,
)
from . import classify, rerank
from .admission import admission
from .embeddings import vector
from .facade import ServedModel
from .inputs import check_dimensions, checked_items, encode_texts, truncating
from .models import MODELS, pick_model
from .responses import json_response, respond
from .state import SETTINGS

_ALL_TASKS = tuple(Task)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("coalesce")
    except PackageNotFoundError:
        return "unknown"


async def embed(request: web.Request) -> web.Response:
    """``POST /embed``: ``{inputs, normalize, truncate, truncation_direction, dimensions}`` →
    ``[[float]]``."""
    adm = admission(request)
    req = decode(await request.read(), TeiEmbedRequest)
    model = pick_model(request, req.model, (Task.EMBED,), "/embed")
    if req.prompt_name is not None:
        raise InvalidRequest(
            "This server applies no prompts; put the prompt in front of the text.",
            param="prompt_name",
            code="unsupported",
        )
    direction = req.truncation_direction.lower()
    if direction not in ("left", "right"):
        raise InvalidRequest(
            f"'truncation_direction' must be left or right; got {req.truncation_direction!r}.",
            param="truncation_direction",
            code="invalid_value",
        )
    check_dimensions(req.dimensions, model.info)
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    seqs = await encode_texts(
        model, adm, texts, cut=truncating(request, req.truncate), field="inputs", left=direction == "left"
    )
    result = await model.infer(seqs, adm)
    rows = []
    for row in result.rows:
        if req.normalize:
            if not model.info.normalized:
                norm = float(np.linalg.norm(row))
                row = row / norm if norm > 0 else row
            row = vector(row, req.dimensions)  # a truncated unit vector is re-normalised
        elif req.dimensions is not None:
            row = row[: req.dimensions]
        rows.append(row.tolist())
    return respond(rows, result, sum(len(s) for s in seqs))


def _model_type(served: ServedModel) -> dict[str, EmbeddingModelType | ClassifierModelType]:
    info = served.info
    if info.task is Task.EMBED:
        return {"embedding": EmbeddingModelType(pooling="sentence-transformers")}
    labels = ClassifierModelType(
        id2label={str(i): label for i, label in enumerate(info.labels)},
        label2id={label: i for i, label in enumerate(info.labels)},
    )
    return {"classifier" if info.task is Task.CLASSIFY else "reranker": labels}


async def info(request: web.Request) -> web.Response:
    """``GET /info[?model=NAME]``: TEI's description of one model (default: the first), plus every
    served model and its task under ``models``."""
    model = pick_model(request, request.query.get("model"), _ALL_TASKS, "/info")
    settings = request.app[SETTINGS]
    body = TeiInfo(
        model_id=model.info.name,
        model_type=_model_type(model),
        max_input_length=model.info.max_tokens,
        max_batch_tokens=settings.max_batch_tokens,
        max_batch_requests=settings.max_batch_size,
        max_client_batch_size=settings.max_inputs,
        auto_truncate=settings.truncate,
        version=_version(),
        models=[ServedTask(id=m.info.name, task=str(m.info.task)) for m in request.app[MODELS].models],
    )
    return json_response(body)


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: each input's tokens as ``{id, text, special, start, stop}`` (character offsets)."""
    req = decode(await request.read(), TokenizeRequest)
    model = pick_model(request, req.model, _ALL_TASKS, "/tokenize")
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    tokens = model.tokens
    if not isinstance(tokens, TokenizerAdapter):
        raise InvalidRequest(
            f"Model '{model.info.name}' has no tokenizer offsets to show.", param="model", code="unsupported"
        )
    spans = await asyncio.get_running_loop().run_in_executor(
        None, tokens.spans, texts, req.add_special_tokens
    )
    body = [[SimpleToken(s.id, s.text, s.special, s.start, s.stop) for s in row] for row in spans]
    return json_response(body)


async def root(request: web.Request) -> web.StreamResponse:
    """``POST /``: like TEI, the route of the default (first) model's task — what ``huggingface_hub``'s
    ``InferenceClient`` (and so Haystack) posts to when given the server's URL."""
    first = pick_model(request, None, _ALL_TASKS, "/")
    if first.info.task is Task.EMBED:
        return await embed(request)
    if first.info.task is Task.RERANK:
        return await rerank.rerank(request)
    return await classify.predict(request)


def add_routes(app: web.Application) -> None:
    """Register the TEI routes on ``app``."""
    app.router.add_post("/embed", embed)
    app.router.add_get("/info", info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/", root)
