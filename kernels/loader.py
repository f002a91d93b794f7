"""Load a served model into the right runner. Called off the event loop (it imports torch and reads
weights); the runner it returns is then driven by a ``ModelWorker``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .protocol import Runner
from .st_runner import SentenceTransformerRunner, default_model_path

log = logging.getLogger("coalesce.kernels")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """The execution knobs of ``coalesce serve`` that reach the runner."""

    device: str = "auto"


def load_runner(path: str | None, name: str | None, options: RunnerOptions) -> Runner:
    """A runner for the model at ``path`` (None = the embedded default model)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in service logs
    aliases: Sequence[str] = ()
    if path is None:
        path = default_model_path()
        if name is None:
            aliases = ("sentence-transformers/all-MiniLM-L6-v2",)
    return SentenceTransformerRunner(path, name=name, device=options.device, aliases=aliases)
