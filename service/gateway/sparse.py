"""``POST /embed_sparse``: TEI's sparse embeddings, for SPLADE-style models (task ``sparse``).

``{inputs, truncate, truncation_direction, prompt_name}`` → ``[[{"index", "value"}]]``: per input, the
vocabulary entries with a non-zero weight, in index order (zeros omitted), as
``SparseEncoder.encode`` gives them. Sparse inputs batch like every other input; the engine returns
full-vocabulary rows and the non-zero entries are picked here. TEI's errors.
"""

from __future__ import annotations

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task

from ..dialects import Dialect
from ..schemas import SparseValue, TeiEmbedSparseRequest, decode
from .admission import admission
from .contract import MODEL_ROUTE, Doc
from .inputs import checked_items, encode_texts, truncating
from .models import pick_model
from .responses import respond
from .routing import add_route
from .state import SETTINGS
from .tei import keeps_end


def nonzero(row: np.ndarray) -> list[SparseValue]:
    """A row's non-zero entries, in index order."""
    (indices,) = np.nonzero(row)
    return [SparseValue(int(i), float(v)) for i, v in zip(indices, row[indices], strict=True)]


async def embed_sparse(request: web.Request) -> web.Response:
    """``POST /embed_sparse``: per input, the non-zero vocabulary weights of a SPLADE model, in index
    order."""
    adm = admission(request)
    req = decode(await request.read(), TeiEmbedSparseRequest)
    model = pick_model(request, req.model, (Task.SPARSE,), "/embed_sparse")
    prompt = model.prompts.pick(model.info.name, req.prompt_name)
    left = keeps_end(req.truncation_direction)
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    cut = truncating(request, req.truncate)
    seqs = await encode_texts(model, adm, texts, cut=cut, field="inputs", left=left, prompt=prompt)
    result = await model.infer(seqs, adm)
    return respond([nonzero(row) for row in result.rows], result, sum(len(s) for s in seqs))


def add_routes(app: web.Application) -> None:
    """Register ``/embed_sparse`` (TEI's dialect) on ``app``."""
    add_route(app, "POST", "/embed_sparse", embed_sparse, Dialect.TEI, doc=Doc(
        "Sparse embeddings (TEI)", "TEI", list[list[SparseValue]], TeiEmbedSparseRequest, fails=MODEL_ROUTE,
        queued=True,
    ))
