"""A Python client for Coalesce: embeddings, classification and reranking, sync (:class:`Client`) and
async (:class:`AsyncClient`).

What it does for the caller:

* **splits** an input list longer than the server's per-request cap (``/info``'s
  ``max_client_batch_size``, asked once) into several requests and reassembles the results in order
  (the async client sends the parts concurrently);
* **sends base64** for embeddings (packed float32, the server's fast path) and returns numpy arrays;
* **retries** 429 and 503 answers, waiting at least the server's ``Retry-After`` (plus a little jitter
  so a crowd of callers does not return in lockstep), and connection failures, up to ``max_retries``;
* **surfaces the server's message**: a failed call raises :class:`APIError` carrying the status, the
  server's ``message`` and ``code``.

It needs numpy (and aiohttp for the async client); it imports neither torch nor the server.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .client_wire import PARALLEL_PARTS, APIError, OnRetry, Prediction, Ranked, Wire

__all__ = ["APIError", "AsyncClient", "Client", "Prediction", "Ranked"]


class Client:
    """Blocking client. Thread-safe: each call borrows a keep-alive connection from a small pool.

    ``max_retries``: retries of a 429, a 503 or a connection failure, each after at least the server's
    Retry-After (capped at ``max_retry_wait``). ``batch_size``: inputs per request (default: the
    server's cap). ``on_retry(error, wait_s)`` is called before each wait, for logs or metrics.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 5,
        max_retry_wait: float = 30.0,
        batch_size: int | None = None,
        on_retry: OnRetry | None = None,
    ) -> None:
        self._core = Wire(base_url, api_key, timeout, max_retries, max_retry_wait, batch_size, on_retry)
        parts = urlsplit(self._core.base_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._prefix = parts.path
        self._pool: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    # -- transport -----------------------------------------------------------------------------------
    def _connect(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """A pooled keep-alive connection (and True), or a new one."""
        with self._lock:
            if self._pool and not fresh:
                return self._pool.pop(), True
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=self._core.timeout), False

    def _once(
        self, method: str, path: str, payload: bytes | None, fresh: bool = False
    ) -> tuple[int, bytes, Any]:
        conn, reused = self._connect(fresh)
        try:
            conn.request(method, self._prefix + path, body=payload, headers=self._core.headers)
            resp = conn.getresponse()
            body = resp.read()
        except (ConnectionError, http.client.HTTPException):
            conn.close()
            if reused:  # the server closed an idle keep-alive connection: not a failure of this call
                return self._once(method, path, payload, fresh=True)
            raise
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._pool.append(conn)
        return resp.status, body, resp.headers

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        payload = json.dumps(body).encode() if body is not None else None
        core = self._core
        for attempt in range(core.max_retries + 1):
            try:
                status, data, headers = self._once(method, path, payload)
            except (ConnectionError, http.client.HTTPException, TimeoutError) as exc:
                err = core.unreachable(attempt, exc)
            else:
                if status < 400:
                    return json.loads(data)
                err = core.refused(attempt, status, data, headers)
            time.sleep(core.delay(attempt, err))
        raise AssertionError("unreachable")

    def _ensure_info(self) -> None:
        if self._core.info is None:
            self._core.learn(self._call("GET", "/info"))

    # -- API -----------------------------------------------------------------------------------------
    def info(self, model: str | None = None) -> dict[str, Any]:
        """The server's ``/info`` for ``model`` (default: its first model); ``models`` lists every one."""
        out: dict[str, Any] = self._call("GET", self._core.info_path(model))
        return out

    def models(self) -> dict[str, str]:
        """Served model name → task (embed, classify, rerank)."""
        self._ensure_info()
        return {m["id"]: m["task"] for m in (self._core.info or {}).get("models", [])}

    def embed(
        self, texts: str | Sequence[str], *, model: str | None = None, dimensions: int | None = None,
        long_input: str | None = None, chunk_overlap: int | None = None,
    ) -> np.ndarray:
        """A float32 array with one row per text, in order. ``long_input`` (truncate, chunk or error)
        and ``chunk_overlap`` choose what the server does with a text longer than the model (default:
        its ``--long-input``)."""
        self._ensure_info()
        bodies = self._core.embed_requests(texts, model, dimensions, long_input, chunk_overlap)
        return np.concatenate(
            [self._core.embeddings(self._call("POST", "/v1/embeddings", b)) for b in bodies]
        )

    def classify(
        self,
        texts: str | Sequence[str],
        *,
        model: str | None = None,
        labels: Sequence[str] | None = None,
        raw_scores: bool = False,
    ) -> list[list[Prediction]]:
        """Every label with its score, best first, per text. ``labels`` = zero-shot with an embedder."""
        self._ensure_info()
        bodies = self._core.classify_requests(texts, model, labels, raw_scores)
        return [row for b in bodies for row in self._core.predictions(self._call("POST", "/classify", b))]

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        model: str | None = None,
        top_n: int | None = None,
        instruction: str | None = None,
    ) -> list[Ranked]:
        """Documents by relevance to ``query``, best first (the ``top_n`` best when given).
        ``instruction``: the task an LLM reranker (Qwen3-Reranker style) judges for (default: the
        server's)."""
        self._ensure_info()
        bodies = self._core.rerank_requests(query, documents, model, instruction)
        return self._core.ranks([(a, self._call("POST", "/rerank", b)) for a, b in bodies], top_n)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client on aiohttp, with :class:`Client`'s options; the parts of a split call go out
    concurrently (``PARALLEL_PARTS`` at a time). Use one per event loop; ``await close()`` at the end."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        max_retries: int = 5,
        max_retry_wait: float = 30.0,
        batch_size: int | None = None,
        on_retry: OnRetry | None = None,
    ) -> None:
        self._core = Wire(base_url, api_key, timeout, max_retries, max_retry_wait, batch_size, on_retry)
        self._session: Any = None
        self._info_lock = asyncio.Lock()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import aiohttp

        core = self._core
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=core.headers, timeout=aiohttp.ClientTimeout(total=core.timeout)
            )
        payload = json.dumps(body).encode() if body is not None else None
        for attempt in range(core.max_retries + 1):
            try:
                async with self._session.request(method, core.base_url + path, data=payload) as resp:
                    data = await resp.read()
                    status, headers = resp.status, resp.headers
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                err = core.unreachable(attempt, exc)
            else:
                if status < 400:
                    return json.loads(data)
                err = core.refused(attempt, status, data, headers)
            await asyncio.sleep(core.delay(attempt, err))
        raise AssertionError("unreachable")

    async def _post_all(self, path: str, bodies: Sequence[dict[str, Any]]) -> list[Any]:
        """The parts of one split call, ``PARALLEL_PARTS`` in flight at a time, answers in order."""
        limit = asyncio.Semaphore(PARALLEL_PARTS)

        async def one(body: dict[str, Any]) -> Any:
            async with limit:
                return await self._call("POST", path, body)

        return list(await asyncio.gather(*(one(b) for b in bodies)))

    async def _ensure_info(self) -> None:
        async with self._info_lock:  # concurrent first calls ask once
            if self._core.info is None:
                self._core.learn(await self._call("GET", "/info"))

    async def info(self, model: str | None = None) -> dict[str, Any]:
        """The server's ``/info`` for ``model`` (default: its first model); ``models`` lists every one."""
        out: dict[str, Any] = await self._call("GET", self._core.info_path(model))
        return out

    async def models(self) -> dict[str, str]:
        """Served model name → task (embed, classify, rerank)."""
        await self._ensure_info()
        return {m["id"]: m["task"] for m in (self._core.info or {}).get("models", [])}

    async def embed(
        self, texts: str | Sequence[str], *, model: str | None = None, dimensions: int | None = None,
        long_input: str | None = None, chunk_overlap: int | None = None,
    ) -> np.ndarray:
        """A float32 array with one row per text, in order (``long_input``: see :meth:`Client.embed`)."""
        await self._ensure_info()
        bodies = self._core.embed_requests(texts, model, dimensions, long_input, chunk_overlap)
        answers = await self._post_all("/v1/embeddings", bodies)
        return np.concatenate([self._core.embeddings(a) for a in answers])

    async def classify(
        self,
        texts: str | Sequence[str],
        *,
        model: str | None = None,
        labels: Sequence[str] | None = None,
        raw_scores: bool = False,
    ) -> list[list[Prediction]]:
        """Every label with its score, best first, per text. ``labels`` = zero-shot with an embedder."""
        await self._ensure_info()
        bodies = self._core.classify_requests(texts, model, labels, raw_scores)
        answers = await self._post_all("/classify", bodies)
        return [row for a in answers for row in self._core.predictions(a)]

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        model: str | None = None,
        top_n: int | None = None,
        instruction: str | None = None,
    ) -> list[Ranked]:
        """Documents by relevance to ``query``, best first (the ``top_n`` best when given).
        ``instruction``: the task an LLM reranker (Qwen3-Reranker style) judges for (default: the
        server's)."""
        await self._ensure_info()
        bodies = self._core.rerank_requests(query, documents, model, instruction)
        answers = await self._post_all("/rerank", [b for _, b in bodies])
        return self._core.ranks([(a, ans) for (a, _), ans in zip(bodies, answers, strict=True)], top_n)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
