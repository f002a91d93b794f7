"""``loadtests/overload_ab.sh``: which code and environment each side runs, and the figures it reads off
each run's log (the bench's section tables), with a stand-in for the bench that prints canned sections
(a real run takes minutes a side)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The stand-in interpreter: `$PYTHON -m coalesce.loadtests.bench --only SECTION --file F --out D ...` prints
# the section's tables; its capacity probe is the knob it was given (COALESCE_QUEUE_INTERVAL_MS, default
# 500), so the test can tell which environment each side ran with.
FAKE = r"""#!/usr/bin/env bash
cap=${COALESCE_QUEUE_INTERVAL_MS:-500}
section=$4
[ "$3" = --only ] && [ "$5" = --file ] && [ -f "$6" ] && [ "$7" = --out ] \
    || { echo "bad args: $*" >&2; exit 3; }
if [ "$section" = overload ]; then
cat <<EOF
Coalesce with its defaults. Capacity (closed loop, 64 clients, mix \`short\`): **$cap.0 req/s**.
| coalesce | 2 of 1000 | 7.08 | 0 | - |
| load | offered/s | goodput/s | ÷ capacity | p50 | p99 | refused | late | answers | cpu | µs/refusal | lag |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 0.5× | 320.1 | 320.1 | 0.50× | 20.6 | 53.1 | 0.0% | - | - | 0.20 | - | 2.6 |
| 2× | 1,280.4 | 523.0 | 0.82× | 265.0 | 506.9 | 59.2% | 1492 (10%) | 429×15148 | 0.43 | 137.8 | 6.6 |
| 4× | 2,560.8 | 307.9 | 0.48× | 264.7 | 1,673.8 | 88.0% | 737 (2%) | 429×45059 | 0.58 | 169.9 | 3.4 |
EOF
else
cat <<EOF
Capacity = closed-loop throughput at 64 clients: **$cap.0 req/s**. Then 10 min of open-loop arrivals.
| p99 of admitted requests, worst phase | ≤ 500 ms | 1,635.4 ms | missed |
| phase | offered/s | achieved/s | p50 ms | p99 ms | q | f | fa | admitted | refused |
|---|---|---|---|---|---|---|---|---|---|
| soak 1 250/s | 250.0 | 250.0 | 21.8 | 52.6 | 31.9 | 25.0 | 13.2 | 10,089 / 10,089 | - |
| soak 2 1000/s | 1,000.0 | 400.0 | 251.3 | 503.6 | 421.5 | 108.4 | 86.2 | 18,474 / 40,356 | 429×21882 |
| soak 3 250/s | 250.0 | 250.0 | 20.3 | 74.4 | 57.1 | 51.3 | 12.9 | 10,076 / 10,089 | 429×13 |
| soak 4 1000/s | 1,000.0 | 300.0 | 248.1 | 1,635.4 | 374.1 | 177.5 | 90.7 | 16,886 / 40,356 | 429×23470 |
EOF
fi
"""


def _run(tmp_path: Path, section: str) -> list[list[str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("COALESCE_")}
    env.update(PYTHON=str(fake), OUT=str(tmp_path / "out"), SECTION=section,
               CURRENT_ENV="COALESCE_QUEUE_INTERVAL_MS=250", BASELINE_ENV="")
    out = subprocess.run(["bash", "loadtests/overload_ab.sh", "-", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("round code")
    return [line.split() for line in lines[1:]]


@pytest.mark.parametrize("section", ["overload", "soak"])
def test_each_side_runs_with_its_own_environment_and_its_figures_are_read_off(
    tmp_path: Path, section: str,
) -> None:
    rows = _run(tmp_path, section)
    # REV `-`: no wheel is built; current and baseline alternate, each with its own environment (the
    # stand-in's capacity is the interval it saw).
    assert [row[:3] for row in rows] == [["1", "current", "250.0"], ["1", "baseline", "500.0"],
                                         ["2", "current", "250.0"], ["2", "baseline", "500.0"]]
    for row in rows:
        if section == "overload":
            # 2× p99, goodput, µs per refusal; the same at 4× (a p99 past a thousand, its comma kept
            # out); then the burst's failed calls and wall seconds.
            assert row[3:] == ["506.9", "0.82×", "137.8", "1673.8", "0.48×", "169.9", "2", "7.08"]
        else:
            # The worst phase, each 2× phase's p99, their mean goodput ÷ the probe.
            cap = float(row[2])
            assert row[3:5] == ["1635.4", "503.6,1635.4"]
            assert float(row[5]) == pytest.approx(round(350.0 / cap, 2))
    # Each run's log and scratch copy of BENCHMARKS.md stay under OUT.
    assert sorted(p.name for p in (tmp_path / "out").glob("*.log")) == [
        "baseline1.log", "baseline2.log", "current1.log", "current2.log"]
