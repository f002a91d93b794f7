"""Every test here starts a real server, a process tree or a model (seconds each, minutes together):
all are marked ``slow``, so ``pytest -m "not slow"`` runs the unit tests alone, in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
