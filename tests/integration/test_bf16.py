"""bfloat16 on the CPU: ``--dtype auto`` runs it where the CPU has it natively (the flag mocked here),
through the graph-safe forward and the eager sentence-transformers runner alike, shows it in ``/info``,
and stays within cosine 0.999 of sentence-transformers in float32; a model the guard rejects stays
float32."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.kernels import precision
from coalesce.service.settings import build

from ..conftest import ServerThread

TEXTS = ["how do plants make oxygen", "The striker scored twice.", "Book the flight early."]


def _rows(runner: Any, texts: list[str]) -> np.ndarray:
    prepared = runner.prepare([runner.with_special_tokens(ids) for ids in runner.tokenize(texts)])
    rows: np.ndarray = runner.finish(runner.forward(prepared), prepared)
    return rows


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    cos: np.ndarray = (got * want).sum(1) / norms
    return cos


@pytest.fixture
def cpu_with_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "native_bf16", lambda: "amx_bf16")


@pytest.mark.usefixtures("cpu_with_bf16")
def test_auto_runs_the_graph_forward_in_bfloat16_on_a_cpu_that_has_it(st_model: Any) -> None:
    from coalesce.kernels.encoder_runner import EncoderRunner
    from coalesce.kernels.loader import RunnerOptions, load_runner

    runner: Any = load_runner(None, None, RunnerOptions(device="cpu", dtype="auto"))
    assert isinstance(runner, EncoderRunner)
    assert runner.info.dtype == "bfloat16" and str(runner.model.word.weight.dtype) == "torch.bfloat16"
    got = _rows(runner, TEXTS)
    assert got.dtype == np.float32 and got.shape == (3, 384)
    assert _cosines(got, st_model.encode(TEXTS)).min() >= 0.999


@pytest.mark.usefixtures("cpu_with_bf16")
def test_the_eager_runner_runs_bfloat16_too(minilm_path: str, st_model: Any) -> None:
    from coalesce.kernels.st_runner import SentenceTransformerRunner

    runner = SentenceTransformerRunner(minilm_path, name=None, device="cpu", dtype="auto")
    assert runner.info.dtype == "bfloat16"
    assert _cosines(_rows(runner, TEXTS), st_model.encode(TEXTS)).min() >= 0.999
    forced = SentenceTransformerRunner(minilm_path, name=None, device="cpu", dtype="float32")
    assert forced.info.dtype == "float32"
    assert _cosines(_rows(forced, TEXTS), st_model.encode(TEXTS)).min() >= 0.99999


def test_a_cpu_without_bf16_runs_float32() -> None:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    runner = load_runner(None, None, RunnerOptions(device="cpu", dtype="auto"))
    assert runner.info.dtype == "float32"  # the session's mock: no native bfloat16


@pytest.mark.usefixtures("cpu_with_bf16")
def test_a_model_the_guard_rejects_stays_float32(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, st_model: Any
) -> None:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    monkeypatch.setattr(precision, "BF16_MIN_COSINE", 1.5)  # no bfloat16 model passes this
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        runner = load_runner(None, None, RunnerOptions(device="cpu", dtype="auto"))
    assert runner.info.dtype == "float32"
    assert "stays float32" in caplog.text
    assert _cosines(_rows(runner, TEXTS), st_model.encode(TEXTS)).min() >= 0.99999


@pytest.mark.usefixtures("cpu_with_bf16")
async def test_info_says_bfloat16_and_answers_stay_close_to_float32(serve: Any, st_model: Any) -> None:
    server: ServerThread = serve(build(["--dtype", "auto"], environ={}))
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/info") as r:
            assert (await r.json())["model_dtype"] == "bfloat16"
        body = {"model": "all-MiniLM-L6-v2", "input": TEXTS}
        async with s.post(server.url + "/v1/embeddings", json=body) as r:
            got = np.asarray([d["embedding"] for d in (await r.json())["data"]])
    assert _cosines(got, st_model.encode(TEXTS)).min() >= 0.999
