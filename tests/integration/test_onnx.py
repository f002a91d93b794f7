"""The ONNX backend end to end: ``coalesce export`` on the packaged MiniLM and the tiny classifier and
cross-encoder, served by the ONNX runner and by a real server with ``--backend onnx``, against
sentence-transformers, the Hugging Face classifier and ``CrossEncoder.predict``; a serving process
that never imports torch; and the errors a user meets (a model the exporter cannot trace, a
directory with no graph)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.kernels.calibration import BATCH, CORPUS, corpus_batches, digest
from coalesce.kernels.loader import RunnerOptions, load_runner
from coalesce.kernels.onnx_runner import MissingGraph, OnnxPairRunner, OnnxRunner, load_onnx_runner
from coalesce.kernels.protocol import PairIds, Runner
from coalesce.kernels.tokens import TokenizerAdapter
from coalesce.service.engine.core import Engine, default_factory
from coalesce.service.metrics import Metrics
from coalesce.service.settings import build

from ..conftest import ServerThread, free_port
from .tiny_models import LABELS, classifier_dir, reranker_dir

COSINE = 0.99999
INT8_FLOOR = 0.95  # a sanity floor only: int8's cosine is reported, not promised
LONG = " ".join(["river", "house", "green", "tree"] * 100)  # 400 tokens: truncated to 256
MIXED = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée at the CAFÉ, naïve façade — 你好世界 🚀",
    LONG,
    "a b c",
    "Photosynthesis splits water and releases oxygen; chlorophyll absorbs red and blue light.",
]
QUERY = "how do plants make oxygen"
DOCS = [
    "Photosynthesis splits water and releases oxygen.",
    "The printing press spread books across Europe.",
    LONG,
]
COALESCE = str(Path(sys.executable).with_name("coalesce"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    cos: np.ndarray = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return cos


def _rows(runner: Any, batch: list[Any]) -> np.ndarray:
    prepared = runner.prepare(batch)
    rows: np.ndarray = runner.finish(runner.forward(prepared), prepared)
    return rows


def _embed(runner: Any, texts: list[str]) -> np.ndarray:
    return _rows(runner, [runner.with_special_tokens(ids) for ids in runner.tokenize(texts)])


# -- embeddings ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm(exports: dict[str, Path]) -> OnnxRunner:
    return load_onnx_runner(str(exports["minilm"]), name=None)


def test_the_runner_keeps_the_protocol_and_the_models_facts(minilm: OnnxRunner) -> None:
    assert isinstance(minilm, Runner) and not isinstance(minilm, OnnxPairRunner)
    assert isinstance(minilm.tokens, TokenizerAdapter)
    assert (minilm.device, minilm.capture_stats) == ("cpu", None)
    info = minilm.info
    assert (info.name, info.max_tokens, info.dim, info.normalized, info.vocab_size, info.aliases) == (
        "all-MiniLM-L6-v2", 256, 384, True, 30522, ("sentence-transformers/all-MiniLM-L6-v2",),
    )
    assert minilm.padded_cost(4, 10) == 40


def test_the_session_holds_no_arena_that_grows_with_batch_shapes(minilm: OnnxRunner) -> None:
    """ORT's CPU arena keeps the largest batch's memory (rounded up to a power of two) for good: 167 →
    559 MiB over 300 distinct shapes (issue 24). Without it, tensors come from malloc, which gives back."""
    assert minilm._session.get_session_options().enable_cpu_mem_arena is False


@pytest.mark.parametrize(
    "texts",
    [["hello"], [LONG], MIXED, [LONG, "hi"] * 3],
    ids=["single", "max-length", "mixed", "long-and-short"],
)
def test_fp32_export_matches_sentence_transformers(
    minilm: OnnxRunner, st_model: Any, texts: list[str]
) -> None:
    ours = _embed(minilm, texts)
    reference = st_model.encode(texts, batch_size=32)
    assert ours.shape == reference.shape
    assert _cosines(ours, reference).min() >= COSINE
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_padding_does_not_change_a_row(minilm: OnnxRunner) -> None:
    alone = np.concatenate([_embed(minilm, [t]) for t in MIXED])
    assert _cosines(_embed(minilm, MIXED), alone).min() >= COSINE


def test_the_exported_tokenizer_tokenizes_like_sentence_transformers(
    minilm: OnnxRunner, st_model: Any
) -> None:
    for text in MIXED:
        ours = minilm.with_special_tokens(minilm.tokenize([text])[0])
        theirs = st_model.tokenize([text])["input_ids"][0].tolist()
        assert ours == theirs
    assert len(minilm.with_special_tokens(minilm.tokenize([LONG])[0])) == 256


def test_int8_is_opt_in_and_reports_its_cosine(
    exports: dict[str, Path], minilm: OnnxRunner, st_model: Any
) -> None:
    fp32 = json.loads((exports["minilm"] / "coalesce_export.json").read_text())
    int8 = json.loads((exports["minilm-int8"] / "coalesce_export.json").read_text())
    assert (fp32["quantize"], int8["quantize"]) == ("none", "int8")
    size = {name: (exports[name] / "model.onnx").stat().st_size for name in ("minilm", "minilm-int8")}
    assert size["minilm-int8"] < size["minilm"]
    runner = load_onnx_runner(str(exports["minilm-int8"]), name=None)
    cos = _cosines(_embed(runner, MIXED), st_model.encode(MIXED))
    print(f"int8 cosine to sentence-transformers: min {cos.min():.4f}, mean {cos.mean():.4f}; "
          f"export-time check {int8['checks']}")
    assert cos.min() >= INT8_FLOOR
    assert int8["checks"]["int8_cosine_min"] >= INT8_FLOOR


def test_the_export_directory_is_self_contained(exports: dict[str, Path]) -> None:
    out = exports["minilm"]
    names = {p.name for p in out.iterdir()}
    assert {"model.onnx", "tokenizer.json", "tokenizer_config.json", "config.json", "modules.json",
            "config_sentence_transformers.json", "coalesce_export.json", "1_Pooling"} <= names
    assert not any(n.endswith((".safetensors", ".bin")) for n in names)
    source = Path(json.loads((out / "coalesce_export.json").read_text())["source"])
    assert (out / "config_sentence_transformers.json").read_text() == (
        source / "config_sentence_transformers.json"
    ).read_text()


def _engine_calibration(model: Path) -> tuple[np.ndarray | None, int]:
    """Load ``model`` into an engine as a server does; its calibration rows and the forwards it ran."""
    settings = build(["--backend", "onnx", "--model", str(model)], environ={})
    forwards = 0

    def factory(spec: Any) -> Any:
        runner = default_factory(settings)(spec)
        run = runner.forward

        def counted(prepared: Any) -> Any:
            nonlocal forwards
            forwards += 1
            return run(prepared)

        runner.forward = counted
        return runner

    async def load() -> np.ndarray | None:
        engine = Engine(settings, Metrics(), factory)
        try:
            await engine.load()
            return engine.models[0].calibration
        finally:
            await engine.close()

    return asyncio.run(load()), forwards


def test_an_export_brings_its_calibration_rows_so_a_server_starts_without_embedding_the_corpus(
    exports: dict[str, Path], tmp_path: Path
) -> None:
    for name in ("minilm", "minilm-int8"):
        out = exports[name]
        assert json.loads((out / "coalesce_export.json").read_text())["calibration"] == digest()
        stored = np.load(out / "calibration.npy")
        assert stored.shape == (len(CORPUS), 384) and stored.dtype == np.float32
        # Made by the final graph (after int8 quantisation), exactly as a warm-up would embed the corpus.
        runner = load_onnx_runner(str(out), name=None)
        live = np.concatenate([_rows(runner, batch) for batch in corpus_batches(runner.tokens)])
        np.testing.assert_allclose(stored, live, atol=1e-5)
        assert runner.calibration is not None
    assert not np.allclose(np.load(exports["minilm"] / "calibration.npy"),
                           np.load(exports["minilm-int8"] / "calibration.npy"), atol=1e-4)

    rows, forwards = _engine_calibration(exports["minilm"])
    assert rows is not None and forwards == 3  # warm-up and the cost model's two seeds: no corpus batch
    np.testing.assert_array_equal(rows, np.load(exports["minilm"] / "calibration.npy"))

    # An export whose rows were made from another corpus: they are ignored and the corpus embedded again.
    stale = tmp_path / "stale"
    stale.mkdir()
    for item in exports["minilm"].iterdir():
        (stale / item.name).symlink_to(item)
    (stale / "coalesce_export.json").unlink()
    manifest = json.loads((exports["minilm"] / "coalesce_export.json").read_text())
    (stale / "coalesce_export.json").write_text(json.dumps({**manifest, "calibration": "0" * 16}))
    assert load_onnx_runner(str(stale), name=None).calibration is None
    recomputed, forwards = _engine_calibration(stale)
    assert recomputed is not None and forwards == 3 + -(-len(CORPUS) // BATCH)
    np.testing.assert_allclose(recomputed, rows, atol=1e-5)


# -- classifier and cross-encoder ----------------------------------------------------------------------
def test_classifier_export_matches_the_hugging_face_model(exports: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    runner = load_onnx_runner(str(exports["classifier"]), name=None)
    assert isinstance(runner, OnnxPairRunner) and isinstance(runner, Runner)
    assert (runner.info.labels, runner.info.activation) == (LABELS, "softmax")
    tok = AutoTokenizer.from_pretrained(classifier_dir())
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir()).eval()
    texts = ["I loved this film.", "Terrible service, never again.", LONG, "ok"]
    pairs = [(QUERY, d) for d in DOCS]
    everything = [*texts, QUERY, *DOCS]
    by_text = dict(zip(everything, runner.tokenize(everything), strict=True))
    batch: list[Any] = [runner.with_special_tokens(by_text[t]) for t in texts]
    batch += [runner.pair_with_special_tokens(by_text[a], by_text[b]) for a, b in pairs]
    assert all(isinstance(s, PairIds) for s in batch[len(texts):])
    ours = _rows(runner, batch)
    with torch.inference_mode():
        single = tok(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
        paired = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, truncation="longest_first",
                     max_length=512, return_tensors="pt")
        reference = torch.cat([model(**single).logits, model(**paired).logits]).numpy()
    assert _cosines(ours, reference).min() >= COSINE
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)


def test_cross_encoder_export_matches_cross_encoder_predict(exports: dict[str, Path]) -> None:
    from sentence_transformers import CrossEncoder

    runner = load_onnx_runner(str(exports["reranker"]), name=None)
    assert (runner.info.task, runner.info.dim, runner.info.activation) == ("rerank", 1, "sigmoid")
    ids = dict(zip([QUERY, *DOCS], runner.tokenize([QUERY, *DOCS]), strict=True))
    logits = _rows(runner, [runner.pair_with_special_tokens(ids[QUERY], ids[d]) for d in DOCS])[:, 0]
    ours = 1 / (1 + np.exp(-logits))
    predicted = CrossEncoder(reranker_dir(), device="cpu").predict([(QUERY, d) for d in DOCS])
    np.testing.assert_allclose(ours, predicted, atol=1e-5)
    assert _cosines(ours[None, :], np.asarray(predicted)[None, :]).min() >= COSINE


# -- serving -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def onnx_server(exports: dict[str, Path]) -> Iterator[ServerThread]:
    argv = ["--backend", "onnx", "--model", str(exports["minilm"]), "--model", f"rr={exports['reranker']}"]
    server = ServerThread(build(argv, environ={})).start()  # the real loader: no runner factory
    yield server
    server.stop()


async def test_server_with_onnx_backend_answers_embeddings(onnx_server: ServerThread, st_model: Any) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            onnx_server.url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": MIXED}
        )
        assert resp.status == 200
        body = await resp.json()
    vectors = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])
    assert _cosines(vectors, st_model.encode(MIXED)).min() >= COSINE
    assert body["usage"]["prompt_tokens"] > 0


async def test_the_int8_scale_an_export_stores_is_the_one_its_server_quantises_with(
    onnx_server: ServerThread, exports: dict[str, Path]
) -> None:
    from coalesce.kernels.calibration import int8_scale

    manifest = json.loads((exports["minilm"] / "coalesce_export.json").read_text())
    assert manifest["int8_scale"] == pytest.approx(int8_scale(np.load(exports["minilm"] / "calibration.npy")))
    async with aiohttp.ClientSession() as http:
        async with http.get(onnx_server.url + "/info") as resp:
            served = (await resp.json())["quantization_scale"]
        assert served == pytest.approx(manifest["int8_scale"], rel=1e-6)
        body = {"model": "all-MiniLM-L6-v2", "texts": MIXED, "embedding_types": ["float", "int8"]}
        async with http.post(onnx_server.url + "/v2/embed", json=body) as resp:
            embeddings = (await resp.json())["embeddings"]
    want = np.clip(np.rint(np.asarray(embeddings["float"]) / manifest["int8_scale"]), -127, 127)
    assert np.abs(np.asarray(embeddings["int8"]) - want).max() <= 1


async def test_server_with_onnx_backend_reranks(onnx_server: ServerThread) -> None:
    from sentence_transformers import CrossEncoder

    async with aiohttp.ClientSession() as http:
        request = {"model": "rr", "query": QUERY, "documents": DOCS}
        resp = await http.post(onnx_server.url + "/rerank", json=request)
        assert resp.status == 200
        results = (await resp.json())["results"]
    predicted = CrossEncoder(reranker_dir(), device="cpu").predict([(QUERY, d) for d in DOCS])
    scores = {r["index"]: r["relevance_score"] for r in results}
    np.testing.assert_allclose([scores[i] for i in range(len(DOCS))], predicted, atol=1e-5)


_NO_TORCH_PROBE = textwrap.dedent(
    """
    import asyncio, json, sys
    import aiohttp
    from aiohttp import web
    from coalesce.service.gateway.app import create_app
    from coalesce.service.settings import build

    async def main(model, backend, *flags):
        argv = ["--backend", backend, "--model", model, "--host", "127.0.0.1", *flags]
        app = create_app(build(argv, environ={}))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                async with http.get(f"http://127.0.0.1:{port}/ready") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
            async with http.post(f"http://127.0.0.1:{port}/v1/embeddings",
                                 json={"model": "all-MiniLM-L6-v2", "input": ["hello", "world"]}) as r:
                body = await r.json()
            async with http.get(f"http://127.0.0.1:{port}/info") as r_info:
                dtype = (await r_info.json())["model_dtype"]
        await runner.cleanup()
        heavy = {"torch", "transformers", "sentence_transformers"} & {m.split(".")[0] for m in sys.modules}
        with open("/proc/self/maps") as maps:
            heavy |= {"libtorch"} if "libtorch" in maps.read() else set()
        dim = len(body["data"][0]["embedding"])
        print(json.dumps({"status": r.status, "rows": len(body["data"]), "dim": dim, "heavy": sorted(heavy),
                          "dtype": dtype}))

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_serving_an_export_never_imports_torch_or_transformers(
    exports: dict[str, Path], backend: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_PROBE, str(exports["minilm"]), backend,
         "--openvino-cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=ENV, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    dtype = result.pop("dtype")
    assert result == {"status": 200, "rows": 2, "dim": 384, "heavy": []}
    assert dtype == "float32" if backend == "onnx" else dtype in ("float32", "bfloat16")


# -- backend choice and errors -------------------------------------------------------------------------
def test_auto_picks_onnx_for_an_export_on_cpu_and_torch_for_a_plain_directory(
    exports: dict[str, Path], minilm_path: str
) -> None:
    cpu = RunnerOptions(device="cpu")
    assert isinstance(load_runner(str(exports["minilm"]), None, cpu), OnnxRunner)
    assert not isinstance(load_runner(minilm_path, None, cpu), OnnxRunner)
    with pytest.raises(ValueError, match="no torch weights: serve it with --backend onnx"):
        load_runner(str(exports["minilm"]), None, RunnerOptions(device="cpu", backend="torch"))


def test_onnx_backend_on_a_directory_without_a_graph_says_to_export(minilm_path: str) -> None:
    with pytest.raises(MissingGraph, match="run `coalesce export --model"):
        load_runner(minilm_path, None, RunnerOptions(device="cpu", backend="onnx"))
    done = subprocess.run(
        [COALESCE, "serve", "--backend", "onnx", "--model", minilm_path, "--host", "127.0.0.1",
         "--port", str(free_port()), "--log-format", "console"],
        capture_output=True, text=True, timeout=120, env=ENV, check=False,
    )
    assert done.returncode != 0
    assert "has no ONNX graph" in done.stderr and "coalesce export" in done.stderr


_UNTRACEABLE_MODULE = textwrap.dedent(
    '''
    import torch


    class Branchy(torch.nn.Module):
        """Doubles embeddings whose sum is positive: a branch on data, which torch.export cannot trace."""

        def forward(self, features):
            emb = features["sentence_embedding"]
            if emb.sum() > 0:
                emb = emb * 2
            features["sentence_embedding"] = emb
            return features

        def save(self, path):
            pass

        @staticmethod
        def load(path):
            return Branchy()
    '''
)


def test_a_model_the_exporter_cannot_trace_fails_with_its_name_and_reason(
    tmp_path: Path, minilm_path: str
) -> None:
    code, model = tmp_path / "code", tmp_path / "branchy-model"
    code.mkdir()
    model.mkdir()
    (code / "branchy.py").write_text(_UNTRACEABLE_MODULE)
    for f in Path(minilm_path).iterdir():
        if f.name != "modules.json":
            (model / f.name).symlink_to(f)
    modules = json.loads((Path(minilm_path) / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "", "type": "branchy.Branchy"})
    (model / "modules.json").write_text(json.dumps(modules))
    out = tmp_path / "out"
    done = subprocess.run(
        [COALESCE, "export", "--model", str(model), "--out", str(out), "--trust-remote-code"],
        capture_output=True, text=True, timeout=300, env={**ENV, "PYTHONPATH": str(code)}, check=False,
    )
    assert done.returncode == 1
    assert f"model '{model}'" in done.stderr and "the ONNX exporter cannot handle it" in done.stderr
    assert "data-dependent" in done.stderr and "branchy.py:" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 3
    assert not out.exists()


def test_a_directory_that_is_no_model_fails_with_a_message(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    done = subprocess.run(
        [COALESCE, "export", "--model", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=ENV, check=False,
    )
    assert done.returncode == 1
    assert f"model '{tmp_path}'" in done.stderr and "Traceback" not in done.stderr
    # Said from the directory's files, before torch is imported to try loading it.
    assert "not a model directory" in done.stderr
