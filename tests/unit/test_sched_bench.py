"""The scheduler micro-benchmark: its workloads complete, and another version loads from a folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from coalesce.loadtests import sched_bench
from coalesce.service.batching import scheduler


def test_every_input_of_the_mixed_workload_is_served() -> None:
    work = next(w for w in sched_bench.WORKLOADS if w.name == "bulk+queries")
    spent, inputs = sched_bench.run(sched_bench.load_batching(None), work, seed=1)
    assert inputs == 2048 + 400
    assert spent > 0


def test_a_baseline_folder_loads_as_its_own_package(tmp_path: Path) -> None:
    here = Path(scheduler.__file__).parent
    for name in ("scheduler", "policy", "cost", "fair", "admit", "overload"):
        shutil.copy(here / f"{name}.py", tmp_path / f"{name}.py")
    baseline, policy, cost = sched_bench.load_batching(str(tmp_path))
    assert baseline is not scheduler and baseline.__file__ == str(tmp_path / "scheduler.py")
    assert policy.__file__ == str(tmp_path / "policy.py") and cost.__file__ == str(tmp_path / "cost.py")
    assert sched_bench.main(["--baseline", str(tmp_path), "--repeat", "1", "--only", "bulk+queries"]) == 0
