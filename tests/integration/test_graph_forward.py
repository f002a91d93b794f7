"""The graph-safe forward on the real packaged model (CPU, eager): it must embed exactly like
``SentenceTransformer.encode`` at every length, whatever the padding, and fall back when it cannot."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from coalesce.kernels.bert import GraphSafeBert
from coalesce.kernels.buckets import pad_to_shape
from coalesce.kernels.encoder_runner import EncoderRunner, build_encoder_runner
from coalesce.kernels.protocol import Runner
from coalesce.kernels.st_runner import default_model_path
from coalesce.loadtests.gpu.check import main as gpu_check_main

COSINE = 0.99999
# Each word is one token for this model's vocabulary, so k words make k + 2 tokens with [CLS]/[SEP].
WORDS = [
    *("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "from", "old", "red"),
    *("house", "near", "river", "with", "green", "trees", "under", "blue", "sky", "while", "children"),
    *("play", "games"),
]


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


# 1..254 words = every length from 3 to 256 tokens (the model's maximum); 300 and 1000 get truncated.
TEXTS = [_text(k, seed=k) for k in (*range(1, 255), 300, 1000)]


@pytest.fixture(scope="module")
def st() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(default_model_path(), device="cpu", local_files_only=True)


@pytest.fixture(scope="module")
def runner() -> EncoderRunner:
    built = build_encoder_runner(default_model_path(), name=None, device="cpu", dtype="float32")
    assert built is not None
    built.warmup()
    return built


@pytest.fixture(scope="module")
def reference(st: Any) -> np.ndarray:
    out: np.ndarray = st.encode(TEXTS, batch_size=32)
    return out


def _ids(runner: EncoderRunner, texts: list[str]) -> list[list[int]]:
    return [runner.with_special_tokens(ids) for ids in runner.tokenize(texts)]


def _embed(runner: EncoderRunner, batch: list[list[int]]) -> np.ndarray:
    prepared = runner.prepare(batch)
    return runner.finish(runner.forward(prepared), prepared)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    cos: np.ndarray = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return cos


def test_it_is_a_runner_with_the_packaged_models_facts(runner: EncoderRunner) -> None:
    assert isinstance(runner, Runner)
    assert runner.info.name == "all-MiniLM-L6-v2"
    assert (runner.info.max_tokens, runner.info.dim, runner.info.normalized) == (256, 384, True)
    assert runner.padded_cost(3, 10) == 30  # eager on CPU: padded to the batch's longest, no cells


def test_mixed_batches_match_encode_at_every_length(runner: EncoderRunner, reference: np.ndarray) -> None:
    ids = _ids(runner, TEXTS)
    assert {len(seq) for seq in ids} == set(range(3, 257))
    order = list(range(len(ids)))
    random.Random(0).shuffle(order)  # mixed lengths in each batch, so most rows are padded
    got = np.empty_like(reference)
    for start in range(0, len(order), 16):
        chunk = order[start : start + 16]
        got[chunk] = _embed(runner, [ids[i] for i in chunk])
    assert got.dtype == np.float32
    assert _cosines(got, reference).min() >= COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_single_inputs_match_encode(runner: EncoderRunner, reference: np.ndarray) -> None:
    picks = [0, 1, 14, 15, 62, 126, 253, 255]  # 3, 4, 17, 18, 65, 129, 256 tokens and a truncated one
    for i in picks:
        got = _embed(runner, _ids(runner, [TEXTS[i]]))
        assert got.shape == (1, 384)
        assert _cosines(got, reference[i : i + 1]).min() >= COSINE, f"text {i}"


def test_padding_up_to_a_cell_changes_nothing_and_padded_rows_stay_finite(runner: EncoderRunner) -> None:
    batch = _ids(runner, [TEXTS[i] for i in (0, 40, 3, 100)])
    exact = _embed(runner, batch)
    ids, lengths = pad_to_shape(batch, rows=8, cols=256, pad_id=runner.pad_id)  # 4 fully padded rows
    with torch.inference_mode():
        out = runner.model(torch.from_numpy(ids), torch.from_numpy(lengths)).numpy()
    assert np.isfinite(out).all()
    assert _cosines(out[:4], exact).min() >= COSINE
    assert np.abs(out[4:]).max() == 0.0  # pooled over nothing: a zero vector, not NaN


def test_cls_pooling_without_normalisation_matches_hugging_face(st: Any) -> None:
    hf = st[0].auto_model
    model = GraphSafeBert.from_hf(hf, pooling="cls", normalize=False)
    batch = [[101, 2000, 2001, 2002, 102], [101, 2003, 102]]
    ids, lengths = pad_to_shape(batch, rows=2, cols=5, pad_id=0)
    mask = torch.from_numpy((np.arange(5) < lengths[:, None]).astype(np.int64))
    with torch.inference_mode():
        expected = hf(input_ids=torch.from_numpy(ids), attention_mask=mask).last_hidden_state[:, 0]
        got = model(torch.from_numpy(ids), torch.from_numpy(lengths))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_truncate_dim_truncates_before_normalising(st: Any) -> None:
    hf = st[0].auto_model
    full = GraphSafeBert.from_hf(hf, pooling="mean", normalize=False)
    short = GraphSafeBert.from_hf(hf, pooling="mean", normalize=True, truncate_dim=128)
    ids, lengths = (torch.from_numpy(a) for a in pad_to_shape([[101, 2000, 2001, 102]], 1, 4, pad_id=0))
    with torch.inference_mode():
        expected = torch.nn.functional.normalize(full(ids, lengths)[:, :128], dim=-1)
        got = short(ids, lengths)
    assert short.dim == 128 and got.shape == (1, 128)
    torch.testing.assert_close(got, expected)


def test_float16_on_cpu_runs_float32_and_bfloat16_runs_bfloat16(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        built = build_encoder_runner(default_model_path(), name="m", device="cpu", dtype="float16")
    assert built is not None
    assert built.model.word.weight.dtype == torch.float32
    assert any("running float32" in r.getMessage() for r in caplog.records)
    # bfloat16 asked: it runs (emulated where the CPU lacks it), past the guard, on this loader too.
    bf16 = build_encoder_runner(default_model_path(), name="m", device="cpu", dtype="bfloat16")
    assert bf16 is not None and bf16.model.word.weight.dtype == torch.bfloat16
    assert bf16.info.dtype == "bfloat16"


def _tokenizer_files(dest: Path) -> None:
    src = Path(default_model_path())
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dest / name)


def test_a_model_outside_the_bert_family_falls_back_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=30522, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    DistilBertModel(config).save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        assert build_encoder_runner(str(tmp_path), name="tiny", device="cpu") is None
    assert any("DistilBertModel is not a BertModel" in r.getMessage() for r in caplog.records)


def test_a_pooling_the_forward_lacks_falls_back(
    st: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    SentenceTransformer(modules=[st[0], Pooling(384, "max")]).save(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        assert build_encoder_runner(str(tmp_path), name="max", device="cpu") is None
    assert any("pooling 'max'" in r.getMessage() for r in caplog.records)


def test_gpu_check_runs_its_code_paths_on_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    assert gpu_check_main(["--cpu-smoke", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "ours eager = HF eager fp32 (float32)" in out
    assert "FAIL" not in out
    assert "latency, ms" in out and "service throughput" in out
    # Each section in its own file, as printed; a row per latency shape; how the run ended.
    sections = {p.stem: p.read_text() for p in out_dir.glob("*.txt")}
    assert set(sections) == {"header", "correctness", "capture", "latency", "service", "status"}
    assert all(sections[name] in out for name in ("header", "correctness", "latency", "service"))
    assert "# SDPA: enabled" in sections["header"]
    assert len(sections["latency"].splitlines()) == 2 + 4  # title, column heads, (1, 2) × (8, 16)
    assert sections["capture"].startswith("capture: skipped")
    assert sections["status"] == "complete: exit 0\n"
    with pytest.raises(SystemExit) as exit_info:
        gpu_check_main(["--help"])
    assert exit_info.value.code == 0


def test_gpu_check_records_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import coalesce.loadtests.gpu.check as gpu_check

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "time_shape", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gpu_check_main(["--cpu-smoke", "--out", str(tmp_path)])
    assert (tmp_path / "status.txt").read_text().startswith("stopped in latency: KeyboardInterrupt")
    assert "ours eager = HF eager fp32" in (tmp_path / "correctness.txt").read_text()  # kept
