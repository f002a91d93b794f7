"""The torch side of ``coalesce export``: what to trace for each task, and what the manifest says.

* embedding models (sentence-transformers layout): the whole module pipeline, so pooling, any Dense
  layer and normalisation run inside the graph; width, max length and normalisation come from the
  loaded ``SentenceTransformer``, and the tokenizer is its Transformer's, with ``do_lower_case``;
* classifiers and cross-encoders: the model the torch runner (``SequenceClassifierRunner``) builds,
  logits out, with ``token_type_ids`` when the model uses segments; labels and activations from it.

Each source also carries the torch model's answer on a fixed set of probe inputs (mixed lengths,
padding, truncation, pairs), which the exported graph must reproduce.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .onnx_runner import ExportManifest
from .protocol import Task
from .tokens import TokenizerAdapter

_LONG = " ".join(["river", "house", "green", "tree"] * 300)  # past every model's maximum
PROBE_TEXTS = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée at the CAFÉ, naïve façade — 你好世界 🚀",
    _LONG,
    "a b c",
)
PROBE_PAIRS = (
    ("how do plants make oxygen", "Photosynthesis splits water and releases oxygen."),
    ("hello", "a b c"),
    ("what is a printing press", _LONG),
)


@dataclass(frozen=True, slots=True)
class ExportSource:
    """The torch side of an export: the module to trace, and what the manifest says about it."""

    module: Any  # torch.nn.Module taking the graph inputs as keyword arguments
    inputs: tuple[str, ...]
    output: str
    tokens: TokenizerAdapter
    manifest: ExportManifest  # name, task and facts; checks and quantize are filled in later
    transformer_dir: Path  # where config.json and the tokenizer files live
    reference: Callable[[], np.ndarray]  # the torch model's rows for the probes
    probe: Callable[[Any], np.ndarray]  # a runner's rows for the same probes


def embedding_source(path: str, name: str, aliases: tuple[str, ...], trust_remote_code: bool) -> ExportSource:
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    st = SentenceTransformer(
        path, device="cpu", local_files_only=True, trust_remote_code=trust_remote_code
    ).eval()
    transformer = st[0]
    hf_model: Any = getattr(transformer, "auto_model", None)
    hf_tok: Any = getattr(transformer, "tokenizer", None)
    if hf_model is None or getattr(hf_tok, "backend_tokenizer", None) is None:
        raise ValueError("its first module is not a Transformer with a fast tokenizer")
    root = Path(path)
    tdir = root / (st_modules(root)[0].get("path") or "") if (root / "modules.json").is_file() else root
    positions = int(getattr(hf_model.config, "max_position_embeddings", 0) or 0) or 1 << 20
    max_tokens = min(int(st.max_seq_length or hf_tok.model_max_length), positions)
    rows = int(hf_model.get_input_embeddings().num_embeddings)
    tok = Tokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    pad = hf_tok.pad_token_id
    tokens = TokenizerAdapter.from_tokenizer(
        tok, max_tokens, pad_id=int(pad) if pad is not None else 0,
        vocab_size=min(max(len(hf_tok), tok.get_vocab_size(with_added_tokens=True)), rows),
        lowercase=bool(getattr(transformer, "do_lower_case", False)),
    )
    inputs = ("input_ids", "attention_mask") + (
        ("token_type_ids",) if "token_type_ids" in hf_tok.model_input_names else ()
    )
    dim_of = getattr(st, "get_embedding_dimension", None) or st.get_sentence_embedding_dimension

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.st = st

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            features = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                features["token_type_ids"] = token_type_ids
            return self.st(features)["sentence_embedding"]

    manifest = ExportManifest(
        name=name, task=str(Task.EMBED), max_tokens=max_tokens, vocab_size=tokens.vocab_size,
        dim=int(dim_of() or 0), pad_id=tokens.pad_id, inputs=inputs, output="sentence_embedding",
        normalized=any(type(m).__name__ == "Normalize" for m in st), aliases=aliases, source=path,
        versions=versions(),
    )
    return ExportSource(
        module=Embedder().eval(), inputs=inputs, output="sentence_embedding", tokens=tokens,
        manifest=manifest, transformer_dir=tdir,
        reference=lambda: np.asarray(st.encode(list(PROBE_TEXTS), batch_size=len(PROBE_TEXTS))),
        probe=lambda onnx: rows_of(onnx, [onnx.with_special_tokens(i) for i in onnx.tokenize(PROBE_TEXTS)]),
    )


def classifier_source(path: str, name: str, aliases: tuple[str, ...], task: Task) -> ExportSource:
    import torch

    from .hf_runners import SequenceClassifierRunner, _activation

    runner = SequenceClassifierRunner(path, name=name, task=task, device="cpu", aliases=aliases)
    model = runner.model.eval()
    config = model.config.to_dict()
    segments = "token_type_ids" in runner.hf_tokenizer.model_input_names and (
        int(config.get("type_vocab_size") or 0) >= 2
    )
    inputs = ("input_ids", "attention_mask") + (("token_type_ids",) if segments else ())
    rows = int(model.get_input_embeddings().num_embeddings)

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            extra = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits

    info = runner.info
    root = Path(path)
    manifest = ExportManifest(
        name=name, task=str(task), max_tokens=info.max_tokens, vocab_size=min(info.vocab_size, rows),
        dim=info.dim, pad_id=runner.tokens.pad_id, inputs=inputs, output="logits", labels=info.labels,
        activations={str(t): _activation(root, config, t) for t in (Task.CLASSIFY, Task.RERANK)},
        aliases=aliases, source=path, versions=versions(),
    )
    return ExportSource(
        module=Classifier().eval(), inputs=inputs, output="logits", tokens=runner.tokens, manifest=manifest,
        transformer_dir=root, reference=lambda: rows_of(runner, pair_batch(runner)),
        probe=lambda onnx: rows_of(onnx, pair_batch(onnx)),
    )


def pair_batch(runner: Any) -> list[Sequence[int]]:
    """The probe pairs and texts as one mixed batch: pairs (segments set) and single texts."""
    ids = dict(zip(PROBE_TEXTS + tuple(s for p in PROBE_PAIRS for s in p),
                   runner.tokenize(list(PROBE_TEXTS) + [s for p in PROBE_PAIRS for s in p]), strict=True))
    pairs: list[Sequence[int]] = [runner.pair_with_special_tokens(ids[a], ids[b]) for a, b in PROBE_PAIRS]
    return pairs + [runner.with_special_tokens(ids[t]) for t in PROBE_TEXTS]


def rows_of(runner: Any, batch: Sequence[Sequence[int]]) -> np.ndarray:
    prepared = runner.prepare(batch)
    rows: np.ndarray = runner.finish(runner.forward(prepared), prepared)
    return rows


def st_modules(root: Path) -> list[dict[str, Any]]:
    modules = json.loads((root / "modules.json").read_text(encoding="utf-8"))
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def versions() -> dict[str, str]:
    found = {}
    for dist in ("torch", "transformers", "sentence-transformers", "onnx", "onnxscript", "onnxruntime"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found
