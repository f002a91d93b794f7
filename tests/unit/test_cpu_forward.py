"""The tuned CPU forward (``cpu_forward``): oneDNN-packed linear layers with the activation fused, and
matmul attention in bfloat16, compute what the plain forward computes, and the guard puts the plain
forward back when the tuned one fails or drifts (tiny random BERT models: no model files needed)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from coalesce.kernels import cpu_forward
from coalesce.kernels.bert import GraphSafeBert, sdpa_attention
from coalesce.kernels.cpu_forward import PackedLinear, is_tuned, tune_cpu_forward
from coalesce.kernels.precision import _bf16_copy

from tests.unit.test_bert_state_dict import CONFIG, _hf_state
from tests.unit.test_precision import _Linear

pytestmark = pytest.mark.skipif(
    cpu_forward.packing_unavailable() is not None, reason="this torch cannot pack for oneDNN"
)

# (rows, columns, lengths): a lone short request, a ragged batch past the matmul-attention threshold,
# a batch with a fully padded row (length 0, as bucket padding makes on CUDA).
BATCHES = [(1, 3, [3]), (2, 6, [6, 2]), (6, 9, [9, 4, 7, 1, 9, 5]), (4, 5, [5, 0, 3, 2])]


def _model(act: str = "gelu", dtype: torch.dtype = torch.float32) -> GraphSafeBert:
    config = {**CONFIG, "hidden_act": act}
    model = GraphSafeBert.from_state_dict(_hf_state(config), config, pooling="mean", normalize=True)
    return _bf16_copy(model) if dtype == torch.bfloat16 else model


def _ids(rows: int, cols: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, CONFIG["vocab_size"], (rows, cols), generator=g)
    lens = torch.tensor(lengths)
    ids[torch.arange(cols)[None] >= lens[:, None]] = 0  # padding
    return ids, lens


def _calibration(model: Any) -> np.ndarray:
    ids, lens = _ids(6, 9, [9, 4, 7, 1, 9, 5], seed=1)
    return np.asarray(model(ids, lens).float().numpy())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=1).min())


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_float32_tuned_rows_equal_the_plain_forward(act: str) -> None:
    plain, tuned = _model(act), tune_cpu_forward(_model(act), _calibration, what="tiny")
    assert is_tuned(tuned) and not is_tuned(plain)
    layer = tuned.layers[0]
    assert isinstance(layer.qkv, PackedLinear) and isinstance(layer.ffn_out, PackedLinear)
    assert layer.ffn_in.attr == cpu_forward.FUSED_ACTIVATIONS[act][0]  # the activation rides the GEMM
    assert layer.attend is sdpa_attention  # float32 keeps the fused attention kernel
    with torch.inference_mode():
        for rows, cols, lengths in BATCHES:
            ids, lens = _ids(rows, cols, lengths)
            torch.testing.assert_close(tuned(ids, lens), plain(ids, lens), rtol=0, atol=1e-5)
            torch.testing.assert_close(tuned.token_embeddings(ids, lens), plain.token_embeddings(ids, lens),
                                       rtol=0, atol=1e-4)


@pytest.mark.parametrize("kernels", [True, False], ids=["bf16 kernels", "AVX2 only"])
def test_bfloat16_tuned_rows_stay_with_the_plain_bfloat16_forward(
    kernels: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A CPU with oneDNN's bfloat16 kernels packs the linear layers too; one without (AVX2 only, where
    # packing a bfloat16 weight raises) keeps them plain but still takes the matmul attention.
    if kernels and not cpu_forward.bf16_kernels():
        pytest.skip("packing bfloat16 weights needs oneDNN's bfloat16 kernels, which this CPU lacks")
    monkeypatch.setattr(cpu_forward, "bf16_kernels", lambda: kernels)
    plain = _model(dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        tuned = tune_cpu_forward(_model(dtype=torch.bfloat16), _calibration, what="tiny")
    assert tuned.layers[0].attend is cpu_forward.bf16_cpu_attention
    if kernels:
        assert isinstance(tuned.layers[0].qkv, PackedLinear) and tuned.layers[0].qkv.dtype == torch.bfloat16
    else:
        assert type(tuned.layers[0].qkv) is torch.nn.Linear
        assert "no oneDNN bfloat16 kernels" in caplog.text
        assert "keeps its plain CPU forward" not in caplog.text
    with torch.inference_mode():
        for rows, cols, lengths in BATCHES:  # below and past MATMUL_ATTENTION_MIN_ROWS
            ids, lens = _ids(rows, cols, lengths)
            got, want = tuned(ids, lens), plain(ids, lens)
            assert got.dtype == torch.float32 and torch.isfinite(got).all()
            real = lens > 0  # a fully padded row pools to zero in both
            assert _cos(got[real], want[real]) > 0.999, (rows, cols)


def test_matmul_attention_is_the_fused_kernels_function() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, 7, 8, generator=g) for _ in range(3))
    keep = torch.arange(7)[None] < torch.tensor([7, 3, 1, 5, 0])[:, None]
    bias = torch.zeros(5, 7).masked_fill_(~keep, torch.finfo(torch.float32).min / 2)[:, None, None, :]
    got = cpu_forward.bf16_cpu_attention(q, k, v, bias)  # 5 rows: the matmul path
    torch.testing.assert_close(got, sdpa_attention(q, k, v, bias), rtol=0, atol=1e-5)


def test_bfloat16_attention_stays_bfloat16_with_its_softmax_taken_in_float32() -> None:
    # The products in bfloat16, the scale, mask and softmax of the scores in float32 (faster on the CPU
    # than bfloat16's, and one rounding fewer): the rows stay bfloat16 for the next projection, and a
    # masked key gets no weight.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 12, 20, 32, generator=g) for _ in range(3))
    keep = torch.arange(20)[None] < torch.tensor([20, 15, 9, 1, 20, 4])[:, None]
    bias = torch.zeros(6, 20).masked_fill_(~keep, torch.finfo(torch.float32).min / 2)[:, None, None, :]
    want = sdpa_attention(q, k, v, bias)
    got = cpu_forward.bf16_cpu_attention(*(t.bfloat16() for t in (q, k, v, bias)))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0.03)  # bfloat16's rounding of q, k, v
    v_masked = v.clone()
    v_masked[1, :, 15:] = 1e3  # what only masked keys hold
    moved = cpu_forward.bf16_cpu_attention(*(t.bfloat16() for t in (q, k, v_masked, bias)))
    assert torch.equal(moved[1], got[1])


def test_a_tuned_forward_that_fails_puts_the_plain_one_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(PackedLinear, "forward", broken)
    plain = _model()
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        model = tune_cpu_forward(_model(), _calibration, what="tiny")
    assert not is_tuned(model)
    assert isinstance(model.layers[0].qkv, torch.nn.Linear) and model.layers[0].act_name == "gelu"
    assert "keeps its plain CPU forward" in caplog.text and "could not create a primitive" in caplog.text
    ids, lens = _ids(2, 6, [6, 2])
    with torch.inference_mode():
        assert torch.equal(model(ids, lens), plain(ids, lens))


def test_a_tuned_forward_whose_rows_drift_puts_the_plain_one_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = PackedLinear.forward

    def scrambled(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:  # a wrong weight layout
        out = real(self, x)
        return out.flip(-1)

    monkeypatch.setattr(PackedLinear, "forward", scrambled)
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        model = tune_cpu_forward(_model(), _calibration, what="tiny")
    assert not is_tuned(model)
    assert "moved to cosine" in caplog.text


def test_without_onednn_float32_stays_plain_and_bfloat16_only_changes_attention(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_forward, "packing_unavailable", lambda *_: "this build of torch has no oneDNN")
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        f32 = tune_cpu_forward(_model(), _calibration, what="tiny")
    assert not is_tuned(f32) and "no oneDNN" in caplog.text
    bf16 = tune_cpu_forward(_model(dtype=torch.bfloat16), _calibration, what="tiny")
    assert isinstance(bf16.layers[0].qkv, torch.nn.Linear)
    assert bf16.layers[0].attend is cpu_forward.bf16_cpu_attention


def test_the_packed_weights_replace_the_plain_ones() -> None:
    model = tune_cpu_forward(_model(), _calibration, what="tiny")
    names = set(dict(model.named_parameters()))
    assert not any(n.endswith(("qkv.weight", "ffn_in.weight", "ffn_out.weight", "attn_out.weight"))
                   for n in names)
    assert "layers.0.attn_norm.weight" in names


def _rows_of(model: Any) -> np.ndarray:
    with torch.inference_mode():
        return np.asarray(model(torch.ones(3, 16)).numpy())


def test_generic_packing_keeps_a_model_that_reads_its_weights_plain(caplog: pytest.LogCaptureFixture) -> None:
    # Model code that reads a linear layer's ``.weight`` (as some Hugging Face models do to cast).
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        model = cpu_forward.pack_linear_layers(_Linear(), _rows_of, what="toy")
    assert isinstance(model.layer, torch.nn.Linear) and "keeps its plain CPU forward" in caplog.text


def test_generic_packing_packs_plain_linear_layers_with_the_same_rows() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    want = _rows_of(plain)
    packed = cpu_forward.pack_linear_layers(plain, _rows_of, what="toy")
    assert all(isinstance(packed[i], PackedLinear) for i in (0, 2))
    np.testing.assert_allclose(_rows_of(packed), want, rtol=0, atol=1e-6)
