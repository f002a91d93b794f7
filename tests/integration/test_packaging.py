"""The install layout: our folders never shadow other packages, and the console script works."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(code: str, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (pythonpath, env.get("PYTHONPATH"))))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_transformers_and_sentence_transformers_import_from_the_repository_root() -> None:
    # From the root (python -c, python -m), the working directory comes first on sys.path, and
    # transformers probes for a package called `kernels` while it starts (5.25 and later depend on the
    # hub's `kernels` and import it). Our `kernels/` must never answer that probe as a package.
    code = (
        "import sentence_transformers, transformers\n"
        "import importlib.util\n"
        "spec = importlib.util.find_spec('kernels')\n"
        f"assert spec is None or not (spec.origin or '').startswith({str(ROOT / 'kernels')!r}), spec\n"
        "import coalesce.kernels.st_runner, coalesce.service.gateway.app\n"
        "print('ok')\n"
    )
    with ThreadPoolExecutor(2) as pool:  # (both at once: each is seconds of imports on one core)
        results = list(pool.map(lambda cwd: run(code, cwd), (ROOT, ROOT / "kernels")))
    for result in results:
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "ok"


def test_an_installed_kernels_package_wins_over_the_repository_root(tmp_path: Path) -> None:
    # The hub's `kernels` (a dependency of transformers 5.25 and later) installed anywhere on the path
    # must be the `kernels` a process started from the root imports: ours is a namespace portion (no
    # __init__.py), which any regular package outranks, so `from kernels import X` finds X.
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    code = (
        "from kernels import CUDAProperties\n"
        "assert CUDAProperties == 'hub'\n"
        "import coalesce.kernels.protocol\n"
        "print('ok')\n"
    )
    result = run(code, ROOT, pythonpath=str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_gateway_does_not_import_torch() -> None:
    code = "import sys, coalesce.service.gateway.app\nassert 'torch' not in sys.modules\nprint('ok')"
    result = run(code, ROOT / "tests")
    assert result.returncode == 0, result.stderr[-2000:]


def test_console_script_lists_subcommands_and_knobs() -> None:
    top = subprocess.run([str(BIN / "coalesce"), "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0
    assert "serve" in top.stdout and "loadtest" in top.stdout
    serve = subprocess.run(
        [str(BIN / "coalesce"), "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert serve.returncode == 0
    for flag in (
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--max-batch-size",
        "--max-batch-tokens",
        "--device",
        "--no-truncate",
    ):
        assert flag in serve.stdout


def test_default_model_loads_without_transformers() -> None:
    # The cold-start path: the embedded model is read straight from safetensors and tokenizer.json.
    code = (
        "import sys\n"
        "from coalesce.kernels.loader import RunnerOptions, load_runner\n"
        "runner = load_runner(None, None, RunnerOptions(device='cpu'))\n"
        "assert type(runner).__name__ == 'EncoderRunner', type(runner)\n"
        "assert runner.info.name == 'all-MiniLM-L6-v2' and runner.info.dim == 384\n"
        "assert 'transformers' not in sys.modules and 'sentence_transformers' not in sys.modules\n"
        "print('ok')\n"
    )
    result = run(code, ROOT / "tests")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_the_packaged_model_is_detected_as_an_embedding_model(minilm_path: str) -> None:
    from coalesce.kernels.hf_runners import detect_task
    from coalesce.kernels.protocol import Task

    assert detect_task(minilm_path) is Task.EMBED
