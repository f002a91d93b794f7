"""The ONNX backend's decisions on plain data: which backend ``auto`` picks, how many threads the
forward gets (cgroup v1 and v2 quotas, affinity, ``OMP_NUM_THREADS``), the manifest, the settings
knob, and the one-line reason ``coalesce export`` prints. No model, no torch, no onnxruntime."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from coalesce.kernels import onnx_runner
from coalesce.kernels.export import _reason
from coalesce.kernels.onnx_runner import (
    ExportManifest,
    cpu_allowance,
    cuda_visible,
    has_exported_graph,
    intra_op_threads,
    resolve_backend,
)
from coalesce.service.settings import build

AFFINITY = len(os.sched_getaffinity(0))


def _manifest(**changes: object) -> ExportManifest:
    values: dict[str, object] = dict(
        name="m", task="embed", max_tokens=256, vocab_size=30522, dim=384, pad_id=0,
        inputs=("input_ids", "attention_mask"), output="sentence_embedding", normalized=True,
    )
    values.update(changes)
    return ExportManifest(**values)  # type: ignore[arg-type]


def _export_dir(root: Path, weights: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.onnx").write_bytes(b"graph")
    _manifest().write(root)
    if weights:
        (root / "model.safetensors").write_bytes(b"weights")
    return root


# -- backend choice ------------------------------------------------------------------------------------
def test_explicit_backends_are_taken_as_asked(tmp_path: Path) -> None:
    assert resolve_backend("torch", str(_export_dir(tmp_path)), "cpu") == "torch"
    assert resolve_backend("onnx", str(tmp_path / "anything"), "cpu") == "onnx"
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("tensorrt", str(tmp_path), "cpu")


def test_auto_needs_an_exported_graph(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert not has_exported_graph(tmp_path)
    assert resolve_backend("auto", str(tmp_path), "cpu") == "torch"
    (tmp_path / "model.onnx").write_bytes(b"a graph someone else exported, without our manifest")
    assert resolve_backend("auto", str(tmp_path), "cpu") == "torch"


def test_auto_serves_an_export_with_onnx_on_cpu_and_torch_weights_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_graph = str(_export_dir(tmp_path / "export"))
    both = str(_export_dir(tmp_path / "both", weights=True))
    monkeypatch.setattr(onnx_runner, "cuda_visible", lambda: False)
    monkeypatch.setattr(onnx_runner, "openvino_installed", lambda: False)
    assert resolve_backend("auto", both, "auto") == "onnx"
    monkeypatch.setattr(onnx_runner, "cuda_visible", lambda: True)
    assert resolve_backend("auto", both, "auto") == "torch"  # GPUs keep torch and CUDA graphs
    assert resolve_backend("auto", both, "cuda:0") == "torch"
    assert resolve_backend("auto", both, "cpu") == "onnx"  # --device cpu says CPU on any host
    assert resolve_backend("auto", only_graph, "auto") == "onnx"  # nothing else could serve it


def test_auto_prefers_openvino_for_an_export_on_cpu_when_it_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_graph = str(_export_dir(tmp_path / "export"))
    both = str(_export_dir(tmp_path / "both", weights=True))
    monkeypatch.setattr(onnx_runner, "openvino_installed", lambda: True)
    monkeypatch.setattr(onnx_runner, "cuda_visible", lambda: False)
    assert resolve_backend("auto", both, "auto") == "openvino"
    assert resolve_backend("auto", both, "cpu") == "openvino"
    assert resolve_backend("onnx", both, "cpu") == "onnx"  # asked for by name: taken as asked
    monkeypatch.setattr(onnx_runner, "cuda_visible", lambda: True)
    assert resolve_backend("auto", both, "auto") == "torch"  # GPUs keep torch
    assert resolve_backend("auto", only_graph, "auto") == "openvino"
    assert resolve_backend("auto", str(tmp_path / "export"), "cpu") == "openvino"


def _torch(tmp_path: Path, version_py: str) -> Path:
    """A torch package folder holding only its ``version.py`` (what ``cuda_visible`` reads)."""
    folder = tmp_path / "torch"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "version.py").write_text(version_py)
    return folder


CUDA_BUILD = "__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\nhip = None\n"
CPU_BUILD = "__version__ = '2.13.0+cpu'\ndebug = False\ncuda: Optional[str] = None\nhip = None\n"


def test_cuda_is_visible_only_with_an_nvidia_driver(tmp_path: Path) -> None:
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    proc.mkdir()
    torch = _torch(tmp_path, CUDA_BUILD)
    (dev / "null").touch()
    assert not cuda_visible(dev, proc, {}, torch)
    (dev / "nvidiactl").touch()  # the control node alone is no device
    assert not cuda_visible(dev, proc, {}, torch)
    (dev / "nvidia0").touch()
    assert cuda_visible(dev, proc, {}, torch)
    (dev / "nvidia0").unlink()
    (proc / "driver" / "nvidia").mkdir(parents=True)
    assert cuda_visible(dev, proc, {}, torch)


def test_cuda_is_not_visible_to_a_cpu_build_of_torch_or_with_every_device_hidden(tmp_path: Path) -> None:
    """Torch would run on the CPU in each case: a CPU build, no torch, CUDA_VISIBLE_DEVICES hiding every
    device. The build is read from torch's version.py (torch not imported), old spelling included."""
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    proc.mkdir()
    (dev / "nvidia0").touch()
    cuda = _torch(tmp_path / "a", CUDA_BUILD)
    assert cuda_visible(dev, proc, {"CUDA_VISIBLE_DEVICES": "0"}, cuda)
    assert not cuda_visible(dev, proc, {"CUDA_VISIBLE_DEVICES": ""}, cuda)
    assert not cuda_visible(dev, proc, {"CUDA_VISIBLE_DEVICES": "-1"}, cuda)
    assert not cuda_visible(dev, proc, {}, _torch(tmp_path / "b", CPU_BUILD))
    assert cuda_visible(dev, proc, {}, _torch(tmp_path / "c", "__version__ = '1.13.1'\ncuda = '11.7'\n"))
    assert not cuda_visible(dev, proc, {}, tmp_path / "no-torch")


# -- threads -------------------------------------------------------------------------------------------
def _cgroup(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(self_cgroup)
    for rel, text in files.items():
        (cgroup / rel).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / rel).write_text(text)
    return proc, cgroup


def test_no_quota_means_the_affinity_mask(tmp_path: Path) -> None:
    proc, cgroup = _cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpu_allowance(proc, cgroup) == AFFINITY


def test_a_cgroup_v2_quota_caps_threads_rounding_down(tmp_path: Path) -> None:
    proc, cgroup = _cgroup(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})
    assert cpu_allowance(proc, cgroup) == 1  # half a CPU still gets one thread
    proc, cgroup = _cgroup(tmp_path / "b", "0::/kubepods/pod1/c1\n", {
        "kubepods/pod1/c1/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "100000 100000\n",  # the pod's limit applies to its containers
        "cpu.max": "max 100000\n",
    })
    assert cpu_allowance(proc, cgroup) == 1


def test_a_cgroup_v1_quota_caps_threads(tmp_path: Path) -> None:
    proc, cgroup = _cgroup(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_allowance(proc, cgroup) == 1
    proc, cgroup = _cgroup(tmp_path / "b", "3:cpu,cpuacct:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_allowance(proc, cgroup) == AFFINITY


def test_a_quota_above_the_affinity_mask_changes_nothing(tmp_path: Path) -> None:
    proc, cgroup = _cgroup(tmp_path, "0::/\n", {"cpu.max": f"{(AFFINITY + 8) * 100000} 100000\n"})
    assert cpu_allowance(proc, cgroup) == AFFINITY


def test_omp_num_threads_wins_when_it_is_a_positive_number() -> None:
    assert intra_op_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert intra_op_threads({"OMP_NUM_THREADS": "0"}) == cpu_allowance()
    assert intra_op_threads({"OMP_NUM_THREADS": "lots"}) == cpu_allowance()
    assert intra_op_threads({}) == cpu_allowance()


# -- manifest, settings, messages ----------------------------------------------------------------------
def test_the_manifest_round_trips_and_refuses_another_format(tmp_path: Path) -> None:
    manifest = _manifest(labels=("a", "b"), activations={"classify": "softmax"}, checks={"fp32": 1.0},
                         quantize="int8", quantization={"method": "static", "format": "QDQ"})
    manifest.write(tmp_path)
    assert ExportManifest.read(tmp_path) == manifest
    text = (tmp_path / "coalesce_export.json").read_text().replace('"version": 1', '"version": 99')
    (tmp_path / "coalesce_export.json").write_text(text)
    with pytest.raises(ValueError, match="run `coalesce export` again"):
        ExportManifest.read(tmp_path)


def test_the_backend_knob_is_validated() -> None:
    assert build([]).backend == "auto"
    assert build(["--backend", "onnx"]).backend == "onnx"
    assert build([], environ={"COALESCE_BACKEND": "torch"}).backend == "torch"
    assert build(["--backend", "openvino"]).backend == "openvino"
    with pytest.raises(SystemExit, match="backend must be auto, torch, onnx or openvino"):
        build(["--backend", "tensorrt"])
    with pytest.raises(SystemExit, match="onnx backend runs on the CPU"):
        build(["--backend", "onnx", "--device", "cuda"])
    with pytest.raises(SystemExit, match="openvino backend runs on the CPU"):
        build(["--backend", "openvino", "--device", "cuda:0"])
    assert build([]).openvino_cache_dir is None
    assert build(["--openvino-cache-dir", "/var/cache/ov"]).openvino_cache_dir == "/var/cache/ov"
    assert build([], environ={"COALESCE_OPENVINO_CACHE_DIR": "/c"}).openvino_cache_dir == "/c"


def test_the_export_reason_is_one_line_naming_the_cause_and_the_code() -> None:
    raw = (
        "Failed to export the model with torch.export. \x1b[96mThis is step 1/3\x1b[0m of exporting.\n\n"
        "## Exception summary\n\n"
        "<class 'torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode'>: "
        "Could not guard on data-dependent expression Eq(u0, 1)\n\nmore help\n"
        'The following call raised this error:\n  File "/m/branchy.py", line 9, in forward\n'
        "    if emb.sum() > 0:\n\n## Another section\n"
    )
    reason = _reason(RuntimeError(raw))
    assert reason == (
        "GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0, 1) "
        "(at /m/branchy.py:9: if emb.sum() > 0:)"
    )
    assert _reason(OSError("no config.json\nsecond line")) == "OSError: no config.json"
