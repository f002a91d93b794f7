"""Models the graph-safe forward does not reproduce are served by the eager sentence-transformers runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest


@pytest.fixture(scope="module")
def dense_model_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> str:
    # The packaged MiniLM with a Dense projection on top: a module pipeline the fast paths decline.
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense

    torch.manual_seed(0)
    base = SentenceTransformer(minilm_path, device="cpu")
    dense = Dense(in_features=384, out_features=64, activation_function=torch.nn.Tanh())
    out = tmp_path_factory.mktemp("dense") / "minilm-dense"
    SentenceTransformer(modules=[*base, dense], device="cpu").save(str(out))
    return str(out)


def test_unsupported_pipeline_falls_back_to_the_eager_runner(dense_model_dir: str) -> None:
    from coalesce.kernels.loader import RunnerOptions, load_runner
    from coalesce.kernels.st_runner import SentenceTransformerRunner
    from sentence_transformers import SentenceTransformer

    runner: Any = load_runner(dense_model_dir, "dense", RunnerOptions(device="cpu"))
    assert isinstance(runner, SentenceTransformerRunner)
    assert runner.info.dim == 64 and runner.info.name == "dense"
    texts = ["a short one", "a somewhat longer sentence about fallbacks", "x " * 300]
    seqs = [runner.with_special_tokens(ids) for ids in runner.tokenize(texts)]
    prepared = runner.prepare(seqs)
    got = runner.finish(runner.forward(prepared), prepared)
    want = SentenceTransformer(dense_model_dir, device="cpu").encode(texts)
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert got.shape == (3, 64)
    assert cos.min() >= 0.99999  # on the packed linear layers (--cpu-fast-forward, the default)


def test_the_eager_runner_packs_its_linear_layers_and_embeds_like_the_plain_model(
    dense_model_dir: str,
) -> None:
    from coalesce.kernels.cpu_forward import PackedLinear, is_tuned, packing_unavailable
    from coalesce.kernels.st_runner import SentenceTransformerRunner

    if packing_unavailable() is not None:
        pytest.skip(packing_unavailable())
    tuned = SentenceTransformerRunner(dense_model_dir, name=None, device="cpu", dtype="float32")
    plain = SentenceTransformerRunner(dense_model_dir, name=None, device="cpu", dtype="float32",
                                      cpu_fast_forward=False)
    assert is_tuned(tuned.model) and not is_tuned(plain.model)
    packed = [m for m in tuned.model.modules() if isinstance(m, PackedLinear)]
    # Six projections in each of the six layers (query, key, value, attention output, intermediate,
    # output), the BERT pooler's and the Dense head's.
    assert len(packed) == 6 * 6 + 2
    texts = ["a short one", "a somewhat longer sentence about fallbacks", "x " * 300]

    def rows(runner: Any) -> np.ndarray:
        prepared = runner.prepare([runner.with_special_tokens(ids) for ids in runner.tokenize(texts)])
        out: np.ndarray = runner.finish(runner.forward(prepared), prepared)
        return out

    np.testing.assert_allclose(rows(tuned), rows(plain), rtol=0, atol=1e-5)


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_runner(str(tmp_path / "nope"), None, RunnerOptions(device="cpu"))
