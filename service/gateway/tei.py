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
from coalesce.kernels.hf_runners import token_spans
from coalesce.kernels.protocol import Task

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
    encoder,
)
from . import classify, rerank
from .admission import submit_and_wait
from .embeddings import vector
from .models import ServedModel
from .state import MODELS, SETTINGS
from .tasks import checked_items, encode_texts, pick_model, respond

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
    req = decode(await request.read(), TeiEmbedRequest)
    served = pick_model(request, req.model, (Task.EMBED,), "/embed")
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
    dim = served.info.dim
    if req.dimensions is not None and not 1 <= req.dimensions <= dim:
        raise InvalidRequest(
            f"'dimensions' must be between 1 and {dim} for model '{served.info.name}'; got {req.dimensions}.",
            param="dimensions",
            code="invalid_dimensions",
        )
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    seqs = await encode_texts(
        request, served, texts, truncate=req.truncate, field="inputs", left=direction == "left"
    )
    results = await submit_and_wait(request, served, seqs)
    rows = []
    for r in results:
        row = r.row
        if req.normalize:
            if not served.info.normalized:
                norm = float(np.linalg.norm(row))
                row = row / norm if norm > 0 else row
            row = vector(row, req.dimensions)  # a truncated unit vector is re-normalised
        elif req.dimensions is not None:
            row = row[: req.dimensions]
        rows.append(row.tolist())
    return respond(rows, results, sum(len(s) for s in seqs))


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
    served = pick_model(request, request.query.get("model"), _ALL_TASKS, "/info")
    settings = request.app[SETTINGS]
    body = TeiInfo(
        model_id=served.info.name,
        model_type=_model_type(served),
        max_input_length=served.info.max_tokens,
        max_batch_tokens=settings.max_batch_tokens,
        max_batch_requests=settings.max_batch_size,
        max_client_batch_size=settings.max_inputs,
        auto_truncate=settings.truncate,
        version=_version(),
        models=[ServedTask(id=m.info.name, task=str(m.info.task)) for m in request.app[MODELS].models],
    )
    return web.Response(body=encoder.encode(body), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: each input's tokens as ``{id, text, special, start, stop}`` (character offsets)."""
    req = decode(await request.read(), TokenizeRequest)
    served = pick_model(request, req.model, _ALL_TASKS, "/tokenize")
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    spans = await asyncio.get_running_loop().run_in_executor(
        None, token_spans, served.runner, texts, req.add_special_tokens
    )
    body = [[SimpleToken(s.id, s.text, s.special, s.start, s.stop) for s in row] for row in spans]
    return web.Response(body=encoder.encode(body), content_type="application/json")


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
