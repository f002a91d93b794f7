"""The OpenVINO backend's decisions on plain data: which precision ``--dtype`` and the CPU's capabilities
give (the capabilities are OpenVINO's list, passed in: no test depends on this machine's CPU), where
compiled models are cached, and that asking for OpenVINO where it is missing says how to install it.
No model, no OpenVINO."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from coalesce.kernels.openvino_runner import (
    GuardRecord,
    OpenVinoMissing,
    choose_precision,
    default_cache_dir,
    guard_key,
    load_openvino_runner,
)
from coalesce.kernels.protocol import Task

INTEL_SPR = frozenset({"FP32", "BF16", "FP16", "INT8", "BIN", "EXPORT_IMPORT"})  # AMX: bf16 and fp16
ZEN3 = frozenset({"FP32", "INT8", "BIN", "EXPORT_IMPORT"})  # AVX2 only


def test_auto_runs_bfloat16_only_where_the_cpu_computes_it_natively() -> None:
    assert choose_precision("auto", INTEL_SPR)[0] == "bf16"
    precision, why = choose_precision("auto", ZEN3)
    assert precision == "f32" and "no native bfloat16" in why


def test_dtype_forces_the_precision_unless_the_cpu_lacks_it() -> None:
    assert choose_precision("float32", INTEL_SPR)[0] == "f32"
    assert choose_precision("fp32", INTEL_SPR)[0] == "f32"
    assert choose_precision("bfloat16", INTEL_SPR)[0] == "bf16"
    assert choose_precision("float16", INTEL_SPR)[0] == "f16"
    precision, why = choose_precision("bfloat16", ZEN3)  # emulated bf16 would be slower than f32
    assert precision == "f32" and "does not compute natively" in why
    assert choose_precision("half", ZEN3)[0] == "f32"
    with pytest.raises(ValueError, match="unknown dtype"):
        choose_precision("int4", INTEL_SPR)


def test_compiled_models_are_cached_in_the_export_when_it_is_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export, home = tmp_path / "export", tmp_path / "home"
    export.mkdir()
    assert default_cache_dir(export, home) == export / "openvino_cache"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != export and real_access(p, mode))
    shared = default_cache_dir(export, home)  # a read-only export (an image's): the user's cache
    assert shared == home / ".cache" / "coalesce" / "openvino" and shared.is_dir()
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    assert default_cache_dir(export, home) is None  # nowhere to write: compile at every start


def test_asking_for_openvino_where_it_is_not_installed_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(b"graph")
    from coalesce.kernels.onnx_runner import ExportManifest

    ExportManifest(name="m", task="embed", max_tokens=8, vocab_size=10, dim=4, pad_id=0,
                   inputs=("input_ids",), output="sentence_embedding").write(export)
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino → ImportError
    with pytest.raises(OpenVinoMissing, match=r"pip install 'coalesce\[openvino\]'"):
        load_openvino_runner(str(export), name=None)
    assert isinstance(OpenVinoMissing("x"), ModuleNotFoundError)



def test_the_guard_measures_drift_as_the_worst_row() -> None:
    from coalesce.kernels.openvino_runner import MAX_LOGIT_ERROR, _drift
    from coalesce.kernels.precision import BF16_MIN_COSINE
    from coalesce.kernels.protocol import Task

    rng = np.random.default_rng(0)
    reference = rng.normal(size=(8, 16)).astype(np.float32)
    close = reference + 1e-3 * rng.normal(size=reference.shape).astype(np.float32)
    drift, limit, _ = _drift(close, reference, Task.EMBED)
    assert drift <= limit == pytest.approx(1 - BF16_MIN_COSINE)
    one_row_off = close.copy()
    one_row_off[5] = rng.normal(size=16)  # a single row that drifted fails the model
    assert _drift(one_row_off, reference, Task.EMBED)[0] > limit
    logits = np.array([[4.0, -2.0], [1.0, 0.5]], dtype=np.float32)
    assert _drift(logits + 0.01, logits, Task.CLASSIFY)[0] <= MAX_LOGIT_ERROR  # 0.0025 of the largest
    assert _drift(logits + np.array([[0.0, 0.1]]), logits, Task.CLASSIFY)[0] > MAX_LOGIT_ERROR


def _export_files(root: Path) -> None:
    root.mkdir(exist_ok=True)
    (root / "model.onnx").write_bytes(b"graph")
    (root / "calibration.npy").write_bytes(b"rows")
    (root / "coalesce_export.json").write_text('{"name": "m"}')


def test_the_guard_key_changes_with_whatever_the_measurement_depends_on(tmp_path: Path) -> None:
    export = tmp_path / "export"
    _export_files(export)
    facts = (Task.EMBED, "bf16", "2026.4.1", "Xeon", frozenset({"FP32", "BF16"}))
    key = guard_key(export, *facts)
    assert guard_key(export, *facts) == key  # a restart on the same export, OpenVINO and CPU
    changed = [
        guard_key(export, Task.EMBED, "f16", *facts[2:]),  # another precision
        guard_key(export, *facts[:2], "2026.5.0", *facts[3:]),  # another OpenVINO
        guard_key(export, *facts[:3], "EPYC", facts[4]),  # another CPU
        guard_key(export, *facts[:4], frozenset({"FP32", "BF16", "FP16"})),
    ]
    assert key not in changed
    (export / "model.onnx").write_bytes(b"another graph")  # exported again
    assert guard_key(export, *facts) != key
    key = guard_key(export, *facts)
    (export / "coalesce_export.json").write_text('{"name": "n"}')
    assert guard_key(export, *facts) != key
    key = guard_key(export, *facts)
    (export / "calibration.npy").unlink()
    assert guard_key(export, *facts) != key


def test_the_guard_record_keeps_a_drift_and_reads_nothing_from_a_broken_file(tmp_path: Path) -> None:
    record = GuardRecord(tmp_path / "cache", "k1")
    assert record.read() is None  # never measured
    record.write(2e-5, what="cosine")
    assert record.read() == pytest.approx(2e-5)
    assert GuardRecord(tmp_path / "cache", "k2").read() is None  # another key
    record.path.write_text("{not json")
    assert record.read() is None  # measured again rather than trusted
    record.path.write_text('{"drift": "NaN"}')
    assert record.read() is None
