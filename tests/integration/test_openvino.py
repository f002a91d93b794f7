"""The OpenVINO backend and the static int8 export, end to end on the packaged MiniLM (exported once per
session by the ``exports`` fixture): OpenVINO against sentence-transformers (fp32 torch) in float32 and
in the precision ``--dtype auto`` picks; the compiled-model cache a restart reads; the warm-up guard
that falls back to float32; classifiers; and an int8 export whose rows do not depend on their batch,
served by ONNX Runtime and by OpenVINO. (A server with ``--backend openvino`` that never imports torch:
``test_onnx.test_serving_an_export_never_imports_torch_or_transformers``.)"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.kernels import openvino_runner, precision
from coalesce.kernels.loader import RunnerOptions, load_runner
from coalesce.kernels.onnx_runner import load_onnx_runner
from coalesce.kernels.openvino_runner import (
    OpenVinoPairRunner,
    OpenVinoRunner,
    load_openvino_runner,
)
from coalesce.kernels.protocol import PairIds
from coalesce.service.allocator import find_jemalloc
from coalesce.service.settings import build

from ..conftest import free_port, wait_ready
from .test_onnx import COALESCE, ENV, LONG, MIXED

COSINE_F32 = 0.9999  # OpenVINO float32 against torch float32 (measured 0.99999+)
INVARIANT = 1e-5  # a row alone and in a batch: float rounding only
INT8_FLOOR = 0.95  # an int8 row against float32: a sanity floor (the bench measures retrieval quality)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    cos: np.ndarray = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return cos


def _embed(runner: Any, texts: list[str]) -> np.ndarray:
    prepared = runner.prepare([runner.with_special_tokens(ids) for ids in runner.tokenize(texts)])
    rows: np.ndarray = runner.finish(runner.forward(prepared), prepared)
    return rows


class _Core:
    """An ``openvino.Core`` whose CPU reports the optimisation capabilities a test chose."""

    def __init__(self, capabilities: list[str]) -> None:
        self._core = openvino_runner.new_core()
        self._capabilities = capabilities

    def get_property(self, device: str, name: str) -> Any:
        if name == "OPTIMIZATION_CAPABILITIES":
            return self._capabilities
        return self._core.get_property(device, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


# -- parity with torch ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_openvino_matches_sentence_transformers(
    exports: dict[str, Path], st_model: Any, dtype: str, tmp_path: Path
) -> None:
    runner = load_openvino_runner(str(exports["minilm"]), name=None, dtype=dtype, cache_dir=str(tmp_path))
    runner.warmup()
    assert isinstance(runner, OpenVinoRunner) and runner.info.dim == 384
    ours, reference = _embed(runner, MIXED), st_model.encode(MIXED)
    floor = COSINE_F32 if runner.info.dtype == "float32" else precision.BF16_MIN_COSINE
    assert _cosines(ours, reference).min() >= floor
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-3)
    alone = np.concatenate([_embed(runner, [t]) for t in MIXED])
    assert _cosines(alone, ours).min() >= floor  # padding leaks into no row


def test_the_compiled_model_is_cached_and_a_restart_reads_it(
    exports: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "ov-cache"
    first = load_openvino_runner(str(exports["minilm"]), name=None, dtype="float32", cache_dir=str(cache))
    blobs = sorted(p.name for p in cache.iterdir())
    assert blobs and not first.loaded_from_cache
    second = load_openvino_runner(str(exports["minilm"]), name=None, dtype="float32", cache_dir=str(cache))
    assert second.loaded_from_cache
    assert sorted(p.name for p in cache.iterdir()) == blobs  # read, not compiled and written again
    np.testing.assert_allclose(_embed(second, MIXED), _embed(first, MIXED), atol=1e-6)


def test_the_default_cache_lives_in_the_export(exports: dict[str, Path], tmp_path: Path) -> None:
    export = tmp_path / "copy"
    export.mkdir()
    for item in exports["minilm"].iterdir():  # a copy of the export's files, so its cache stays here
        (export / item.name).symlink_to(item)
    runner = load_openvino_runner(str(export), name=None, dtype="float32")
    assert runner.cache_dir == export / "openvino_cache" and any(runner.cache_dir.iterdir())


def test_the_cpu_plugin_keeps_the_shapes_the_kernel_cache_knob_allows(
    exports: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cpu-kernel-cache (default 64) reaches the CPU plugin, whose own default (5,000 input shapes kept
    prepared) let a server under varying batch shapes grow by most of a GiB (BENCHMARKS.md, memory). The
    compiled model does not report the property back, so the configs compiled with are recorded."""
    compiled: list[dict[str, str]] = []

    class Recording:
        def __init__(self) -> None:
            self._core = new_core()

        def compile_model(self, model: str, device: str, config: dict[str, str]) -> Any:
            compiled.append(config)
            return self._core.compile_model(model, device, config)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._core, name)

    new_core = openvino_runner.new_core
    monkeypatch.setattr(openvino_runner, "new_core", Recording)
    kept, rows = [], []
    served = build([]).cpu_kernel_cache  # what `coalesce serve` passes by default
    for options in (RunnerOptions(device="cpu", backend="openvino", dtype="float32", cpu_kernel_cache=served),
                    RunnerOptions(device="cpu", backend="openvino", dtype="float32", cpu_kernel_cache=8),
                    RunnerOptions(device="cpu", backend="openvino", dtype="float32", cpu_kernel_cache=0)):
        runner = load_runner(str(exports["minilm"]), None, options)
        kept.append(compiled[-1].get("CPU_RUNTIME_CACHE_CAPACITY"))
        rows.append(_embed(runner, MIXED))
    assert kept == ["64", "8", None]  # 0: the plugin's own default
    for bounded in rows[:2]:  # the same rows whatever the plugin keeps
        np.testing.assert_allclose(bounded, rows[2], atol=1e-6)


# -- the precision guard -------------------------------------------------------------------------------
def test_detected_bf16_serves_bf16_and_says_so(exports: dict[str, Path], tmp_path: Path) -> None:
    core = _Core(["FP32", "BF16", "INT8"])
    runner = load_openvino_runner(str(exports["minilm"]), name=None, cache_dir=str(tmp_path), core=core)
    runner.warmup()
    assert (runner.precision, runner.info.dtype) == ("bf16", "bfloat16")
    no_bf16 = load_openvino_runner(str(exports["minilm"]), name=None, cache_dir=str(tmp_path),
                                   core=_Core(["FP32", "INT8"]))
    assert (no_bf16.precision, no_bf16.info.dtype) == ("f32", "float32")


def test_a_model_that_drifts_in_bf16_falls_back_to_float32_and_logs_it(
    exports: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A guard stricter than any reduced precision can meet stands in for a model that drifts."""
    monkeypatch.setattr(precision, "BF16_MIN_COSINE", 1.5)
    runner = load_openvino_runner(str(exports["minilm"]), name=None, cache_dir=str(tmp_path),
                                  core=_Core(["FP32", "BF16"]))
    assert runner.info.dtype == "bfloat16"
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        runner.warmup()
    assert (runner.precision, runner.info.dtype) == ("f32", "float32")
    assert any("drifts from float32" in r.getMessage() and "serving float32" in r.getMessage()
               for r in caplog.records)
    ours = _embed(runner, list(MIXED))
    reference = _embed(load_onnx_runner(str(exports["minilm"]), name=None), list(MIXED))
    assert _cosines(ours, reference).min() >= COSINE_F32


def test_a_restart_decides_the_precision_from_the_measurement_kept_in_the_cache(
    exports: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The guard measures once per export, precision, OpenVINO and CPU: a restart reads what it measured
    (a model that drifted starts in float32 at once), another CPU measures again."""
    measured: list[str] = []
    guard = OpenVinoRunner._guard

    def counting(self: OpenVinoRunner) -> None:
        measured.append(self.precision)
        guard(self)

    monkeypatch.setattr(OpenVinoRunner, "_guard", counting)

    def start(capabilities: list[str]) -> OpenVinoRunner:
        runner = load_openvino_runner(str(exports["minilm"]), name=None, cache_dir=str(tmp_path),
                                      core=_Core(capabilities))
        runner.warmup()
        return runner

    first = start(["FP32", "BF16"])
    assert measured == ["bf16"] and first.info.dtype == "bfloat16"
    second = start(["FP32", "BF16"])
    assert measured == ["bf16"] and second.info.dtype == "bfloat16"  # read, not measured again
    np.testing.assert_allclose(_embed(second, MIXED), _embed(first, MIXED), atol=1e-6)
    start(["FP32", "BF16", "FP16"])  # another CPU
    assert measured == ["bf16", "bf16"]
    monkeypatch.setattr(precision, "BF16_MIN_COSINE", 1.5)  # the kept drift is now past the bound
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        strict = start(["FP32", "BF16"])
    assert measured == ["bf16", "bf16"] and (strict.precision, strict.info.dtype) == ("f32", "float32")
    assert any("drifts from float32" in r.getMessage() and "earlier start" in r.getMessage()
               for r in caplog.records)


def test_a_classifier_export_runs_on_openvino(exports: dict[str, Path], tmp_path: Path) -> None:
    onnx = load_onnx_runner(str(exports["reranker"]), name=None)
    runner = load_openvino_runner(str(exports["reranker"]), name=None, dtype="auto", cache_dir=str(tmp_path),
                                  core=_Core(["FP32", "BF16"]))
    runner.warmup()  # the guard compares with a float32 compile: no stored rows for scores
    assert isinstance(runner, OpenVinoPairRunner)
    q, d = runner.tokenize(["how do plants make oxygen", "Photosynthesis releases oxygen."])
    pair = runner.pair_with_special_tokens(q, d)
    assert isinstance(pair, PairIds)
    scores = [r.finish(r.forward(p), p) for r in (runner, onnx) for p in [r.prepare([pair])]]
    tolerance = 1e-4 if runner.info.dtype == "float32" else openvino_runner.MAX_LOGIT_ERROR
    assert abs(float(scores[0][0, 0]) - float(scores[1][0, 0])) <= tolerance * max(1.0, abs(scores[1][0, 0]))


def test_a_served_export_runs_on_openvino_under_jemalloc(exports: dict[str, Path], tmp_path: Path) -> None:
    """`coalesce serve` runs on jemalloc where it is installed (the images preload it): OpenVINO's threading
    library used to abort such a process as it started (``free(): invalid pointer``)."""
    library = find_jemalloc()
    if library is None:
        pytest.skip("jemalloc is not installed here")
    port = free_port()
    proc = subprocess.Popen(
        [COALESCE, "serve", "--backend", "openvino", "--model", str(exports["minilm"]), "--host", "127.0.0.1",
         "--port", str(port), "--openvino-cache-dir", str(tmp_path), "--allocator", "jemalloc"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
    )
    url = f"http://127.0.0.1:{port}"

    async def embed() -> tuple[int, str]:
        await wait_ready(url, proc)
        async with aiohttp.ClientSession() as http:
            body = {"model": "all-MiniLM-L6-v2", "input": "hi"}
            async with http.post(url + "/v1/embeddings", json=body) as r:
                await r.read()
            async with http.get(url + "/info") as info:
                return r.status, (await info.json())["model_dtype"]

    try:
        status, dtype = asyncio.run(asyncio.wait_for(embed(), 120))
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert status == 200, stderr.decode(errors="replace")[-2000:]
    assert dtype in ("float32", "bfloat16")
    assert library in stderr.decode(errors="replace")  # the allocator line: it ran on jemalloc


def test_auto_serves_an_export_on_cpu_with_openvino(exports: dict[str, Path]) -> None:
    runner = load_runner(str(exports["minilm"]), None, RunnerOptions(device="cpu", dtype="float32"))
    assert isinstance(runner, OpenVinoRunner)


# -- the int8 export -----------------------------------------------------------------------------------
def test_the_int8_export_is_static_and_says_how(exports: dict[str, Path]) -> None:
    manifest = json.loads((exports["minilm-int8"] / "coalesce_export.json").read_text())
    assert manifest["quantize"] == "int8"
    assert (manifest["quantization"]["method"], manifest["quantization"]["format"]) == ("static", "QDQ")
    assert "calibration corpus" in manifest["quantization"]["calibration"]
    assert json.loads((exports["minilm"] / "coalesce_export.json").read_text())["quantization"] == {}


TEXTS = ["hello", "The quick brown fox jumps over the lazy dog.", LONG, "a b c",
         "Photosynthesis splits water and releases oxygen; chlorophyll absorbs red and blue light.",
         "Crème brûlée at the CAFÉ, naïve façade — 你好世界 🚀", "short", "one two three four five six"]


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_an_int8_row_is_the_same_alone_and_in_batches_of_any_size(
    exports: dict[str, Path], backend: str, tmp_path: Path
) -> None:
    path = str(exports["minilm-int8"])
    runner = (load_onnx_runner(path, name=None) if backend == "onnx" else
              load_openvino_runner(path, name=None, dtype="float32", cache_dir=str(tmp_path)))
    target = "The quick brown fox jumps over the lazy dog."
    alone = _embed(runner, [target])[0]
    for size in (2, 5, 8, 32):
        batch = (TEXTS * 4)[:size]
        if target not in batch:
            batch[-1] = target
        rows = _embed(runner, batch)
        assert np.abs(rows[batch.index(target)] - alone).max() <= INVARIANT, size
    # Still the model: each runtime rounds its int8 arithmetic its own way (ONNX Runtime and OpenVINO
    # differ by about as much as each differs from float), so each is held to float32, not to the other.
    reference = _embed(load_onnx_runner(str(exports["minilm"]), name=None), TEXTS)
    assert _cosines(_embed(runner, TEXTS), reference).min() >= INT8_FLOOR
