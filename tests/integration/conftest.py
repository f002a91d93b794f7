"""Every test here starts a real server, a process tree or a model (seconds each, minutes together):
all are marked ``slow``, so ``pytest -m "not slow"`` runs the unit tests alone, in seconds."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from .tiny_models import classifier_dir, reranker_dir

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each model exported once per session (the ONNX and OpenVINO tests share them): MiniLM in fp32 and
    int8, the classifier, the reranker."""
    from coalesce.kernels.export import export_model

    root = tmp_path_factory.mktemp("onnx")
    jobs = {  # the two long ones first, so the two short ones fill in behind them
        "minilm-int8": ("default", "int8"),
        "minilm": ("default", "none"),
        "classifier": (classifier_dir(), "none"),
        "reranker": (reranker_dir(), "none"),
    }
    # Two processes at once (the suite's longest setup): tracing is partly one thread of Python, so on
    # two cores this took about a fifth off the fixture (one torch thread each took nothing off).
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = [pool.submit(export_model, model, root / name, quantize=quantize)
                for name, (model, quantize) in jobs.items()]
        for job in done:
            job.result()
    return {name: root / name for name in jobs}
