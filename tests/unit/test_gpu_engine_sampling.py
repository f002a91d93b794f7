"""Sampling the engine on the GPU machine: the bundle carries py-spy's binary out of its wheel, the
scripts that run it parse, and ``coalesce.loadtests.pyspy_summary`` reads its folded stacks here — a
recursive frame counts once per sample, a sample's own function is its last frame, and shares are of
every sample."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from coalesce.loadtests.gpu.bundle import extract_script
from coalesce.loadtests.pyspy_summary import render, summarise

ROOT = Path(__file__).resolve().parents[2]

FOLDED = [
    "run (asyncio/runners.py:118);_step (/x/site-packages/coalesce/service/batching/batcher.py:580);"
    "next (/x/site-packages/coalesce/service/batching/scheduler.py:255) 6\n",
    "run (asyncio/runners.py:118);send (/x/site-packages/coalesce/service/engine/channel.py:160) 3\n",
    "walk (a.py:1);walk (a.py:2);walk (a.py:3) 1\n",
    "a line py-spy never writes\n",
]


def test_counts_inclusive_once_per_sample_and_own_at_the_top() -> None:
    total, inclusive, own = summarise(FOLDED)
    assert total == 10
    assert inclusive["run (asyncio/runners.py)"] == 9
    assert inclusive["walk (a.py)"] == 1  # three frames of one sample: one sample
    assert own["next (coalesce/service/batching/scheduler.py)"] == 6
    assert own["send (coalesce/service/engine/channel.py)"] == 3
    assert "_step (coalesce/service/batching/batcher.py)" not in own


def test_render_gives_shares_of_every_sample_most_first() -> None:
    text = render(*summarise(FOLDED), top=2)
    lines = text.splitlines()
    assert lines[0] == "10 samples"
    assert lines[1:4] == ["inclusive:", "   90.0%  run (asyncio/runners.py)",
                          "   60.0%  _step (coalesce/service/batching/batcher.py)"]
    assert lines[4:] == ["own:", "   60.0%  next (coalesce/service/batching/scheduler.py)",
                         "   30.0%  send (coalesce/service/engine/channel.py)"]


def test_the_gpu_machine_scripts_parse(tmp_path: Path) -> None:
    for script in ("gpu_session.sh", "gpu_ab.sh", "gpu_engine_profile.sh", "gpu_lib.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / "kernels" / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"
    raw = tmp_path / "engine.raw"
    raw.write_text("".join(FOLDED))
    out = subprocess.run([sys.executable, "-m", "coalesce.loadtests.pyspy_summary", str(raw), "--top", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[:3] == ["10 samples", "inclusive:", "   90.0%  run (asyncio/runners.py)"]
    # Gzipped as the quoted samples are kept (loadtests/gpu/profiles): the same summary.
    packed = tmp_path / "engine.raw.gz"
    packed.write_bytes(gzip.compress(raw.read_bytes()))
    cmd = [sys.executable, "-m", "coalesce.loadtests.pyspy_summary", str(packed), "--top", "1"]
    again = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert again == out


def test_the_bundle_takes_a_wheels_script_as_an_executable(tmp_path: Path) -> None:
    wheel = tmp_path / "tool-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tool-1.0.dist-info/METADATA", "Name: tool\n")
        zf.writestr("tool-1.0.data/scripts/py-spy", b"\x7fELF binary")
    dest = extract_script(wheel, "py-spy", tmp_path / "py-spy")
    assert dest.read_bytes() == b"\x7fELF binary"
    assert os.access(dest, os.X_OK)
    with pytest.raises(FileNotFoundError, match="no script other"):
        extract_script(wheel, "other", tmp_path / "other")
