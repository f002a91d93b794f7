"""int8/uint8 output: one symmetric scale from the calibration rows (zero stays zero, uint8 = int8 + 128),
stored beside an export's rows; binary types unchanged."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from coalesce.kernels.calibration import FILE, INT8_PERCENTILE, int8_scale, stored_int8_scale
from coalesce.service.gateway.quantize import quantize


def test_int8_is_symmetric_and_zero_stays_zero() -> None:
    rows = np.array([[0.0, 0.05, -0.05, 0.1, -0.1, 0.3, -0.3]], dtype=np.float32)
    q = quantize(rows, "int8", 0.1 / 127)
    assert q.dtype == np.int8
    assert q.tolist() == [[0, 64, -64, 127, -127, 127, -127]]  # ±0.3 is past the scale: clipped
    np.testing.assert_array_equal(quantize(-rows, "int8", 0.1 / 127), -q)


def test_uint8_is_int8_shifted_by_128() -> None:
    rows = np.random.default_rng(0).normal(0, 0.05, (5, 32)).astype(np.float32)
    scale = int8_scale(rows)
    u = quantize(rows, "uint8", scale)
    assert u.dtype == np.uint8 and u.min() >= 1
    np.testing.assert_array_equal(u.astype(int) - 128, quantize(rows, "int8", scale).astype(int))
    assert quantize(np.zeros((1, 4)), "uint8", scale).tolist() == [[128] * 4]


def test_an_integer_dot_product_is_the_float_one_over_scale_squared() -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(0, 0.05, (64, 48)).astype(np.float32)
    scale = int8_scale(rows)
    q = quantize(rows, "int8", scale).astype(np.int64)
    np.testing.assert_allclose((q @ q.T) * scale**2, rows @ rows.T, atol=0.01)


def test_the_scale_is_a_high_percentile_of_the_calibration_rows() -> None:
    rows = np.random.default_rng(2).normal(0, 0.05, (96, 384)).astype(np.float32)
    rows[0, 0] = 5.0  # one outlier does not spread the steps
    scale = int8_scale(rows)
    assert scale * 127 == pytest.approx(np.percentile(np.abs(rows), INT8_PERCENTILE), rel=1e-6)
    assert scale * 127 < 0.5
    assert int8_scale(np.zeros((4, 8))) == 1.0


def test_int8_needs_a_positive_scale() -> None:
    for bad in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="scale"):
            quantize(np.zeros((1, 4)), "int8", bad)


def test_binary_types_are_the_sign_bits() -> None:
    rows = np.array([[0.5, -0.5, 0.0, 1.0, -1.0, 0.2, 0.3, -0.1]], dtype=np.float32)
    assert quantize(rows, "ubinary").tolist() == [[0b10010110]]
    assert quantize(rows, "binary").tolist() == [[0b10010110 - 128]]


def test_an_export_stores_the_scale_of_its_rows_and_old_manifests_still_read(tmp_path: Path) -> None:
    from coalesce.kernels.onnx_runner import MANIFEST_FILE, ExportManifest

    assert stored_int8_scale(tmp_path) == 0.0  # no rows stored: none
    rows = np.random.default_rng(3).normal(0, 0.05, (96, 16)).astype(np.float32)
    np.save(tmp_path / FILE, rows, allow_pickle=False)
    assert stored_int8_scale(tmp_path) == int8_scale(rows)
    manifest = ExportManifest(name="m", task="embed", max_tokens=8, vocab_size=10, dim=16, pad_id=0,
                              inputs=("input_ids",), output="sentence_embedding",
                              int8_scale=stored_int8_scale(tmp_path))
    manifest.write(tmp_path)
    assert ExportManifest.read(tmp_path).int8_scale == int8_scale(rows)
    old = asdict(manifest)
    del old["int8_scale"]  # an export written before the field existed
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(old))
    assert ExportManifest.read(tmp_path).int8_scale == 0.0
