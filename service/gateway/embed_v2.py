"""``POST /v2/embed``: Cohere's v2 embed, so ``cohere.ClientV2(base_url=...).embed(...)`` works unchanged.

``{model, input_type, texts, embedding_types, truncate, output_dimension, max_tokens}`` →
``{id, embeddings: {type: [...]}, texts, meta: {api_version, billed_units: {input_tokens}},
response_type: "embeddings_by_type"}``, one list per requested type (``float``, ``int8``, ``uint8``,
``binary``, ``ubinary``, ``base64``; see ``quantize``), every one from the same rows. ``input_type``
picks the model's prompt by name (``search_query`` → ``query``, ``search_document`` → ``document`` or
``passage``, ...); ``truncate`` ``END`` (default) cuts a long text's end, ``START`` its start, ``NONE``
refuses it; our ``long_input`` (``chunk``: see ``windows``) wins over it, and ``--long-input``, when
set, is the default in its place; ``max_tokens`` bounds each window of a chunked text;
``output_dimension`` truncates and re-normalises, as ``dimensions`` does on the OpenAI route. Errors
speak Cohere's ``{"message"}``.
"""

from __future__ import annotations

import uuid

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task

from ..dialects import Dialect
from ..errors import InvalidRequest
from ..schemas import (
    ApiVersion,
    BilledUnits,
    EmbeddingsByType,
    EmbedV2Meta,
    EmbedV2Request,
    EmbedV2Response,
    decode,
)
from .admission import admission
from .contract import MODEL_ROUTE, Doc
from .inputs import check_dimensions, checked_items
from .models import pick_model
from .quantize import CALIBRATED, EMBEDDING_TYPES, base64_rows, quantize
from .responses import float_json, respond
from .routing import add_route
from .state import SETTINGS
from .windows import LongInput, encode_long, long_input

_TRUNCATE = ("NONE", "START", "END")


def _types(requested: list[str] | None) -> list[str]:
    """The embedding types asked for, each once, in order (default: float)."""
    types = list(dict.fromkeys(requested or ["float"]))
    if not types:
        raise InvalidRequest("'embedding_types' must not be empty.", param="embedding_types",
                             code="invalid_value")
    for i, kind in enumerate(types):
        if kind not in EMBEDDING_TYPES:
            raise InvalidRequest(
                f"embedding_types[{i}] is {kind!r}; it must be one of {', '.join(EMBEDDING_TYPES)}.",
                param=f"embedding_types[{i}]",
                code="invalid_value",
            )
    return types


def _unit_rows(rows: np.ndarray, dim: int | None) -> np.ndarray:
    """Rows truncated to ``dim`` and re-normalised (a truncated unit vector is no longer unit)."""
    if dim is None or dim >= rows.shape[1]:
        return rows
    cut = rows[:, :dim]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    out: np.ndarray = cut / np.where(norms > 0, norms, 1.0)
    return out


def _long_input(request: web.Request, req: EmbedV2Request) -> LongInput:
    """``long_input`` wins; then Cohere's ``truncate`` (NONE: error, START or END: truncate); without
    either, ``--long-input`` when the server sets it, else END (Cohere's default) as before."""
    if req.long_input is None and req.truncate is None and request.app[SETTINGS].long_input is None:
        return long_input(request, "truncate", overlap=req.chunk_overlap)
    given = None if req.truncate is None else req.truncate.upper() != "NONE"
    return long_input(request, req.long_input, given, req.chunk_overlap)


async def embed_v2(request: web.Request) -> web.Response:
    """``POST /v2/embed``."""
    adm = admission(request)
    req = decode(await request.read(), EmbedV2Request)
    model = pick_model(request, req.model, (Task.EMBED,), "/v2/embed")
    for name, given in (("images", req.images), ("inputs", req.inputs)):
        if given:
            raise InvalidRequest(f"'{name}' is not served here: send text as 'texts'.", param=name,
                                 code="unsupported")
    texts = checked_items(req.texts or [], "texts", request.app[SETTINGS].max_inputs)
    types = _types(req.embedding_types)
    check_dimensions(req.output_dimension, model.info, "output_dimension")
    truncate = (req.truncate or "END").upper()
    if truncate not in _TRUNCATE:
        raise InvalidRequest(f"'truncate' must be NONE, START or END; got {req.truncate!r}.",
                             param="truncate", code="invalid_value")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise InvalidRequest(f"'max_tokens' must be at least 1; got {req.max_tokens}.", param="max_tokens",
                             code="invalid_value")
    dim = req.output_dimension or model.info.dim
    scale = model.quantization_scale(dim) if CALIBRATED & set(types) else None
    if CALIBRATED & set(types) and scale is None:
        raise InvalidRequest(f"Model '{model.info.name}' has no calibration for int8/uint8 output.",
                             param="embedding_types", code="unsupported")
    prompt = model.prompts.for_input_type(model.info.name, req.input_type)
    how = _long_input(request, req)
    fitted = await encode_long(
        model, adm, texts, how, left=truncate == "START", field="texts",
        hint='send "truncate": "END"', prompt=prompt, limit=req.max_tokens,
    )
    result = await model.infer(fitted.seqs, adm)
    rows = _unit_rows(fitted.rows(result.rows), req.output_dimension)
    out: dict[str, object] = {}
    for kind in types:
        if kind == "float":
            out["float_"] = float_json(rows)
        elif kind == "base64":
            out["base64"] = base64_rows(rows)
        else:
            out[kind] = quantize(rows, kind, scale).tolist()
    tokens = fitted.tokens
    body = EmbedV2Response(
        id=uuid.uuid4().hex,
        embeddings=EmbeddingsByType(**out),  # type: ignore[arg-type]
        texts=texts,
        meta=EmbedV2Meta(api_version=ApiVersion(version="2"), billed_units=BilledUnits(input_tokens=tokens)),
    )
    return respond(body, result, tokens)


def add_routes(app: web.Application) -> None:
    """Register ``/v2/embed`` (Cohere's dialect) on ``app``."""
    add_route(app, "POST", "/v2/embed", embed_v2, Dialect.COHERE, doc=Doc(
        "Embed texts in compact types (Cohere v2)", "Cohere", EmbedV2Response, EmbedV2Request,
        fails=MODEL_ROUTE, queued=True,
    ))
