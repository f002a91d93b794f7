"""The engine-cost tool drives the real engine path: every request of every message is answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_engine_ops_answers_every_request_and_reports_both_paths() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1,3", "--rounds", "30", "--json"],
        capture_output=True, text=True, timeout=240, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    rows = {r["jobs"]: r for r in figures["rows"]}
    assert set(rows) == {1, 3}
    for r in rows.values():
        assert r["batches"] == 1.0  # distinct inputs of one message: one batch (nothing else waits)
        assert r["threaded_us"] > 0 and r["inline_us"] > 0
    assert figures["thread_round_trip_us"] > 0


def test_engine_ops_with_several_gateways_answers_them_all_in_shared_batches() -> None:
    """Three gateways' one-request messages read in one turn: every request answered (the tool fails
    otherwise), and one batch takes the three (the turn admits them together)."""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1", "--gateways", "3",
         "--rounds", "30", "--json"],
        capture_output=True, text=True, timeout=240, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    (row,) = figures["rows"]
    assert figures["gateways"] == 3
    assert row["batches"] == pytest.approx(1 / 3)  # one batch per round of three messages
