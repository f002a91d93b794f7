"""Classification routes: Infinity's ``POST /classify`` and TEI's ``POST /predict``.

A classifier model's logits become scores with the activation its config asks for (softmax, or
sigmoid for multi-label and single-output models); ``raw_scores`` returns the logits.

Zero-shot: ``/classify`` with ``labels`` against an *embedding* model scores each input by the cosine
similarity of its embedding to each label's, turned into a distribution by a softmax at
``ZERO_SHOT_SCALE`` (``raw_scores`` returns the cosines). Label embeddings are cached per model, so a
fixed label set costs one embedding per label for the life of the process. This makes classification
work offline with the embedded default model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import Task

from ..dialects import Dialect
from ..errors import InvalidRequest
from ..schemas import ClassifyRequest, ClassifyResponse, Prediction, PredictRequest, Usage, decode
from .admission import Admission, admission
from .contract import MODEL_ROUTE, TOKEN_IDS, Doc
from .embeddings import encode_inputs
from .facade import ServedModel
from .inputs import checked_items, encode_pairs, encode_texts, truncating
from .llm_pairs import instruction_for, rerank_limit
from .models import pick_model
from .responses import activate, ranked, respond
from .routing import add_route
from .state import SETTINGS
from .windows import LongInput

# Cosine similarities of one input to its labels sit close together (say 0.1..0.6); the softmax scale
# sentence-transformers trains with (MultipleNegativesRankingLoss, 20) spreads them into a usable
# distribution without making the runner-up vanish.
ZERO_SHOT_SCALE = 20.0
LABEL_CACHE_SIZE = 4096


class LabelCache:
    """(model, label) → unit label embedding, least recently used dropped first. Event loop only."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._rows: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()

    def get(self, model: str, label: str) -> np.ndarray | None:
        row = self._rows.get((model, label))
        if row is not None:
            self._rows.move_to_end((model, label))
        return row

    def put(self, model: str, label: str, row: np.ndarray) -> None:
        self._rows[(model, label)] = row
        self._rows.move_to_end((model, label))
        while len(self._rows) > self._size:
            self._rows.popitem(last=False)


LABELS = web.AppKey("label_cache", LabelCache)


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    out: np.ndarray = rows / np.where(norms > 0, norms, 1.0)
    return out


def _check_labels(labels: Sequence[str], max_inputs: int) -> list[str]:
    checked = checked_items(labels, "labels", max_inputs)
    if len(set(checked)) != len(checked):
        raise InvalidRequest("'labels' must not repeat a label.", param="labels", code="duplicate_labels")
    return checked


async def classify(request: web.Request) -> web.Response:
    """``POST /classify`` (and ``/v1/classify``): Infinity's shape, zero-shot when ``labels`` is given."""
    adm = admission(request)
    req = decode(await request.read(), ClassifyRequest)
    settings = request.app[SETTINGS]
    accepts = (Task.EMBED,) if req.labels is not None and req.model is None else (Task.CLASSIFY, Task.EMBED)
    model = pick_model(request, req.model, accepts, "/classify")
    if model.info.task is Task.EMBED:
        if req.labels is None:
            raise InvalidRequest(
                f"Model '{model.info.name}' is an embedding model: pass 'labels' to classify zero-shot "
                "against them, or name a classifier model.",
                param="labels",
                code="missing_labels",
            )
        labels = _check_labels(req.labels, settings.max_inputs)
        seqs = (await encode_inputs(request, model, adm, req.input, how=_cut_or_refuse(request),
                                     hint=_HINT)).seqs
        return await _zero_shot(request, model, adm, seqs, labels, req.raw_scores)
    if req.labels is not None:
        raise InvalidRequest(
            f"Model '{model.info.name}' is a classifier with its own labels "
            f"({', '.join(model.info.labels)}); "
            "'labels' is for zero-shot classification with an embedding model.",
            param="labels",
            code="unexpected_labels",
        )
    seqs = (await encode_inputs(request, model, adm, req.input, how=_cut_or_refuse(request),
                                     hint=_HINT)).seqs
    result = await model.infer(seqs, adm)
    scores = result.rows if req.raw_scores else activate(result.rows, model.info.activation)
    tokens = sum(len(s) for s in seqs)
    body = ClassifyResponse(
        data=[ranked(row, model.info.labels) for row in scores],
        model=model.info.name,
        usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return respond(body, result, tokens)


_HINT = "run the server without --no-truncate"


def _cut_or_refuse(request: web.Request) -> LongInput:
    """Classification truncates (or, under --no-truncate, refuses) a long input: a label's score is
    not a mean over windows, so --long-input chunk is for embedding routes only."""
    return LongInput("truncate" if truncating(request, None) else "error")


async def _zero_shot(
    request: web.Request,
    model: ServedModel,
    adm: Admission,
    seqs: list[list[int]],
    labels: list[str],
    raw_scores: bool,
) -> web.Response:
    """Score inputs against label embeddings; labels not cached yet ride in the same request."""
    cache = request.app[LABELS]
    name = model.info.name
    known = {label: row for label in labels if (row := cache.get(name, label)) is not None}
    missing = [label for label in labels if label not in known]
    label_seqs = await encode_texts(model, adm, missing, cut=True, field="labels") if missing else []
    result = await model.infer([*seqs, *label_seqs], adm)
    for label, row in zip(missing, result.rows[len(seqs) :], strict=True):
        known[label] = _unit(row)
        cache.put(name, label, known[label])
    label_rows = np.stack([known[label] for label in labels])
    inputs = _unit(result.rows[: len(seqs)])
    cosines = inputs @ label_rows.T
    scores = cosines if raw_scores else activate(cosines * ZERO_SHOT_SCALE, "softmax")
    tokens = sum(len(s) for s in seqs) + sum(len(s) for s in label_seqs)
    body = ClassifyResponse(
        data=[ranked(row, labels) for row in scores],
        model=name,
        usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return respond(body, result, tokens)


def _predict_items(raw: str | list[str | list[str]]) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's ``inputs``: (texts and pairs, whether it was a batch). ``["a", "b"]`` is one pair."""
    if isinstance(raw, str):
        return [raw], False
    if not raw:
        raise InvalidRequest("'inputs' must not be an empty list.", param="inputs", code="empty_input")
    strings = [x for x in raw if isinstance(x, str)]
    if len(strings) == len(raw):
        if len(strings) > 2:
            raise InvalidRequest(
                "A list of strings in 'inputs' is one text [a] or one pair [a, b]; send a batch as "
                "[[a], [a, b], ...].",
                param="inputs",
                code="invalid_type",
            )
        return [strings[0] if len(strings) == 1 else (strings[0], strings[1])], False
    items: list[str | tuple[str, str]] = []
    for i, x in enumerate(raw):
        if not isinstance(x, list) or len(x) not in (1, 2):
            raise InvalidRequest(
                f"inputs[{i}] must be [text] or [text, text] in a batch.",
                param=f"inputs[{i}]",
                code="invalid_type",
            )
        items.append(x[0] if len(x) == 1 else (x[0], x[1]))
    return items, True


async def predict(request: web.Request) -> web.Response:
    """``POST /predict``: TEI's classification shape; texts and pairs may be mixed in one batch."""
    adm = admission(request)
    req = decode(await request.read(), PredictRequest)
    model = pick_model(request, req.model, (Task.CLASSIFY, Task.RERANK), "/predict")
    items, batch = _predict_items(req.inputs)
    max_inputs = request.app[SETTINGS].max_inputs
    if len(items) > max_inputs:
        raise InvalidRequest(
            f"'inputs' has {len(items)} items; at most {max_inputs} are allowed.",
            param="inputs",
            code="too_many_inputs",
        )
    for i, item in enumerate(items):
        if not all(item if isinstance(item, tuple) else (item,)):
            raise InvalidRequest(
                "Inputs must not be empty strings.", param=f"inputs[{i}]", code="empty_input"
            )
    cut = truncating(request, req.truncate)
    singles = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
    if singles and model.info.rerank_template is not None:
        raise InvalidRequest(
            f"Model '{model.info.name}' is an LLM reranker: it judges [query, document] pairs, so "
            f"inputs[{singles[0][0]}] must be a pair.",
            param=f"inputs[{singles[0][0]}]",
            code="invalid_type",
        )
    pairs = [(i, item) for i, item in enumerate(items) if isinstance(item, tuple)]
    seqs: list[list[int]] = [[] for _ in items]
    if singles:
        encoded = await encode_texts(
            model, adm, [t for _, t in singles], cut=cut, field="inputs", positions=[i for i, _ in singles]
        )
        for (i, _), seq in zip(singles, encoded, strict=True):
            seqs[i] = seq
    if pairs:
        encoded_pairs = await encode_pairs(
            model, adm, [p for _, p in pairs], cut=cut, field="inputs", positions=[i for i, _ in pairs],
            limit=rerank_limit(request.app[SETTINGS], model),
            instruction=instruction_for(request, model, None),
        )
        for (i, _), pair_seq in zip(pairs, encoded_pairs, strict=True):
            seqs[i] = pair_seq
    result = await model.infer(seqs, adm)
    scores = result.rows if req.raw_scores else activate(result.rows, model.info.activation)
    preds: list[list[Prediction]] = [ranked(row, model.info.labels) for row in scores]
    return respond(preds if batch else preds[0], result, sum(len(s) for s in seqs))


def add_routes(app: web.Application) -> None:
    """Register the classification routes and the zero-shot label cache on ``app``."""
    app[LABELS] = LabelCache(LABEL_CACHE_SIZE)
    doc = Doc("Classify texts, or zero-shot against labels (Infinity)", "Classification", ClassifyResponse,
              ClassifyRequest, fails=(*MODEL_ROUTE, *TOKEN_IDS), queued=True)
    add_route(app, "POST", "/classify", classify, doc=doc)
    add_route(app, "POST", "/v1/classify", classify, doc=doc)
    add_route(app, "POST", "/predict", predict, Dialect.TEI, doc=Doc(
        "Classify texts or pairs (TEI)", "TEI", (list[Prediction], list[list[Prediction]]), PredictRequest,
        fails=MODEL_ROUTE, queued=True,
    ))
