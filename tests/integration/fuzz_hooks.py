"""Schemathesis hooks for ``make fuzz`` (loaded by path through ``SCHEMATHESIS_HOOKS``).

A random ``model`` name is a 404 before any handler logic runs, so left alone the fuzzer would spend
most of its budget there. ``map_body`` names a served model in three bodies of four: mostly the one
whose task the route serves (``COALESCE_FUZZ_MODELS``: a JSON object, path → model name), sometimes
any served one (the wrong-task refusals get fuzzed too); chosen from the body itself, so a seed
replays the same run. It only replaces a string or an absent ``model``: a body generated to break its
schema elsewhere stays broken, and one whose ``model`` is the broken part is left as it is.

``filter_failure`` accepts one kind of 5xx: the documented 503 ``deadline_unmeetable`` and 504
``deadline_exceeded`` answers to an ``X-Request-Timeout`` the fuzzer set shorter than the work (it
sends deadlines down to 1e-100 ms). Every such answer is counted and the tally printed at exit, so a
run's figures show them apart from server errors, which still fail the run.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
from collections import Counter
from typing import Any

import schemathesis

_BY_PATH: dict[str, str] = json.loads(os.environ.get("COALESCE_FUZZ_MODELS", "{}"))
_SERVED = sorted(set(_BY_PATH.values()))
_DEADLINES = {(503, "deadline_unmeetable"), (504, "deadline_exceeded")}
_accepted: Counter[str] = Counter()


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if not _SERVED or not isinstance(body, dict) or not isinstance(body.get("model", ""), str):
        return body
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).digest()
    own = _BY_PATH.get(context.operation.path) if context.operation is not None else None
    if digest[0] % 4 == 0:
        return body
    if digest[0] % 4 == 1 or own is None:
        return {**body, "model": _SERVED[digest[1] % len(_SERVED)]}
    return {**body, "model": own}


@schemathesis.hook
def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    code = response.headers.get("x-error-code", [""])
    code = code[0] if isinstance(code, list) else code
    if getattr(failure, "code", "") == "ST101" and (response.status_code, code) in _DEADLINES:
        _accepted[f"{response.status_code} {code}"] += 1
        return False
    return True


@atexit.register
def _tally() -> None:
    shown = ", ".join(f"{n} x {kind}" for kind, n in sorted(_accepted.items())) or "none"
    print(f"fuzz_hooks: documented deadline answers to the fuzzer's own X-Request-Timeout: {shown}",
          file=sys.stderr)
    tally = os.environ.get("COALESCE_FUZZ_TALLY")
    if tally:  # for ``make fuzz ARGS="--bench-file BENCHMARKS.md"``'s table
        with open(tally, "w", encoding="utf-8") as f:
            json.dump(dict(_accepted), f)
