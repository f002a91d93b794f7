"""Load a served model into the right runner. Called off the event loop (it imports torch and reads
weights); the runner it returns is then driven by a ``ModelWorker``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .hf_runners import SequenceClassifierRunner, detect_task
from .protocol import Runner, Task
from .st_runner import SentenceTransformerRunner, default_model_path

log = logging.getLogger("coalesce.kernels")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """The execution knobs of ``coalesce serve`` that reach the runner."""

    device: str = "auto"


def load_runner(
    path: str | None, name: str | None, options: RunnerOptions, task: str | None = None
) -> Runner:
    """A runner for the model at ``path`` (None = the embedded default model).

    The task (embed, classify, rerank) is detected from the model directory unless ``task`` (the
    ``--task`` override) names it; classifiers and cross-encoders get ``SequenceClassifierRunner``.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in service logs
    aliases: Sequence[str] = ()
    if path is None:
        path = default_model_path()
        if name is None:
            aliases = ("sentence-transformers/all-MiniLM-L6-v2",)
    chosen = Task(task) if task else detect_task(path)
    if chosen is not Task.EMBED:
        return SequenceClassifierRunner(path, name=name, task=chosen, device=options.device, aliases=aliases)
    return SentenceTransformerRunner(path, name=name, device=options.device, aliases=aliases)
