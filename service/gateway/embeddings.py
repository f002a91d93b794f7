"""The OpenAI embeddings route: admission, validation, inputs fitted to the model, one ``infer``, and the
rows back in input order (``dimensions`` truncates and re-normalises; ``base64`` is packed float32)."""

from __future__ import annotations

from binascii import b2a_base64
from typing import cast

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task

from ..schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse, Usage, decode
from .admission import Admission, admission
from .facade import ServedModel
from .inputs import (
    MODEL_DEFAULT,
    ModelDefault,
    check_dimensions,
    check_ids,
    parse_inputs,
)
from .models import pick_model
from .responses import float_json, respond
from .state import SETTINGS
from .windows import Fitted, LongInput, encode_long, fit_long, long_input

# The OpenAI route has no truncate field of its own: long_input, else the server's --long-input.
_HINT = 'send "long_input": "truncate" or "chunk"'


async def encode_inputs(
    request: web.Request,
    model: ServedModel,
    adm: Admission,
    raw: str | list[str | int | list[int]],
    prompt: str | ModelDefault | None = MODEL_DEFAULT,
    how: LongInput | None = None,
    hint: str = _HINT,
) -> Fitted:
    """Complete id sequences for OpenAI's ``input`` (texts, or token arrays checked against the
    model's vocabulary) behind ``prompt`` (a token array gets the prompt's tokens in front), a long
    one truncated, chunked or rejected per ``how`` (default: ``--long-input``)."""
    texts, arrays = parse_inputs(raw, request.app[SETTINGS].max_inputs)
    how = how or long_input(request, None)
    if texts:
        return await encode_long(model, adm, texts, how, field="input", hint=hint, prompt=prompt)
    for i, arr in enumerate(arrays):
        check_ids(arr, model.info.vocab_size, i)
    model.check_room(adm, len(arrays[0]), sum(map(len, arrays)), len(arrays))
    text = model.prompts.default if isinstance(prompt, ModelDefault) else prompt
    head = model.tokens.tokenize([text])[0] if text else []
    return fit_long(model, [[*head, *arr] for arr in arrays], how, field="input", hint=hint,
                    prompt_len=len(head))


def vector(row: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Truncate to ``dimensions`` and re-normalise (a truncated unit vector is no longer unit)."""
    if dimensions is None or dimensions >= row.shape[0]:
        return row
    cut = row[:dimensions]
    norm = float(np.linalg.norm(cut))
    return cut / norm if norm > 0 else cut


def encode_vector(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        # (binascii: base64.b64encode's own call, without its wrapper)
        return b2a_base64(np.ascontiguousarray(v, dtype="<f4").tobytes(), newline=False).decode("ascii")
    return cast(list[float], float_json(v))  # the list, already encoded


async def create_embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings`` (and ``/embeddings``)."""
    adm = admission(request)
    req = decode(await request.read(), EmbeddingRequest)
    model = pick_model(request, req.model, (Task.EMBED,), "/v1/embeddings", required=True)
    check_dimensions(req.dimensions, model.info)
    prompt = model.prompts.pick(model.info.name, req.prompt_name)
    how = long_input(request, req.long_input, overlap=req.chunk_overlap)
    fitted = await encode_inputs(request, model, adm, req.input, prompt, how)
    result = await model.infer(fitted.seqs, adm)
    data = [
        EmbeddingData(index=i, embedding=encode_vector(vector(row, req.dimensions), req.encoding_format))
        for i, row in enumerate(fitted.rows(result.rows))
    ]
    tokens = fitted.tokens
    body = EmbeddingResponse(
        data=data, model=model.info.name, usage=Usage(prompt_tokens=tokens, total_tokens=tokens)
    )
    return respond(body, result, tokens)
