"""What ``coalesce serve`` imports on its main thread before its first request, which a cold start waits
for: not rich (structlog imports it for pretty tracebacks this configuration never uses), not the package
metadata (read at the first /openapi.json or /info), not a model runtime or torch (the preload thread
imports the runtime it needs: ``engine/preload.py``)."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest
import structlog
from coalesce.service import logs


def test_structlog_comes_without_rich_and_console_tracebacks_are_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved_config, saved_handlers = structlog.get_config(), logging.getLogger().handlers[:]
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    try:
        logs.configure("info", "console")
        try:
            raise ValueError("boom")
        except ValueError:
            logs.get_logger("t").exception("failed")
    finally:
        structlog.configure(**saved_config)
        logging.getLogger().handlers[:] = saved_handlers
    out = stderr.getvalue()
    assert "Traceback (most recent call last)" in out and "ValueError: boom" in out
    assert "╭" not in out  # rich's boxes


_STARTUP_IMPORTS = """
import json, sys
import aiohttp.web, msgspec, numpy, prometheus_client  # third parties first: what they import is theirs
third_party = set(sys.modules)
import coalesce.service.logs, coalesce.service.engine.preload, coalesce.service.gateway.server
import importlib.util
print(json.dumps({
    "rich": "rich" in sys.modules, "rich_installed": importlib.util.find_spec("rich") is not None,
    "metadata_by_us": "importlib.metadata" in sys.modules and "importlib.metadata" not in third_party,
    "runtimes": sorted(m for m in ("openvino", "onnxruntime", "torch", "transformers", "tokenizers")
                       if m in sys.modules),
}))
"""


def test_a_start_imports_no_rich_no_package_metadata_and_no_runtime_before_its_first_request() -> None:
    """What ``coalesce serve`` imports on its main thread (the preload thread imports the runtime)."""
    out = subprocess.run([sys.executable, "-c", _STARTUP_IMPORTS], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert not found["metadata_by_us"]
    assert found["runtimes"] == []
    assert not found["rich"]
