"""The TEI routes about a model rather than through it: ``GET /info``, ``POST /tokenize``, ``POST /decode``.

None of them queues work for the model. ``/info`` carries every field TEI's ``Info`` requires, each
with a value that is true of this server (see :func:`info`); ``/tokenize`` and ``/decode`` run on the
model's own tokenizer, on the gateway's tokenizer thread for that model (the one ``/info`` counts in
``tokenization_workers``). Errors are TEI's dialect.
"""

from __future__ import annotations

from aiohttp import web
from coalesce.kernels.protocol import Task

from ..dialects import Dialect
from ..errors import InvalidRequest
from ..schemas import (
    ClassifierModelType,
    DecodeRequest,
    EmbeddingModelType,
    ModelType,
    ServedTask,
    SimpleToken,
    TeiInfo,
    TokenizeRequest,
    decode,
)
from .contract import MODEL, MODEL_ROUTE, TOKEN_IDS, Doc
from .facade import TOKENIZER_THREADS, ServedModel
from .inputs import checked_items
from .models import MODELS, pick_model
from .responses import json_response
from .routing import add_route
from .state import SETTINGS

_ALL_TASKS = tuple(Task)


def _version() -> str:
    # Imported here, at the first /info: a start need not import it.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("coalesce")
    except PackageNotFoundError:
        return "unknown"


def _model_type(served: ServedModel) -> ModelType:
    info = served.info
    if info.task is Task.EMBED:
        return ModelType(embedding=EmbeddingModelType(pooling="sentence-transformers"))
    if info.task is Task.SPARSE:
        return ModelType(embedding=EmbeddingModelType(pooling="splade"))  # how TEI describes a SPLADE model
    labels = ClassifierModelType(
        id2label={str(i): label for i, label in enumerate(info.labels)},
        label2id={label: i for i, label in enumerate(info.labels)},
    )
    return ModelType(classifier=labels) if info.task is Task.CLASSIFY else ModelType(reranker=labels)


async def info(request: web.Request) -> web.Response:
    """``GET /info[?model=NAME]``: TEI's description of one model (default: the first), plus every
    served model and its task under ``models``.

    Where each value comes from: ``model_dtype`` — the precision the engine's runner computes in;
    ``max_concurrent_requests`` — the most requests the model's queue bound (``--max-queued-tokens``)
    can hold at once, each as short as an input can be (one token and the special tokens);
    ``max_batch_tokens``/``max_batch_requests`` — the batch limits the scheduler applies;
    ``max_client_batch_size`` — ``--max-inputs``; ``tokenization_workers`` — the threads that tokenise
    this model's inputs, two per gateway process (queries and bulk requests apart) times ``--workers``;
    ``served_model_name`` — the name requests use; ``prompts`` — the model's sentence-transformers
    prompts (null when it has none); our ``default_prompt``, the text applied when a request names none,
    and ``quantization_scale``, the fixed step of int8 output at full width (``x ≈ int8 × scale``). No
    build hash, image label or model revision is known here: those are null.
    """
    model = pick_model(request, request.query.get("model"), _ALL_TASKS, "/info")
    settings = request.app[SETTINGS]
    shortest = model.specials + 1
    scale = model.quantization_scale(model.info.dim)
    body = TeiInfo(
        model_id=model.info.name,
        model_sha=None,
        model_dtype=model.info.dtype,
        model_type=_model_type(model),
        max_concurrent_requests=max(1, settings.max_queued_tokens // shortest),
        max_input_length=model.info.max_tokens,
        max_batch_tokens=max(settings.max_batch_tokens, model.info.max_tokens),
        max_batch_requests=settings.max_batch_size,
        max_client_batch_size=settings.max_inputs,
        auto_truncate=settings.truncate,
        tokenization_workers=TOKENIZER_THREADS * settings.workers,
        version=_version(),
        sha=None,
        docker_label=None,
        served_model_name=model.info.name,
        prompts=model.prompts.named or None,
        default_prompt=model.prompts.default,
        quantization_scale=scale,
        models=[ServedTask(id=m.info.name, task=str(m.info.task)) for m in request.app[MODELS].models],
    )
    return json_response(body)


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: each input's tokens as ``{id, text, special, start, stop}`` (character offsets)."""
    req = decode(await request.read(), TokenizeRequest)
    model = pick_model(request, req.model, _ALL_TASKS, "/tokenize")
    texts = checked_items(req.inputs, "inputs", request.app[SETTINGS].max_inputs)
    spans = await model.spans(texts, req.add_special_tokens)
    body = [[SimpleToken(s.id, s.text, s.special, s.start, s.stop) for s in row] for row in spans]
    return json_response(body)


def _id_batch(ids: list[int | list[int]], max_inputs: int) -> list[list[int]]:
    """TEI's ``ids``: one sequence (``[int]``) or a batch of them (``[[int]]``), never a mix."""
    if not ids:
        raise InvalidRequest("'ids' must not be empty.", param="ids", code="empty_input")
    if all(isinstance(x, int) for x in ids):
        return [ids]  # type: ignore[list-item]
    if not all(isinstance(x, list) for x in ids):
        raise InvalidRequest(
            "'ids' must be one token id sequence or a list of them, not a mix.",
            param="ids",
            code="invalid_type",
        )
    return checked_items(ids, "ids", max_inputs)  # type: ignore[arg-type]


async def decode_ids(request: web.Request) -> web.Response:
    """``POST /decode``: ``{ids: [int] | [[int]], skip_special_tokens}`` → ``[str]``, one text per
    sequence (a single sequence gets a list of one, as TEI answers)."""
    req = decode(await request.read(), DecodeRequest)
    model = pick_model(request, req.model, _ALL_TASKS, "/decode")
    batch = _id_batch(req.ids, request.app[SETTINGS].max_inputs)
    vocab = model.info.vocab_size
    for i, seq in enumerate(batch):
        bad = next((t for t in seq if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"Token id {bad} in sequence {i} is outside model '{model.info.name}''s vocabulary "
                f"(0..{vocab - 1}).",
                param=f"ids[{i}]" if len(batch) > 1 or isinstance(req.ids[0], list) else "ids",
                code="invalid_token_id",
            )
    return json_response(await model.decode(batch, req.skip_special_tokens))


def add_routes(app: web.Application) -> None:
    """Register ``/info``, ``/tokenize`` and ``/decode`` on ``app``."""
    add_route(app, "GET", "/info", info, Dialect.TEI, doc=Doc(
        "Describe a model (TEI)", "TEI", TeiInfo, fails=MODEL,
        query=(("model", "The model to describe (default: the first served)."),),
    ))
    add_route(app, "POST", "/tokenize", tokenize, Dialect.TEI, doc=Doc(
        "Tokenize texts (TEI)", "TEI", list[list[SimpleToken]], TokenizeRequest, fails=MODEL_ROUTE,
    ))
    add_route(app, "POST", "/decode", decode_ids, Dialect.TEI, doc=Doc(
        "Decode token ids (TEI)", "TEI", list[str], DecodeRequest, fails=(*MODEL_ROUTE, *TOKEN_IDS),
    ))
