"""The GPU session's bundle: the model directory it carries (no weights) gets random weights there, and
then loads in the service's loader and in sentence-transformers alike, so the session's correctness
checks and its service run have a model. The wheels part needs a registry and is not run here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from coalesce.kernels.fastload import build_fast_encoder_runner
from coalesce.loadtests.gpu.bundle import main as bundle_main
from coalesce.loadtests.gpu.check import main as gpu_check_main

TEXTS = ["hello", "graphs replay kernels without the host", "padding " * 40, "a b c"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / ".gpu"
    assert bundle_main(["pack", str(out), "--no-wheels"]) == 0
    return out


def _embed(path: str) -> torch.Tensor:
    runner = build_fast_encoder_runner(path, name=None, device="cpu")
    assert runner is not None, "the service's fast loader refused the directory"
    prepared = runner.prepare([runner.with_special_tokens(ids) for ids in runner.tokenize(TEXTS)])
    return torch.from_numpy(runner.finish(runner.forward(prepared), prepared))


def test_the_bundle_carries_the_model_without_its_weights(bundle: Path, minilm_path: str) -> None:
    model = bundle / "model"
    carried = {p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file()}
    assert "model.safetensors" not in carried
    assert {"config.json", "tokenizer.json", "modules.json", "1_Pooling/config.json"} <= carried
    assert sum(p.stat().st_size for p in model.rglob("*") if p.is_file()) < 2**20  # 64 MiB travel at most


@pytest.fixture
def weighted(bundle: Path, tmp_path: Path) -> Path:
    """A copy of the bundle's model directory with random weights written, as the session does there."""
    model = tmp_path / "model"
    shutil.copytree(bundle / "model", model)
    assert bundle_main(["weights", str(model), "--seed", "3"]) == 0
    return model


def test_random_weights_load_in_the_service_loader_and_match_encode(weighted: Path, minilm_path: str) -> None:
    from sentence_transformers import SentenceTransformer

    ours = _embed(str(weighted))
    st = SentenceTransformer(str(weighted), device="cpu", local_files_only=True)
    theirs = st.encode(TEXTS, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity
    assert float(cos(ours, theirs, dim=-1).min()) >= 0.99999
    # The weights are the random ones, not the packaged model's.
    assert float(cos(ours, _embed(minilm_path), dim=-1).max()) < 0.9


def test_gpu_check_checks_the_service_loader_on_the_given_directory(
    weighted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--device", "cpu", "--st-model", str(weighted), "--max-tokens", "16", "--batch-sizes", "1",
            "--seq-lens", "8", "--seconds-per-case", "0"]
    assert gpu_check_main(args) == 0
    out = capsys.readouterr().out
    assert "service loader (eager) = ST.encode (its weights, fp32)" in out
    assert "FAIL" not in out
