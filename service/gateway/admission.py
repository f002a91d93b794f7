"""How urgently, and for whom: tenant, priority and deadline, read from a request's headers.

Routes read these first, before decoding inputs or tokenising, so a malformed header costs nothing
else. The tenant comes from the API key when keys are configured (``auth``), else from ``X-Tenant``.
``X-Priority`` (high, normal, low) orders work within a tenant; tenants share the model by weight, so
marking everything high cannot jump another tenant's queue. ``X-Request-Timeout`` (ms) sets the
deadline, capped by the server's, counted from when the request's head arrived (``guard.arrived``):
the time a request spent waiting for the event loop or its body is part of its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from ..batching.admit import Hold
from ..batching.scheduler import DEFAULT_TENANT, PRIORITIES
from ..errors import InvalidRequest
from .auth import TENANT, TENANT_RE
from .guard import arrived
from .state import SETTINGS

# The check from the head (``shed``) passed this request and holds its room in the queue
# (``Admitter.precheck``; an empty hold where nothing is held): the route does not check again before
# tokenising; admission decides on the real counts and ends the hold.
HELD: web.RequestKey[Hold] = web.RequestKey("held")


@dataclass(slots=True)
class Admission:
    tenant: str
    weight: float
    priority: int
    timeout_s: float
    deadline: float  # on time.monotonic()
    arrived: float  # when the request's head arrived, on time.monotonic()
    # Its room's hold since its check: from its head (HELD), or the route's before tokenising (set by
    # ``ServedModel.check_room``, which then does not check again); None: not checked yet. The only field
    # that changes.
    held: Hold | None = None


def admission(request: web.Request) -> Admission:
    """Tenant, priority and deadline of this request; a malformed header is a 400 naming it."""
    settings = request.app[SETTINGS]
    if TENANT in request:
        tenant, weight = request[TENANT]
    else:
        tenant, weight = request.headers.get("X-Tenant", DEFAULT_TENANT), 1.0
        if not TENANT_RE.match(tenant):
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
    start = arrived(request)
    return Admission(tenant, weight, PRIORITIES[raw_priority], timeout, start + timeout, start,
                     request.get(HELD))
