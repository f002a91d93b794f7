"""Who is asking: API keys and the tenant each one names.

With ``--api-keys-file``, every model route needs ``Authorization: Bearer KEY`` and the key decides the
tenant (and its weight); without it, ``X-Tenant`` names the tenant (see ``admission``). The probes, the
metrics and the API's own documentation (``/openapi.json``, ``/docs`` and its assets) stay open.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from ..errors import Unauthorized
from .state import METRICS

TENANT_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs"})
_OPEN_PREFIX = "/docs/"


def is_open(path: str) -> bool:
    """Whether ``path`` is served without an API key."""
    return path in OPEN_PATHS or path.startswith(_OPEN_PREFIX)


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
            if len(fields) not in (2, 3) or not TENANT_RE.match(fields[1]):
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


def bearer_key(request: web.Request, keys: KeyRing) -> _Key | None:
    """The configured key the request presents as ``Authorization: Bearer <key>``, if any."""
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    presented = presented.strip()
    return keys.find(presented) if scheme.lower() == "bearer" and presented else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_key(request: web.Request, app: web.Application) -> None:
    """With keys configured, model routes need a valid bearer key (else :class:`Unauthorized`); the
    key's tenant is recorded. A step of the app's one middleware (``app.front``)."""
    keys = app[KEYS]
    if keys is None or is_open(request.path) or TENANT in request:  # (``shed`` may have looked already)
        return
    key = bearer_key(request, keys)
    if key is None:
        app[METRICS].rejected.labels("", "unauthorized").inc()
        raise Unauthorized("Missing or invalid API key: send 'Authorization: Bearer <key>'.")
    request[TENANT] = (key.tenant, key.weight)
