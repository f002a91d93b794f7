"""The ``imagesize`` bench section: the torch-free image's installed Python packages with and without
OpenVINO, measured without a Docker engine (run only when named: it downloads packages).

The image (``deploy/docker/cpu-onnx.Dockerfile``) installs ``deploy/docker/onnx-runtime.txt`` into a
fresh virtual environment and then deletes what OpenVINO's CPU plugin never loads with
``deploy/docker/prune-openvino.sh``. Here each variant is installed with ``pip install --target`` into an
empty folder, for the image's Python (:data:`PYTHON_VERSION`, binary wheels only, this machine's
platform): the list without its ``openvino`` line, and the whole list, before and after that same
script. Sizes are the bytes of every file in the folder, with the byte-code pip compiles as in the image
(though compiled by the Python running the bench); the project's own wheel and the exported model, the
same in both variants, are left out, as is the base image.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from coalesce.loadtests.report import markdown_table
from packaging.requirements import Requirement

DOCKER = Path(__file__).resolve().parents[1] / "deploy" / "docker"
RUNTIME_LIST = DOCKER / "onnx-runtime.txt"
PRUNE = DOCKER / "prune-openvino.sh"
DOCKERFILE = DOCKER / "cpu-onnx.Dockerfile"
PYTHON_VERSION = "3.12"  # the image's base: python:3.12-slim-bookworm
OPTIONAL = "openvino"  # the runtime the image may carry or not


def runtime_requirements(with_openvino: bool, text: str | None = None) -> list[str]:
    """The runtime list's requirements, with or without its :data:`OPTIONAL` line."""
    lines = (RUNTIME_LIST.read_text(encoding="utf-8") if text is None else text).splitlines()
    reqs = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [r for r in reqs if with_openvino or Requirement(r).name.lower() != OPTIONAL]


def tree_bytes(folder: Path) -> int:
    """Bytes of every regular file under ``folder`` (links not followed)."""
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def distributions(folder: Path) -> int:
    return sum(1 for _ in folder.glob("*.dist-info"))


def install(requirements: list[str], target: Path) -> None:
    """``pip install --target`` for the image's Python: what its ``pip install -r`` would put there."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target",
         str(target), "--python-version", PYTHON_VERSION, "--only-binary=:all:", *requirements],
        check=True, timeout=1800,
    )


def prune(target: Path) -> None:
    """The image's pruning (``prune-openvino.sh``), on ``target`` as the Dockerfile runs it."""
    subprocess.run(["sh", str(PRUNE), str(target)], check=True, timeout=120)


def imagesize(args: argparse.Namespace) -> tuple[str, str]:
    rows: list[list[str]] = []
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="coalesce-imagesize-") as tmp:
        without, with_ov = Path(tmp) / "without", Path(tmp) / "with"
        install(runtime_requirements(False), without)
        sizes["without"] = tree_bytes(without)
        rows.append(["without OpenVINO", str(distributions(without)), _mb(sizes["without"]), "-"])
        install(runtime_requirements(True), with_ov)
        sizes["whole"] = tree_bytes(with_ov)
        openvino_whole = tree_bytes(with_ov / "openvino")
        prune(with_ov)
        sizes["pruned"] = tree_bytes(with_ov)
        openvino_pruned = tree_bytes(with_ov / "openvino")
        n = str(distributions(with_ov))
        rows.append(["with OpenVINO, as installed", n, _mb(sizes["whole"]), _mb(openvino_whole)])
        rows.append(["with OpenVINO, pruned as the image does (the image's figure)", n, _mb(sizes["pruned"]),
                     _mb(openvino_pruned)])
    added = sizes["pruned"] - sizes["without"]
    ratio = sizes["pruned"] / sizes["without"]
    figures = [
        ["installed packages, without → with OpenVINO (pruned)", "-",
         f"{_mb(sizes['without'])} → {_mb(sizes['pruned'])} (+{_mb(added)})", ""],
        ["with ÷ without OpenVINO", "-", f"{ratio:.2f}×", ""],
        ["what the pruning removes", "-", _mb(sizes["whole"] - sizes["pruned"]), ""],
    ]
    body = (
        f"`{RUNTIME_LIST.relative_to(DOCKER.parents[1])}` installed with `pip install --target` into an "
        f"empty folder for Python {PYTHON_VERSION} (the image's; binary wheels, this machine's platform), "
        f"without its `{OPTIONAL}` line and whole; the whole install then pruned by "
        f"`{PRUNE.relative_to(DOCKER.parents[1])}`, the script the Dockerfile runs. Size: every file's "
        f"bytes (MB = 10⁶ bytes), with the byte-code pip compiles (here by Python "
        f"{sys.version_info.major}.{sys.version_info.minor}); the project's wheel, the exported model and "
        "the base image, the same both ways, are not counted.\n\n"
        + markdown_table(["runtime packages", "distributions", "installed", "of which openvino"], rows)
        + "\n\n" + markdown_table(["figure", "target", "measured", ""], figures) + "\n"
    )
    return "The torch-free image's packages with and without OpenVINO (installed size)", body


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
