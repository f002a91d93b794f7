"""The install layout: our folders never shadow other packages, and the console script works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_transformers_and_sentence_transformers_import_from_the_repository_root() -> None:
    # From the root, `kernels/` is importable as a top-level name, and transformers probes for a
    # package called `kernels` while it starts. Ours must stay harmless to that probe.
    code = (
        "import sentence_transformers, transformers\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert not is_kernels_available()\n"
        "import coalesce.kernels.st_runner, coalesce.service.gateway.app\n"
        "print('ok')\n"
    )
    for cwd in (ROOT, ROOT / "kernels"):
        result = run(code, cwd)
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
