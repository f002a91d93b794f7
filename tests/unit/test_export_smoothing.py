"""SmoothQuant before int8 export (``export._smooth``), on a small hand-built graph with the shape that
matters: a normalisation whose output feeds two weight MatMuls (attention's projections) and a residual
Add. Smoothing must leave the float graph's output unchanged, balance the channels the quantiser gives
one scale, and leave the residual reading the normalisation itself. No model, no torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from coalesce.kernels.export import _channel_peaks, _smooth  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

WIDTH = 8
OUTLIER = 3  # the channel a real BERT's normalised hidden state has tens of times larger than the rest


def _graph(path: Path) -> None:
    rng = np.random.default_rng(0)
    gamma = np.ones(WIDTH, dtype=np.float32)
    gamma[OUTLIER] = 40.0
    inits = [
        numpy_helper.from_array(gamma, "gamma"),
        numpy_helper.from_array(np.zeros(WIDTH, dtype=np.float32), "beta"),
        numpy_helper.from_array(rng.normal(size=(WIDTH, WIDTH)).astype(np.float32), "w_query"),
        numpy_helper.from_array(rng.normal(size=(WIDTH, WIDTH)).astype(np.float32), "w_value"),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln", axis=-1),
        helper.make_node("MatMul", ["ln", "w_query"], ["q"], name="query"),
        helper.make_node("MatMul", ["ln", "w_value"], ["v"], name="value"),
        helper.make_node("Add", ["q", "v"], ["qv"], name="mix"),
        helper.make_node("Add", ["qv", "ln"], ["y"], name="residual"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", WIDTH])], inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _feeds() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(2, 5, WIDTH)).astype(np.float32)} for _ in range(3)]


def _run(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    out: np.ndarray = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    return out


def test_smoothing_keeps_the_float_output_and_balances_the_quantised_input(tmp_path: Path) -> None:
    fp32, smoothed = tmp_path / "fp32.onnx", tmp_path / "smoothed.onnx"
    _graph(fp32)
    feeds = _feeds()
    assert _smooth(fp32, smoothed, {"query", "value"}, feeds) == 1  # one input, read by both
    for feed in feeds:
        np.testing.assert_allclose(_run(smoothed, feed), _run(fp32, feed), rtol=1e-5, atol=1e-4)
    model = onnx.load(str(smoothed))
    reads = {n.name: n.input[0] for n in model.graph.node}
    assert reads["query"] == reads["value"] != "ln"  # both projections read the divided input
    residual = next(n for n in model.graph.node if n.name == "residual")
    assert list(residual.input) == ["qv", "ln"]  # the residual still adds the undivided hidden state
    before = _channel_peaks(onnx.load(str(fp32)), ["ln"], feeds)["ln"]
    after = _channel_peaks(model, [reads["query"]], feeds)[reads["query"]]
    assert before.max() / np.median(before) > 10  # the outlier channel dominates one per-tensor scale
    assert after.max() / np.median(after) < before.max() / np.median(before) / 3


def test_only_the_chosen_matmuls_are_smoothed(tmp_path: Path) -> None:
    fp32, smoothed = tmp_path / "fp32.onnx", tmp_path / "smoothed.onnx"
    _graph(fp32)
    assert _smooth(fp32, smoothed, set(), _feeds()) == 0
    reads = {n.name: n.input[0] for n in onnx.load(str(smoothed)).graph.node}
    assert reads["query"] == reads["value"] == "ln"
