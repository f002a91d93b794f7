"""``--dtype``'s precision on each device (the CPU's bfloat16 flag mocked: the tests do not depend on
this machine's CPU), and the warm-up guard that keeps float32 for a model bfloat16 does not suit."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from coalesce.kernels import precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU

X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile\n"
X86_AMX = "flags\t\t: fpu avx512f amx_bf16 amx_tile avx512_bf16\n"
X86_PLAIN = "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("cpuinfo", "flag"),
    [(X86_BF16, "avx512_bf16"), (X86_AMX, "amx_bf16"), (X86_PLAIN, None), (ARM_BF16, "bf16"), ("", None)],
)
def test_the_bf16_flag_is_read_from_cpuinfo(cpuinfo: str, flag: str | None) -> None:
    assert precision.bf16_flag(cpuinfo) == flag


def _native(monkeypatch: pytest.MonkeyPatch, flag: str | None) -> None:
    monkeypatch.setattr(precision, "native_bf16", lambda: flag)


def test_auto_runs_bfloat16_on_a_cpu_that_has_it_else_float32(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _native(monkeypatch, "amx_bf16")
    assert precision.resolve_dtype("auto", CPU) == torch.bfloat16
    assert precision.resolve_dtype("auto", CPU, cpu_auto_bf16=False) == torch.float32  # LLM rerankers
    _native(monkeypatch, None)
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        assert precision.resolve_dtype("auto", CPU) == torch.float32
    assert "no native bfloat16" in caplog.text


def test_forced_dtypes_on_the_cpu(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _native(monkeypatch, "avx512_bf16")
    assert precision.resolve_dtype("float32", CPU) == torch.float32
    assert precision.resolve_dtype("fp32", CPU) == torch.float32
    _native(monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        assert precision.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert "emulated" in caplog.text
    assert precision.resolve_dtype("float16", CPU) == torch.float32  # float16 is for CUDA
    with pytest.raises(ValueError, match="unknown dtype"):
        precision.resolve_dtype("int4", CPU)


def test_cuda_is_unchanged_whatever_the_cpu_has(monkeypatch: pytest.MonkeyPatch) -> None:
    _native(monkeypatch, "amx_bf16")
    assert precision.resolve_dtype("auto", CUDA) == torch.float16
    assert precision.resolve_dtype("bfloat16", CUDA) == torch.bfloat16
    assert precision.resolve_dtype("float32", CUDA) == torch.float32


class _Linear(torch.nn.Module):
    """Rows a bfloat16 copy reproduces to about 3 significant digits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.layer(x.to(self.layer.weight.dtype)))


class _Cancelling(torch.nn.Module):
    """A difference of two close large weights: 1001 − 1000 = 1 in float32, 0 in bfloat16 (8 bits of
    mantissa: both round to 1000), so the row's direction changes completely."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.tensor([1001.0, 1000.0]))
        self.small = torch.nn.Parameter(torch.tensor([0.01]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = torch.stack([self.big[0] - self.big[1], self.small[0]])
        return row.expand(x.shape[0], 2)


def _rows(model: torch.nn.Module) -> np.ndarray:
    return model(torch.linspace(-1, 1, 64).reshape(4, 16)).float().detach().numpy()


def test_the_guard_keeps_bfloat16_for_a_model_it_suits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _native(monkeypatch, "avx512_bf16")
    model = _Linear()
    with caplog.at_level(logging.INFO, logger="coalesce.kernels"):
        placed = precision.to_precision(model, "auto", CPU, _rows, what="linear")
    assert placed.layer.weight.dtype == torch.bfloat16
    assert model.layer.weight.dtype == torch.float32  # the float32 model is left as it was
    assert "linear runs bfloat16 on the CPU (native: avx512_bf16)" in caplog.text
    assert precision.min_cosine(_rows(placed), _rows(model)) >= precision.BF16_MIN_COSINE


def test_the_guard_falls_back_to_float32_for_a_model_that_drifts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _native(monkeypatch, "amx_bf16")
    model = _Cancelling()
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        placed = precision.to_precision(model, "auto", CPU, _rows, what="cancelling")
    assert placed is model and placed.big.dtype == torch.float32
    assert "cancelling stays float32" in caplog.text
    np.testing.assert_allclose(_rows(placed)[0], [1.0, 0.01], rtol=1e-6)


def test_float32_asked_or_detected_runs_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def embed(model: torch.nn.Module) -> np.ndarray:
        calls.append(model)
        return _rows(model)

    _native(monkeypatch, "amx_bf16")
    forced = precision.to_precision(_Linear(), "float32", CPU, embed, what="x")
    _native(monkeypatch, None)
    detected = precision.to_precision(_Linear(), "auto", CPU, embed, what="x")
    assert forced.layer.weight.dtype == detected.layer.weight.dtype == torch.float32
    assert calls == []


def test_min_cosine() -> None:
    a = np.array([[1.0, 0.0], [0.0, 0.0]])
    assert precision.min_cosine(a, a) == pytest.approx(1.0)
    assert precision.min_cosine(a, np.array([[0.0, 1.0], [0.0, 0.0]])) == pytest.approx(0.0)
    assert precision.min_cosine(np.array([[0.0, 0.0]]), np.array([[1.0, 0.0]])) == 0.0


def test_the_bfloat16_copy_keeps_integer_buffers_and_leaves_the_original_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _native(monkeypatch, "amx_bf16")
    model = _Linear()
    model.register_buffer("positions", torch.arange(4))
    model.register_buffer("bias_table", torch.linspace(0, 1, 4))
    placed = precision.to_precision(model, "auto", CPU, _rows, what="linear")
    assert placed.positions.dtype == torch.int64 and placed.bias_table.dtype == torch.bfloat16
    assert model.bias_table.dtype == torch.float32 and model.layer.weight.dtype == torch.float32
    assert placed.layer.weight.data_ptr() != model.layer.weight.data_ptr()
