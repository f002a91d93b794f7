"""Estimate the two CPU images' Python payload from installed sizes (no Docker engine needed).

    .venv/bin/python deploy/docker/image_sizes.py [EXPORT_DIR ...]

Adds up, in the environment running it, the files of every distribution each image installs: for
cpu.Dockerfile the closure of pyproject.toml's core dependencies (torch as installed here: use an
environment with the CPU wheel), for cpu-onnx.Dockerfile the closure of deploy/docker/onnx-runtime.txt;
then the exported model directories given. The base image (python:3.12-slim) comes on top of both.
An estimate: the images run Python 3.12, this environment may run another, and pip's own files and
byte-code caches are left out.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def closure(requirements: list[str]) -> dict[str, int]:
    """Bytes on disk of each installed distribution the requirements pull in (extras ignored)."""
    seen: dict[str, int] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        dist = md.distribution(req.name)
        seen[name] = sum(f.locate().stat().st_size for f in dist.files or () if Path(f.locate()).is_file())
        todo += [Requirement(r) for r in dist.requires or ()]
    return seen


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main(argv: list[str]) -> int:
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    runtime = [
        ln.strip() for ln in (HERE / "onnx-runtime.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    images = {"cpu.Dockerfile (torch)": closure(core), "cpu-onnx.Dockerfile (onnx)": closure(runtime)}
    for title, sizes in images.items():
        top = sorted(sizes.items(), key=lambda kv: -kv[1])[:6]
        print(f"{title}: {_mb(sum(sizes.values()))} in {len(sizes)} distributions; largest: "
              + ", ".join(f"{k} {_mb(v)}" for k, v in top))
    for d in argv:
        size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
        print(f"export {d}: {_mb(size)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
