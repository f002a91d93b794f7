"""The cold-start loader on the real packaged model: it embeds exactly like ``SentenceTransformer.encode``,
never imports transformers, tokenizes like sentence-transformers when the tokenizer settings change, and
hands back None for directories it does not reproduce."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coalesce.kernels.encoder_runner import EncoderRunner
from coalesce.kernels.fastload import build_fast_encoder_runner
from coalesce.kernels.protocol import Runner
from coalesce.kernels.st_runner import default_model_path

COSINE = 0.99999
MODEL = Path(default_model_path())
LONG = " ".join(["river", "house", "green", "tree"] * 100)  # 400 tokens: truncated to 256
MIXED = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée at the CAFÉ, naïve façade — 你好世界 🚀",
    LONG,
    "a b c",
]


@pytest.fixture(scope="module")
def runner() -> EncoderRunner:
    built = build_fast_encoder_runner(str(MODEL), name=None, device="cpu", dtype="float32")
    assert built is not None
    return built


@pytest.fixture(scope="module")
def st() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MODEL), device="cpu", local_files_only=True)


def _embed(runner: EncoderRunner, texts: list[str]) -> np.ndarray:
    batch = [runner.with_special_tokens(ids) for ids in runner.tokenize(texts)]
    prepared = runner.prepare(batch)
    return runner.finish(runner.forward(prepared), prepared)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    cos: np.ndarray = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return cos


def test_it_is_the_graph_runner_with_the_packaged_models_facts(runner: EncoderRunner) -> None:
    assert isinstance(runner, Runner)
    assert type(runner) is EncoderRunner
    info = runner.info
    assert (info.name, info.max_tokens, info.dim, info.normalized, info.vocab_size) == (
        "all-MiniLM-L6-v2", 256, 384, True, 30522,
    )


@pytest.mark.parametrize("texts", [["hello"], MIXED], ids=["single", "mixed"])
def test_embeddings_match_sentence_transformers(runner: EncoderRunner, st: Any, texts: list[str]) -> None:
    ours = _embed(runner, texts)
    reference = st.encode(texts, batch_size=32)
    assert ours.shape == reference.shape == (len(texts), 384)
    assert _cosines(ours, reference).min() >= COSINE
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)


def test_the_tuned_cpu_forward_embeds_like_the_plain_one(runner: EncoderRunner) -> None:
    from coalesce.kernels.cpu_forward import is_tuned

    plain = build_fast_encoder_runner(str(MODEL), name=None, device="cpu", dtype="float32",
                                      cpu_fast_forward=False)
    assert plain is not None
    assert is_tuned(runner.model) and not is_tuned(plain.model)
    np.testing.assert_allclose(_embed(runner, MIXED), _embed(plain, MIXED), rtol=0, atol=1e-5)


def test_token_ids_match_sentence_transformers_and_long_input_is_truncated(
    runner: EncoderRunner, st: Any
) -> None:
    ours = [runner.with_special_tokens(ids) for ids in runner.tokenize(MIXED)]
    theirs = st.tokenize(MIXED)
    for i, ids in enumerate(ours):
        length = int(theirs["attention_mask"][i].sum())
        assert ids == theirs["input_ids"][i][:length].tolist()
    assert len(ours[MIXED.index(LONG)]) == 256


def test_building_and_embedding_never_imports_transformers() -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from coalesce.kernels.fastload import build_fast_encoder_runner
        r = build_fast_encoder_runner({str(MODEL)!r}, name=None, device="cpu")
        p = r.prepare([r.with_special_tokens(r.tokenize(["hello"])[0])])
        assert r.finish(r.forward(p), p).shape == (1, 384)
        print(sorted(m for m in ("transformers", "sentence_transformers") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- variants of the packaged directory ------------------------------------------------------------------
def _variant(tmp_path: Path, edits: dict[str, Callable[[Any], Any]]) -> Path:
    """The packaged model directory as symlinks, with the JSON files named in ``edits`` rewritten."""
    root = tmp_path / "model"
    for src in MODEL.rglob("*"):
        if src.is_file():
            dst = root / src.relative_to(MODEL)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src)
    for name, edit in edits.items():
        path = root / name
        content = json.loads(path.read_text()) if path.exists() else {}
        path.unlink(missing_ok=True)
        path.write_text(json.dumps(edit(content)))
    return root


def _with_dense(modules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    return [*modules, dense]


@pytest.mark.parametrize(
    ("edits", "reason"),
    [
        ({"modules.json": _with_dense}, "module pipeline"),
        ({"config.json": lambda c: {**c, "model_type": "new-arch"}}, "model_type"),
        ({"1_Pooling/config.json": lambda c: {**c, "pooling_mode_max_tokens": True,
                                              "pooling_mode_mean_tokens": False}}, "pooling 'max'"),
    ],
    ids=["dense", "model_type", "max_pooling"],
)
def test_directories_it_does_not_reproduce_return_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edits: dict[str, Callable[[Any], Any]], reason: str
) -> None:
    root = _variant(tmp_path, edits)
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        assert build_fast_encoder_runner(str(root), name=None, device="cpu") is None
    assert any(reason in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)


def _cased(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "do_lower_case": False}


def _lower(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "do_lower_case": True}


@pytest.mark.parametrize(
    ("edits", "upper_equals_lower"),
    [
        # transformers lets tokenizer_config.json's do_lower_case override tokenizer.json's normaliser
        ({"tokenizer_config.json": _cased}, False),
        # sentence-transformers' own do_lower_case lowercases on top of a cased tokenizer
        ({"tokenizer_config.json": _cased, "sentence_bert_config.json": _lower}, True),
    ],
    ids=["cased_tokenizer", "cased_tokenizer_with_do_lower_case"],
)
def test_tokenizer_settings_tokenize_like_sentence_transformers(
    tmp_path: Path, edits: dict[str, Callable[[Any], Any]], upper_equals_lower: bool
) -> None:
    from sentence_transformers import SentenceTransformer

    root = _variant(tmp_path, edits)
    fast = build_fast_encoder_runner(str(root), name=None, device="cpu")
    assert fast is not None
    texts = ["HELLO World", "hello world", "Crème BRÛLÉE"]
    ours = fast.tokenize(texts)
    reference = SentenceTransformer(str(root), device="cpu", local_files_only=True)
    theirs = reference.tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert ours == theirs
    assert (ours[0] == ours[1]) is upper_equals_lower


def test_the_per_operator_profile_prints_both_precisions(capsys: pytest.CaptureFixture[str]) -> None:
    from coalesce.loadtests import forward_ops

    assert forward_ops.main(["--rows", "4", "--tokens", "6", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "tuned CPU forward" in out and "float32" in out and "bfloat16" in out
    assert "_linear_pointwise" in out  # the packed layers are what runs
    assert "all operators" in out and "wall ms per forward" in out
    assert "plain (--no-cpu-fast-forward)" in out and "plain ÷ tuned" in out  # both forwards timed


def test_forwards_side_by_side_are_measured_against_one_on_every_core(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from coalesce.loadtests import forward_lanes

    assert forward_lanes.main(["--rows", "2", "--tokens", "6", "--busy", "0", "--forwards", "4",
                               "--rounds", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "one forward, every core" in out and "one forward, one core" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] == ["2", "0.00"]]
    assert len(rows) == 1 and rows[0][-1].endswith("×")
