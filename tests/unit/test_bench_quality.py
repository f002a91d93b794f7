"""The quality bench section's arithmetic and corpus, without servers."""

from __future__ import annotations

import numpy as np
from coalesce.loadtests.bench_quality import MIN_WORDS, OUTPUTS, Vectors, backend_specs, compare, corpus


def test_the_corpus_is_real_paragraphs_in_a_fixed_order() -> None:
    texts = corpus()
    assert len(texts) > 1000 and len(set(texts)) == len(texts)
    assert all(len(t.split()) >= MIN_WORDS for t in texts)
    assert corpus(50) == texts[:50]
    assert any("exception" in t for t in texts)  # Python's reference manual, not generated words


def _vectors(floats: np.ndarray, scale: float) -> Vectors:
    int8 = np.clip(np.rint(floats / scale), -127, 127)
    ubinary = np.packbits(floats > 0, axis=1).astype(np.float64)
    return Vectors(floats, int8, int8 + 128, ubinary)


def test_compare_scores_each_output_against_the_reference() -> None:
    rng = np.random.default_rng(0)
    floats = rng.normal(size=(60, 64))
    floats /= np.linalg.norm(floats, axis=1, keepdims=True)
    scores = compare(_vectors(floats, float(np.abs(floats).max()) / 127), floats)
    assert set(scores) == set(OUTPUTS)
    assert scores["float"] == (1.0, 1.0)
    assert scores["int8"][0] >= 0.9 and scores["int8"][1] > 0.999
    assert scores["binary"][0] < scores["int8"][0]
    # Raw uint8 products are biased by each vector's sum: they rank worse than int8's.
    assert scores["uint8"][0] < scores["int8"][0]
    noise = compare(_vectors(rng.normal(size=(60, 64)), 0.02), floats)
    assert noise["float"][0] < 0.5 and abs(noise["float"][1]) < 0.2


def test_binary_rows_are_plus_minus_one_per_bit() -> None:
    v = _vectors(np.array([[0.5, -0.5, 0.1, -0.1, 0.2, 0.3, -0.3, 0.0]]), 0.01)
    assert v.rows("binary").tolist() == [[1, -1, 1, -1, 1, 1, -1, -1]]


def test_the_float32_reference_comes_first_and_openvino_has_its_rows() -> None:
    specs = backend_specs()
    assert specs[0].label == "torch float32" and "float32" in specs[0].flags
    assert {s.export for s in specs} >= {None, "fp32", "int8"}
    assert any("openvino" in s.flags for s in specs)
