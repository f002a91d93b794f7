"""The cold-start command's bookkeeping: server log lines become phase times since process start, and
the table shows medians and the plain/coalesce ratio (no servers started here)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from typing import Any

from coalesce.loadtests.coldstart import _events, report

WALL0 = datetime.fromisoformat("2026-01-01T00:00:00+00:00").timestamp()


def _line(event: str, at: str, **fields: Any) -> str:
    return json.dumps({"event": event, "timestamp": f"2026-01-01T00:00:{at}Z", "level": "info", **fields})


def test_events_are_timed_from_process_start_and_noise_is_skipped() -> None:
    stderr = "\n".join([
        "Loading weights: 100%|####| 103/103",
        _line("listening", "00.500000", port=8080),
        _line("request_failed", "01.000000"),
        _line("model_ready", "02.250000", load_s=1.3, warmup_s=0.3),
        "[1, 2, 3]",
        _line("ready", "02.260000", seconds=1.76),
    ])
    events = _events(stderr, WALL0)
    assert set(events) == {"listening", "model_ready", "ready"}
    assert events["listening"]["at_s"] == 0.5
    assert (events["model_ready"]["at_s"], events["model_ready"]["load_s"]) == (2.25, 1.3)


def _result(ours: float, plain: float) -> dict[str, Any]:
    def side(first: float) -> dict[str, Any]:
        return {"median": {"health_s": first / 4, "ready_s": first - 0.02, "first_embedding_s": first}}

    return {
        "runs": 3,
        "machine": {"cpus": 2, "loadavg_start": 1.5},
        "coalesce": {**side(ours), "phases": {"load": 1.3, "warmup": 0.3, "listening_at": None}},
        "plain": side(plain),
        "probes": {"fast": {"median": 1.6}, "st": {"median": 6.4}},
    }


def test_the_table_shows_both_servers_and_the_ratio() -> None:
    table = report(_result(ours=2.2, plain=6.6))
    assert "| `coalesce serve` | 0.55 | 2.18 | 2.20 |" in table
    assert "| plain sentence-transformers server | 1.65 | 6.58 | 6.60 |" in table
    assert "| plain / coalesce | 3.00× | 3.02× | 3.00× |" in table
    assert "load 1.30, warmup 0.30" in table and "listening_at" not in table
    assert "| ratio | 4.00× |" in table


def test_a_baseline_is_shown_beside_ours_with_its_ratio_and_the_flags_both_ran_with() -> None:
    result = _result(ours=2.2, plain=6.6)
    result["serve_args"] = ["--cpu-forwards", "1"]
    result["baseline"] = {"median": {"health_s": 0.5, "ready_s": 2.0, "first_embedding_s": 2.0},
                          "phases": {"load": 1.3, "warmup": 0.2, "listening_at": None}}
    lines = report(result).splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    assert rows[1:4] == ["| `coalesce serve` | 0.55 | 2.18 | 2.20 |",
                         "| `coalesce serve`, baseline | 0.50 | 2.00 | 2.00 |",
                         "| coalesce / baseline | 1.10× | 1.09× | 1.10× |"]
    assert "`coalesce serve` ran with `--cpu-forwards` `1`." in lines
    assert "the baseline phases from its log (median seconds): load 1.30, warmup 0.20" in lines
    assert "coalesce / baseline" not in report(_result(ours=2.2, plain=6.6))


def test_the_module_does_not_import_torch() -> None:
    # Other tests may have loaded torch into this process: check in a clean interpreter.
    code = "import sys, coalesce.loadtests.coldstart; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_ours_and_the_baseline_take_turns_to_start_first(monkeypatch: Any, tmp_path: Any) -> None:
    """``--baseline-site``: each run starts both (the baseline with its site first on ``PYTHONPATH``),
    ours first in the first run, the baseline first in the next, then the plain server."""
    from coalesce.loadtests import coldstart

    started: list[str] = []

    def measure(argv: Any, port: int, timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        if "--plain-server" in argv:
            started.append("plain")
        else:
            started.append("ours" if env is None else "base")
            assert env is None or env["PYTHONPATH"].split(":")[0] == str(tmp_path)
            assert argv[-2:] == ["--cpu-forwards", "1"]
        return {"health_s": 1.0, "ready_s": 2.0, "first_embedding_s": 2.5, "cpu_s": 1.0, "events": {}}

    monkeypatch.setattr(coldstart, "measure_server", measure)
    (tmp_path / "coalesce").mkdir()
    result = coldstart.run(2, 1, 1.0, probes=False, serve_args=["--cpu-forwards", "1"],
                           baseline_site=tmp_path)
    assert started == ["ours", "base", "plain", "base", "ours", "plain"]
    assert len(result["baseline"]["runs"]) == len(result["coalesce"]["runs"]) == 2
    assert result["serve_args"] == ["--cpu-forwards", "1"]
