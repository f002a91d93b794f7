"""The Python client's wire logic, shared by its sync and async transports (``service/client.py``).

Request bodies (split to the server's per-request cap), response decoding (base64 embeddings to numpy),
the retry policy (429 and 503 after Retry-After, connection failures with backoff) and the server's
error, whichever shape it came in. No I/O happens here, so all of it is testable without a server.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import numpy as np

RETRY_STATUSES = frozenset({429, 503})
DEFAULT_BATCH = 2048  # OpenAI's per-request cap, when the server does not say its own
PARALLEL_PARTS = 4  # parts of one split call the async client has in flight at once


class APIError(Exception):
    """A request the server answered with an error (after any retries), or could not be reached."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        type: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.param = param
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class Prediction:
    label: str
    score: float


@dataclass(frozen=True, slots=True)
class Ranked:
    """One reranked document: its index in the input list and its relevance score."""

    index: int
    score: float


def _retry_after(headers: Any) -> float | None:
    """The server's hint in seconds: ``retry-after-ms`` (exact, what Coalesce plans with) first, then
    ``Retry-After``."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        raw = headers.get(name)
        try:
            if raw is not None:
                return max(0.0, float(raw) * scale)
        except ValueError:  # an HTTP date: fall back to our own backoff
            continue
    return None


def parse_error(status: int, body: bytes, headers: Any) -> APIError:
    """The server's error, whichever dialect it spoke (OpenAI's ``{error: {...}}``, TEI's ``{error,
    error_type}``, Cohere's ``{message}``); the code comes from the body or the ``x-error-code``
    header every Coalesce error carries."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    header_code = headers.get("x-error-code") if headers is not None else None
    detail = data.get("error") if isinstance(data, dict) else None
    if isinstance(detail, dict):
        return APIError(
            status,
            str(detail.get("message", "")),
            code=detail.get("code") or header_code,
            type=detail.get("type"),
            param=detail.get("param"),
            retry_after=_retry_after(headers),
        )
    if isinstance(data, dict) and ("message" in data or "error" in data):
        message = str(data.get("message") or data.get("error"))
        return APIError(status, message, code=header_code, type=data.get("error_type"),
                        retry_after=_retry_after(headers))
    text = body.decode("utf-8", "replace").strip() or http.client.responses.get(status, "error")
    return APIError(status, text, code=header_code, retry_after=_retry_after(headers))


OnRetry = Callable[[APIError, float], None]


class Wire:
    """Everything the sync and async clients share: URLs, headers, splitting, retry delays, decoding."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float,
        max_retries: int,
        max_retry_wait: float,
        batch_size: int | None,
        on_retry: OnRetry | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_retry_wait = max_retry_wait
        self.batch_size = batch_size
        self.on_retry = on_retry
        self.info: dict[str, Any] | None = None

    def delay(self, attempt: int, err: APIError) -> float:
        """Seconds to wait before retry ``attempt`` (0-based): at least Retry-After when the server sent
        one (capped at ``max_retry_wait``), else exponential backoff; jittered either way."""
        if err.retry_after is not None:
            base = min(err.retry_after, self.max_retry_wait)
            wait = base + random.uniform(0, 0.05 * max(base, 0.1))  # the server already spread its hints
        else:
            wait = min(self.max_retry_wait, 0.25 * 2**attempt) * random.uniform(0.5, 1.0)
        if self.on_retry is not None:
            self.on_retry(err, wait)
        return wait

    def refused(self, attempt: int, status: int, data: bytes, headers: Any) -> APIError:
        """The error to retry after; raises it instead when it is final or the retries are spent."""
        err = parse_error(status, data, headers)
        if status not in RETRY_STATUSES or attempt >= self.max_retries:
            raise err
        return err

    def unreachable(self, attempt: int, exc: Exception) -> APIError:
        """A connection failure as an error to retry after; raised when the retries are spent."""
        err = APIError(0, f"Could not reach {self.base_url}: {exc}")
        if attempt >= self.max_retries:
            raise err from exc
        return err

    def learn(self, info: dict[str, Any]) -> None:
        self.info = info
        if self.batch_size is None:
            self.batch_size = int(info.get("max_client_batch_size") or DEFAULT_BATCH)

    def default_model(self, task: str) -> str:
        for m in (self.info or {}).get("models", []):
            if m.get("task") == task:
                return str(m["id"])
        raise APIError(0, f"The server at {self.base_url} serves no {task} model.")

    def parts(self, n: int) -> list[tuple[int, int]]:
        """Index ranges of at most ``batch_size``; an empty list is sent as is (the server says why)."""
        size = max(1, self.batch_size or DEFAULT_BATCH)
        return [(i, min(n, i + size)) for i in range(0, n, size)] or [(0, 0)]

    def embed_requests(
        self, texts: str | Sequence[str], model: str | None, dimensions: int | None,
        long_input: str | None = None, chunk_overlap: int | None = None,
    ) -> list[dict[str, Any]]:
        items, name = texts_list(texts), model or self.default_model("embed")
        given = {"dimensions": dimensions, "long_input": long_input, "chunk_overlap": chunk_overlap}
        extra = {k: v for k, v in given.items() if v is not None}
        return [
            {"model": name, "input": items[a:b], "encoding_format": "base64", **extra}
            for a, b in self.parts(len(items))
        ]

    def classify_requests(
        self, texts: str | Sequence[str], model: str | None, labels: Sequence[str] | None, raw_scores: bool
    ) -> list[dict[str, Any]]:
        items = texts_list(texts)
        extra: dict[str, Any] = {} if model is None else {"model": model}
        if labels is not None:
            extra["labels"] = list(labels)
        return [{"input": items[a:b], "raw_scores": raw_scores, **extra} for a, b in self.parts(len(items))]

    def rerank_requests(
        self, query: str, documents: Sequence[str], model: str | None, instruction: str | None = None
    ) -> list[tuple[int, dict[str, Any]]]:
        extra: dict[str, Any] = {} if model is None else {"model": model}
        if instruction is not None:
            extra["instruction"] = instruction
        return [
            (a, {"query": query, "documents": list(documents[a:b]), **extra})
            for a, b in self.parts(len(documents))
        ]

    @staticmethod
    def info_path(model: str | None) -> str:
        return "/info" + (f"?model={quote(model)}" if model else "")

    @staticmethod
    def embeddings(body: dict[str, Any]) -> np.ndarray:
        rows = sorted(body["data"], key=lambda d: d["index"])
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in rows])

    @staticmethod
    def predictions(body: dict[str, Any]) -> list[list[Prediction]]:
        return [[Prediction(p["label"], float(p["score"])) for p in row] for row in body["data"]]

    @staticmethod
    def ranks(bodies: Sequence[tuple[int, dict[str, Any]]], top_n: int | None) -> list[Ranked]:
        merged = [
            Ranked(start + r["index"], float(r["relevance_score"]))
            for start, b in bodies
            for r in b["results"]
        ]
        merged.sort(key=lambda r: (-r.score, r.index))
        return merged[:top_n]


def texts_list(texts: str | Sequence[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)
