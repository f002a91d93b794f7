"""The OpenAI embeddings route: validate, tokenise, submit to the batcher, fan results back in order."""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task

from ..errors import InvalidRequest
from ..schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse, Usage, decode, encoder
from .admission import submit_and_wait, timing_headers
from .models import ServedModel, check_ids
from .state import MODELS, SETTINGS, require_ready
from .tasks import checked_items, encode_texts, fit_sequences, require_task


def parse_inputs(
    raw: str | list[str | int | list[int]], max_inputs: int
) -> tuple[list[str], list[list[int]]]:
    """Split ``input`` into texts or token arrays (never both), rejecting what OpenAI rejects."""
    items = [raw] if isinstance(raw, str) else raw
    if items and all(isinstance(x, int) for x in items):  # one token array
        return [], [list(items)]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in items):
        return checked_items(items, "input", max_inputs), []  # type: ignore[arg-type]
    if all(isinstance(x, list) for x in items):
        return [], checked_items(items, "input", max_inputs)  # type: ignore[arg-type]
    raise InvalidRequest(
        "'input' must be a string, a list of strings, a token array, or a list of token arrays — not a mix.",
        param="input",
        code="invalid_type",
    )


async def encode_inputs(
    request: web.Request, served: ServedModel, texts: Sequence[str], arrays: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Complete id sequences (special tokens added, truncated or rejected per ``--truncate``)."""
    hint = "run the server without --no-truncate"  # this route has no per-request truncate field
    if texts:
        return await encode_texts(request, served, texts, truncate=None, field="input", hint=hint)
    for i, arr in enumerate(arrays):
        check_ids(arr, served.info.vocab_size, i)
    return fit_sequences(request, served, arrays, truncate=None, field="input", hint=hint)


def vector(row: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Truncate to ``dimensions`` and re-normalise (a truncated unit vector is no longer unit)."""
    if dimensions is None or dimensions >= row.shape[0]:
        return row
    cut = row[:dimensions]
    norm = float(np.linalg.norm(cut))
    return cut / norm if norm > 0 else cut


def encode_vector(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    out: list[float] = v.tolist()
    return out


async def create_embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings`` (and ``/embeddings``)."""
    req = decode(await request.read(), EmbeddingRequest)
    require_ready(request)
    served = request.app[MODELS].get(req.model)
    require_task(request, served, (Task.EMBED,), "/v1/embeddings")
    info = served.info
    if req.dimensions is not None and not 1 <= req.dimensions <= info.dim:
        raise InvalidRequest(
            f"'dimensions' must be between 1 and {info.dim} for model '{info.name}'; got {req.dimensions}.",
            param="dimensions",
            code="invalid_dimensions",
        )
    texts, arrays = parse_inputs(req.input, request.app[SETTINGS].max_inputs)
    seqs = await encode_inputs(request, served, texts, arrays)
    results = await submit_and_wait(request, served, seqs)
    data = [
        EmbeddingData(index=i, embedding=encode_vector(vector(r.row, req.dimensions), req.encoding_format))
        for i, r in enumerate(results)
    ]
    tokens = sum(len(s) for s in seqs)
    body = EmbeddingResponse(
        data=data, model=info.name, usage=Usage(prompt_tokens=tokens, total_tokens=tokens)
    )
    headers = timing_headers(results)
    headers["x-compute-tokens"] = str(tokens)
    return web.Response(body=encoder.encode(body), content_type="application/json", headers=headers)
