"""A short run of ``make fuzz``: schemathesis against a real ``coalesce serve`` on loopback, every route
of the published document, a fixed seed and a small example budget, bounded in time. It fails on any
5xx (but the documented deadline answers, see ``fuzz_hooks``), any status, header, content type or body
the document does not declare for the route (so a 4xx in another dialect's shape), and any request the
document forbids that the server accepts."""

from __future__ import annotations

from .fuzz import fuzz

MAX_EXAMPLES = 10
TIMEOUT_S = 300.0


def test_a_short_fuzz_run_finds_nothing() -> None:
    run = fuzz(MAX_EXAMPLES, extra=["--phases", "coverage,fuzzing"], timeout_s=TIMEOUT_S)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert "Tested: 24" in run.stdout  # every operation but the document itself (schemathesis skips it)
