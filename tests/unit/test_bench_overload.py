"""The overload section's model figures: how busy the model was in a step, and how fast its forwards ran
per padded token against the capacity probe's (what tells a goodput below capacity from admission)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coalesce.loadtests.bench_overload import _forward_figures


def _step(batches: int, forward_ms: float | None, tokens_per_s: float | None, seconds: float = 10.0) -> Any:
    batch = SimpleNamespace(batches=batches, mean_forward_ms=forward_ms, forward_tokens_per_s=tokens_per_s)
    return SimpleNamespace(batch=batch, duration_s=seconds)


def test_a_step_s_model_busy_share_and_its_forward_speed_against_the_probe_s() -> None:
    probe = _step(200, 45.0, 12_000.0)
    # 80 batches of 120 ms in 10 s: the model busy 0.96 of the step, at 4,200 tokens/s (0.35 of the probe's)
    assert _forward_figures(_step(80, 120.0, 4_200.0), probe) == ["0.96", "0.35×"]
    assert _forward_figures(_step(80, 120.0, 4_200.0), _step(0, None, None)) == ["0.96", "-"]
    assert _forward_figures(SimpleNamespace(batch=None, duration_s=10.0), probe) == ["-", "-"]
