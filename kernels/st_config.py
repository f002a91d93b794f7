"""A sentence-transformers model's prompts, read from its directory's JSON files alone (no torch).

``config_sentence_transformers.json`` may hold ``prompts`` (name → text put in front of a text before
tokenising, e.g. ``{"query": "query: ", "passage": "passage: "}``) and ``default_prompt_name``; the
Pooling module's ``config.json`` may set ``include_prompt: false`` (instructor-style models), in which
case the prompt's tokens are left out of pooling. Every runner reports these in its ``ModelInfo``, so a
gateway applies prompts exactly as ``SentenceTransformer.encode(prompt_name=...)`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class PromptConfig:
    """A model's prompts as its files declare them."""

    prompts: dict[str, str] = field(default_factory=dict)
    default_name: str | None = None
    include_prompt: bool = True  # False: pooling leaves the prompt's tokens out


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_prompt_config(model_dir: str | Path) -> PromptConfig:
    """The prompts of the sentence-transformers directory ``model_dir`` (empty for other layouts)."""
    root = Path(model_dir)
    config = _read(root / "config_sentence_transformers.json")
    raw = config.get("prompts")
    prompts = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
    default = config.get("default_prompt_name")
    include = True
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        modules = []
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            pooling = _read(root / str(module.get("path") or "") / "config.json")
            include = bool(pooling.get("include_prompt", True))
    return PromptConfig(prompts, str(default) if default in prompts else None, include)


def prompt_fields(model_dir: str | Path) -> dict[str, Any]:
    """The ``ModelInfo`` fields of the prompts of ``model_dir``."""
    config = read_prompt_config(model_dir)
    return {"prompts": config.prompts, "default_prompt_name": config.default_name,
            "include_prompt": config.include_prompt}
