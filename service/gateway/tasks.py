"""What the classify, rerank and TEI routes share: picking a served model by task, fitting texts and
text pairs to it, and turning logits into scores.

Every route here resolves its model through :func:`pick_model`, so calling a model with the wrong task
(``/rerank`` on an embedding model, ``/embed`` on a classifier) is a 400 that says which models serve
what, never a 500 or a silent wrong answer. TEI's request shapes carry no ``model``: they get the first
served model of the right task (``--model`` order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import PairIds, PairRunner, Task

from ..batching.batcher import ItemResult
from ..errors import InvalidRequest
from ..schemas import Prediction, encoder
from .admission import timing_headers
from .models import ServedModel
from .state import MODELS, SETTINGS, require_ready

T = TypeVar("T", str, list[int])


def catalog(request: web.Request) -> str:
    """``name (task), ...`` for every served model, for error messages."""
    return ", ".join(f"{m.info.name} ({m.info.task})" for m in request.app[MODELS].models)


_KIND = {Task.EMBED: "an embedding", Task.CLASSIFY: "a classification", Task.RERANK: "a reranking"}


def pick_model(request: web.Request, name: str | None, accepts: Sequence[Task], route: str) -> ServedModel:
    """The model ``name`` (or, when None, the first served one of an accepted task), checked to serve
    one of ``accepts``. Raises 503 before the models are ready, 404 for an unknown name, 400 otherwise."""
    require_ready(request)
    if name is None:
        for served in request.app[MODELS].models:
            if served.info.task in accepts:
                return served
        wanted = " or ".join(_KIND[t] for t in accepts)
        raise InvalidRequest(
            f"{route} needs {wanted} model and this server serves none: {catalog(request)}.",
            param="model",
            code="no_model_for_task",
        )
    served = request.app[MODELS].get(name)
    require_task(request, served, accepts, route)
    return served


def require_task(request: web.Request, served: ServedModel, accepts: Sequence[Task], route: str) -> None:
    """A precise 400 when ``served`` does not do what ``route`` needs (e.g. /rerank on an embedder)."""
    if served.info.task not in accepts:
        wanted = " or ".join(_KIND[t] for t in accepts)
        raise InvalidRequest(
            f"Model '{served.info.name}' is {_KIND[served.info.task]} model; {route} needs {wanted} model. "
            f"This server serves: {catalog(request)}.",
            param="model",
            code="wrong_task",
        )


def checked_items(raw: T | Sequence[T], field: str, max_inputs: int) -> list[T]:
    """A single item or a non-empty list of non-empty items (texts or token arrays), at most
    ``max_inputs`` of them; a precise 400 naming ``field`` (or the offending element) otherwise."""
    items: list[T] = [raw] if isinstance(raw, str) else list(raw)  # type: ignore[arg-type]
    if not items:
        raise InvalidRequest(f"'{field}' must not be an empty list.", param=field, code="empty_input")
    if len(items) > max_inputs:
        raise InvalidRequest(
            f"'{field}' has {len(items)} items; at most {max_inputs} are allowed per request.",
            param=field,
            code="too_many_inputs",
        )
    for i, item in enumerate(items):
        if not item:
            raise InvalidRequest(f"{field}[{i}] is empty.", param=f"{field}[{i}]", code="empty_input")
    return items


def _truncating(request: web.Request, truncate: bool | None) -> bool:
    """A request's own ``truncate`` (TEI's field) wins; without it, the server's ``--truncate``."""
    return request.app[SETTINGS].truncate if truncate is None else truncate


SEND_TRUNCATE = 'send "truncate": true'


def _too_long(
    served: ServedModel, field: str, i: int, tokens: int, hint: str = SEND_TRUNCATE
) -> InvalidRequest:
    return InvalidRequest(
        f"{field}[{i}] has {tokens} tokens; model '{served.info.name}' takes at most "
        f"{served.info.max_tokens}. Shorten it, or {hint}.",
        param=f"{field}[{i}]",
        code="input_too_long",
    )


async def encode_texts(
    request: web.Request,
    served: ServedModel,
    texts: Sequence[str],
    *,
    truncate: bool | None,
    field: str,
    left: bool = False,
    positions: Sequence[int] | None = None,
    hint: str = SEND_TRUNCATE,
) -> list[list[int]]:
    """Complete id sequences for single texts, truncated (keeping the end when ``left``) or rejected.

    ``positions`` are the texts' indices in the request's ``field``, for the error naming one;
    ``hint`` tells the caller how to have it truncated instead."""
    served.batcher.ensure_room()  # refuse a flood before tokenising it
    raw = await served.worker.tokenize(texts)
    return fit_sequences(request, served, raw, truncate=truncate, field=field, left=left,
                         positions=positions, hint=hint)


def fit_sequences(
    request: web.Request,
    served: ServedModel,
    raw: Sequence[Sequence[int]],
    *,
    truncate: bool | None,
    field: str,
    left: bool = False,
    positions: Sequence[int] | None = None,
    hint: str = SEND_TRUNCATE,
) -> list[list[int]]:
    """Raw ids (tokenised texts or a client's token arrays) with special tokens added, each cut to
    the model's length (keeping the end when ``left``) or, without truncation, rejected by name."""
    room = served.info.max_tokens - served.specials
    cut = _truncating(request, truncate)
    seqs = []
    for i, ids in enumerate(raw):
        if len(ids) > room:
            if not cut:
                raise _too_long(
                    served, field, positions[i] if positions else i, len(ids) + served.specials, hint
                )
            if left:
                ids = ids[len(ids) - room :]
        seqs.append(served.runner.with_special_tokens(ids))
    return seqs


async def encode_pairs(
    request: web.Request,
    served: ServedModel,
    pairs: Sequence[tuple[str, str]],
    *,
    truncate: bool | None,
    field: str,
    positions: Sequence[int] | None = None,
) -> list[PairIds]:
    """Complete id sequences for text pairs (segment B marked), truncated longest-first or rejected.

    Each distinct string is tokenised once, so a rerank query shared by every pair costs one pass.
    """
    runner = served.runner
    if not isinstance(runner, PairRunner):
        raise InvalidRequest(
            f"Model '{served.info.name}' cannot score text pairs.", param="model", code="wrong_task"
        )
    distinct = list(dict.fromkeys(s for pair in pairs for s in pair))
    served.batcher.ensure_room()  # refuse a flood before tokenising it
    ids_of = dict(zip(distinct, await served.worker.tokenize(distinct), strict=True))
    specials = len(runner.pair_with_special_tokens([], []))
    cut = _truncating(request, truncate)
    seqs = []
    for i, (a, b) in enumerate(pairs):
        ids_a, ids_b = ids_of[a], ids_of[b]
        total = len(ids_a) + len(ids_b) + specials
        if total > served.info.max_tokens and not cut:
            raise _too_long(served, field, positions[i] if positions else i, total)
        seqs.append(runner.pair_with_special_tokens(ids_a, ids_b))
    return seqs


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """Scores from logits (last axis): softmax, sigmoid, or the logits themselves ("none")."""
    x = np.asarray(logits, dtype=np.float64)
    if activation == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
        return out
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    return x


def ranked(scores: np.ndarray, labels: Sequence[str]) -> list[Prediction]:
    """Every label with its score, best first (ties keep label order)."""
    order = sorted(range(len(labels)), key=lambda j: -float(scores[j]))
    return [Prediction(label=labels[j], score=float(scores[j])) for j in order]


def respond(body: object, results: Sequence[ItemResult], tokens: int) -> web.Response:
    """A JSON response with the timing headers every model route sends."""
    headers = timing_headers(results)
    headers["x-compute-tokens"] = str(tokens)
    return web.Response(body=encoder.encode(body), content_type="application/json", headers=headers)
