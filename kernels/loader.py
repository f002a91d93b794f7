"""Load a served model into the right runner. Called off the event loop (it imports torch and reads
weights); the runner it returns is then driven by a ``ModelWorker``.

For embedding models the fastest applicable path wins:

1. ``fastload`` — BERT-family sentence-transformers directories, read straight from safetensors and
   ``tokenizer.json`` without importing ``transformers`` (about 5 s less cold start on 2 cores);
2. ``encoder_runner`` — the same graph-safe forward, built through sentence-transformers (layouts the
   fast reader declines but the forward reproduces);
3. ``st_runner`` — any sentence-transformers model, eagerly.

Classifiers and cross-encoders get ``SequenceClassifierRunner``; LLM rerankers (a causal LM served as a
reranker, or its converted "seq-cls" variant; see ``rerank_template``) get ``LlmRerankRunner``. A
directory written by ``coalesce export`` is served by ``onnx_runner.OnnxRunner`` instead when
``--backend`` resolves to onnx, or by ``openvino_runner.OpenVinoRunner`` when it resolves to openvino
(before anything imports torch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .buckets import GraphOptions
from .hf_runners import SequenceClassifierRunner, detect_task
from .llm_rerank import LlmRerankRunner
from .onnx_runner import onnx_runner_for
from .protocol import Runner, Task
from .rerank_template import llm_reranker_template
from .st_runner import SentenceTransformerRunner, SparseEncoderRunner, default_model_path

log = logging.getLogger("coalesce.kernels")


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """The execution knobs of ``coalesce serve`` that reach the runner."""

    device: str = "auto"
    dtype: str = "auto"
    graphs: GraphOptions = GraphOptions()  # noqa: RUF009 (frozen, so one shared default is safe)
    backend: str = "auto"  # torch, onnx, openvino, or auto (see onnx_runner.resolve_backend)
    openvino_cache_dir: str | None = None  # None: openvino_runner.default_cache_dir
    cpu_fast_forward: bool = True  # CPU embedding forwards tuned by cpu_forward
    cpu_traced_forward: bool = True  # the graph-safe CPU forward traced (traced_forward)
    # --cpu-kernel-cache (the serve default lives in the settings): shapes OpenVINO's CPU plugin keeps
    # prepared, 0 = its own default. oneDNN's caches under torch take the same bound from the environment,
    # set before torch starts (service/allocator).
    cpu_kernel_cache: int = 0


def load_runner(
    path: str | None, name: str | None, options: RunnerOptions, task: str | None = None,
    rerank_template: str | None = None,
) -> Runner:
    """A runner for the model at ``path`` (None = the embedded default model).

    The task (embed, classify, rerank) is detected from the model directory unless ``task`` (the
    ``--task`` override) names it. ``rerank_template``: an LLM reranker's template file
    (``--rerank-template``), which wins over the directory's own.
    """
    aliases: Sequence[str] = ()
    if path is None:
        path = default_model_path()
        if name is None:
            aliases = ("sentence-transformers/all-MiniLM-L6-v2",)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    onnx = onnx_runner_for(
        path, name=name, task=task, aliases=aliases, backend=options.backend, device=options.device,
        dtype=options.dtype, openvino_cache_dir=options.openvino_cache_dir,
        kernel_cache=options.cpu_kernel_cache,
    )
    if onnx is not None:
        return onnx
    chosen = Task(task) if task else detect_task(path)
    if chosen is Task.EMBED:
        from .fastload import build_fast_encoder_runner

        fast = build_fast_encoder_runner(
            path, name=name, device=options.device, dtype=options.dtype, graphs=options.graphs,
            aliases=aliases, cpu_fast_forward=options.cpu_fast_forward,
            cpu_traced_forward=options.cpu_traced_forward,
        )
        if fast is not None:
            return fast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in service logs
    if chosen is Task.SPARSE:
        return SparseEncoderRunner(path, name=name, device=options.device, aliases=aliases)
    if chosen is Task.RERANK and (template := llm_reranker_template(path, rerank_template)) is not None:
        return LlmRerankRunner(
            path, name=name, template=template, device=options.device, dtype=options.dtype, aliases=aliases
        )
    if chosen is not Task.EMBED:
        return SequenceClassifierRunner(path, name=name, task=chosen, device=options.device, aliases=aliases)
    from .encoder_runner import build_encoder_runner

    graph_runner = build_encoder_runner(
        path, name=name, device=options.device, dtype=options.dtype, graphs=options.graphs, aliases=aliases,
        cpu_fast_forward=options.cpu_fast_forward, cpu_traced_forward=options.cpu_traced_forward,
    )
    if graph_runner is not None:
        return graph_runner
    return SentenceTransformerRunner(
        path, name=name, device=options.device, dtype=options.dtype, aliases=aliases,
        cpu_fast_forward=options.cpu_fast_forward,
    )
