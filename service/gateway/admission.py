"""Who is asking and how urgently: API keys, tenants, priorities and deadlines, read from the request.

With ``--api-keys-file``, every model route needs ``Authorization: Bearer KEY`` and the key decides the
tenant (and its weight); without it, ``X-Tenant`` names the tenant. ``X-Priority`` (high, normal, low)
orders a tenant's own requests; tenants share the model by weight, so marking everything high cannot
jump another tenant's queue. ``X-Request-Timeout`` (ms) sets the deadline, capped by the server's.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ..batching.batcher import ItemResult
from ..batching.scheduler import DEFAULT_TENANT, PRIORITIES
from ..errors import DeadlineExceeded, InvalidRequest, Unauthorized
from .models import ServedModel
from .state import METRICS, SETTINGS, Handler

_TENANT_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


@dataclass(frozen=True, slots=True)
class _Key:
    digest: bytes
    tenant: str
    weight: float


class KeyRing:
    """API keys held as SHA-256 digests; lookups compare every digest in constant time."""

    def __init__(self, keys: Sequence[tuple[str, str, float]]) -> None:
        self._keys = [_Key(_digest(k), tenant, weight) for k, tenant, weight in keys]

    @classmethod
    def load(cls, path: str) -> KeyRing:
        """``KEY TENANT [WEIGHT]`` per line; blank lines and ``#`` comments are skipped."""
        keys = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) not in (2, 3) or not _TENANT_RE.match(fields[1]):
                raise SystemExit(
                    f"{path}:{n}: expected 'KEY TENANT [WEIGHT]' with a tenant of [A-Za-z0-9_.:-]"
                )
            try:
                weight = float(fields[2]) if len(fields) == 3 else 1.0
            except ValueError:
                raise SystemExit(f"{path}:{n}: WEIGHT must be a number") from None
            if weight <= 0:
                raise SystemExit(f"{path}:{n}: WEIGHT must be positive")
            keys.append((fields[0], fields[1], weight))
        if not keys:
            raise SystemExit(f"{path}: no API keys")
        return cls(keys)

    def find(self, presented: str) -> _Key | None:
        digest = _digest(presented)
        found = None
        for key in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found


KEYS: web.AppKey[KeyRing | None] = web.AppKey("keys")
TENANT: web.RequestKey[tuple[str, float]] = web.RequestKey("tenant")  # (tenant, weight) of the API key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With keys configured, model routes need a valid bearer key; the key's tenant is recorded."""
    keys = request.app[KEYS]
    if keys is None or request.path in OPEN_PATHS:
        return await handler(request)
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    key = keys.find(presented.strip()) if scheme.lower() == "bearer" and presented.strip() else None
    if key is None:
        request.app[METRICS].rejected.labels("", "unauthorized").inc()
        raise Unauthorized("Missing or invalid API key: send 'Authorization: Bearer <key>'.")
    request[TENANT] = (key.tenant, key.weight)
    return await handler(request)


@dataclass(frozen=True, slots=True)
class Admission:
    tenant: str
    weight: float
    priority: int
    timeout_s: float
    deadline: float  # on time.monotonic()


def admission(request: web.Request) -> Admission:
    """Tenant, priority and deadline of this request; a malformed header is a 400 naming it."""
    settings = request.app[SETTINGS]
    if TENANT in request:
        tenant, weight = request[TENANT]
    else:
        tenant, weight = request.headers.get("X-Tenant", DEFAULT_TENANT), 1.0
        if not _TENANT_RE.match(tenant):
            raise InvalidRequest(
                "X-Tenant must be 1-64 characters of [A-Za-z0-9_.:-].",
                param="X-Tenant",
                code="invalid_header",
            )
    raw_priority = request.headers.get("X-Priority", "normal").strip().lower()
    if raw_priority not in PRIORITIES:
        raise InvalidRequest(
            "X-Priority must be high, normal or low.", param="X-Priority", code="invalid_header"
        )
    cap = settings.request_timeout_ms / 1e3
    timeout = cap
    raw_timeout = request.headers.get("X-Request-Timeout")
    if raw_timeout is not None:
        try:
            timeout = float(raw_timeout) / 1e3
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise InvalidRequest(
                "X-Request-Timeout must be a positive number of milliseconds.",
                param="X-Request-Timeout",
                code="invalid_header",
            )
        timeout = min(timeout, cap)
    return Admission(tenant, weight, PRIORITIES[raw_priority], timeout, time.monotonic() + timeout)


async def submit_and_wait(
    request: web.Request, served: ServedModel, seqs: Sequence[Sequence[int]]
) -> list[ItemResult]:
    """Submit one request's inputs under its admission and await them all, by its deadline.

    On failure, timeout or disconnect the request's other inputs are cancelled, so none is computed.
    """
    adm = admission(request)
    futures = served.batcher.submit(
        seqs, tenant=adm.tenant, weight=adm.weight, priority=adm.priority, deadline=adm.deadline
    )
    # The deadline is one timer that cancels what is still awaited (cheaper on this path than
    # asyncio.timeout); `expired` tells its cancellation from the task's own.
    waiter: asyncio.Future[Any] = futures[0] if len(futures) == 1 else asyncio.gather(*futures)
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        waiter.cancel()

    timer = asyncio.get_running_loop().call_later(max(0.0, adm.deadline - time.monotonic()), expire)
    try:
        done = await waiter
        return [done] if len(futures) == 1 else list(done)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not expired or (task is not None and task.cancelling()):
            raise  # the request itself was cancelled (its client left, or shutdown)
        request.app[METRICS].rejected.labels(served.info.name, "expired").inc()
        raise DeadlineExceeded(
            f"No result within the request's deadline of {adm.timeout_s * 1e3:.0f} ms; "
            "what had not run was dropped."
        ) from None
    finally:
        timer.cancel()
        for fut in futures:
            fut.cancel()  # no-op for those already done


def timing_headers(results: Sequence[ItemResult]) -> dict[str, str]:
    """TEI-style timing headers (ms): the longest queue wait and forward among the request's inputs."""
    queue = max(r.queue_s for r in results)
    infer = max(r.forward_s for r in results)
    return {"x-queue-time": f"{queue * 1e3:.3f}", "x-inference-time": f"{infer * 1e3:.3f}"}
