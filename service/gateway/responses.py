"""What every model route answers with: JSON bodies, the timing headers, and scores from logits."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import orjson
from aiohttp import web

from ..batching.batcher import RequestResult
from ..schemas import Prediction, encoder

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def float_json(values: np.ndarray) -> msgspec.Raw:
    """A float array (any shape) as JSON numbers in float32's shortest form, for a response body.

    Vectors are float32; encoded as Python floats (msgspec) each number would be the float64 widening
    of its float32 value, 17 digits where 9 suffice. orjson writes float32's shortest form, which parses
    back to exactly the same float32, in fewer bytes and less CPU. NaN and infinity, which JSON lacks,
    become null, as msgspec writes them."""
    return msgspec.Raw(orjson.dumps(np.ascontiguousarray(values, dtype=np.float32), option=_NUMPY))


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=encoder.encode(body), status=status, content_type="application/json", headers=headers
    )


def timing_headers(result: RequestResult, tokens: int) -> dict[str, str]:
    """TEI-style headers (ms): the longest queue wait and forward among the request's inputs, and the
    tokens computed."""
    return {
        "x-queue-time": f"{result.queue_s * 1e3:.3f}",
        "x-inference-time": f"{result.forward_s * 1e3:.3f}",
        "x-compute-tokens": str(tokens),
    }


def respond(body: object, result: RequestResult, tokens: int) -> web.Response:
    """A JSON response with the timing headers every model route sends."""
    return json_response(body, headers=timing_headers(result, tokens))


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
