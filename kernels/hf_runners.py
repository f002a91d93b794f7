"""Classifiers and cross-encoders: a ``transformers`` sequence-classification model as a runner.

One runner class serves both tasks, since a cross-encoder *is* a sequence classifier read differently:

* ``classify``: one input (or a text pair) → one logit per label;
* ``rerank``: a (query, document) pair → one relevance logit.

The runner returns logits; the gateway turns them into scores with ``ModelInfo.activation`` (softmax,
sigmoid or none, from the model's config) so ``raw_scores`` costs nothing extra. Pairs arrive as
:class:`~coalesce.kernels.protocol.PairIds`, whose ``b_start`` sets the segment ids.

Also here, torch-free: :func:`detect_task`, which reads a model directory's JSON files to decide which
task it serves.
Their weights stay float32 on the CPU whatever ``--dtype`` says: a classifier's or cross-encoder's
logits are compared and thresholded, where the cosine guard of ``precision`` says nothing.
Construction loads weights; only the model thread may call ``forward``/``finish``/``warmup``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .protocol import RERANK_TEMPLATE_FILE, ModelInfo, PairIds, Task
from .st_runner import Prepared, model_name_from_path, padded_features, resolve_device
from .tokens import TokenizerAdapter

log = logging.getLogger("coalesce.kernels")

# The last part of a sentence-transformers ``activation_fn`` path → how the gateway applies it.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "none", "Softmax": "softmax"}
# Model families whose position ids start after the padding id (TEI subtracts the same offset).
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _num_labels(config: dict[str, Any]) -> int:
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    return int(config.get("num_labels", 2))  # transformers' default is two labels


def detect_task(path: str) -> Task:
    """The task the model directory at ``path`` serves, from its JSON files alone (no weights read).

    A sentence-transformers ``CrossEncoder`` → rerank; a ``SparseEncoder`` (SPLADE: a masked-LM head
    and SPLADE pooling) → sparse; any other sentence-transformers layout (``modules.json``) → embed; a
    ``*ForSequenceClassification`` → rerank when it has one output (how cross-encoders are published)
    or carries a cross-encoder activation, else classify; a ``*ForCausalLM`` with a
    ``rerank_template.json`` → rerank (an LLM reranker, see ``rerank_template``); anything else → embed
    (sentence-transformers wraps a plain encoder with mean pooling). ``--task`` overrides this.
    """
    root = Path(path)
    kind = _read_json(root / "config_sentence_transformers.json").get("model_type")
    if kind == "CrossEncoder":
        return Task.RERANK
    if kind == "SparseEncoder":
        return Task.SPARSE
    if (root / "modules.json").is_file():
        return Task.EMBED
    config = _read_json(root / "config.json")
    architectures = config.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        cross_encoder = "sentence_transformers" in config or "sbert_ce_default_activation_function" in config
        return Task.RERANK if cross_encoder or _num_labels(config) == 1 else Task.CLASSIFY
    causal = any(str(a).endswith("ForCausalLM") for a in architectures)
    if causal and (root / RERANK_TEMPLATE_FILE).is_file():
        return Task.RERANK
    return Task.EMBED


def _activation(root: Path, config: dict[str, Any], task: Task) -> str:
    """Softmax, sigmoid or none: what sentence-transformers' CrossEncoder (rerank) or the config's
    ``problem_type`` (classify) applies to the logits."""
    n = _num_labels(config)
    if task is Task.CLASSIFY:
        multi = config.get("problem_type") == "multi_label_classification"
        return "sigmoid" if multi or n == 1 else "softmax"
    st = config.get("sentence_transformers")
    fn = (
        _read_json(root / "config_sentence_transformers.json").get("activation_fn")
        or (st.get("activation_fn") if isinstance(st, dict) else None)
        or config.get("sbert_ce_default_activation_function")
    )
    if fn is None:
        return "sigmoid" if n == 1 else "none"
    name = str(fn).rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ValueError(f"{root}: activation {fn!r} is not supported (use Sigmoid, Identity or Softmax)")
    return _ACTIVATIONS[name]


def _max_tokens(root: Path, config: dict[str, Any], tokenizer: Any) -> int:
    """The longest sequence the model takes: its positions, its tokenizer's and any saved cap."""
    limits = []
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions > 0:
        offset = (
            int(config.get("pad_token_id") or 0) + 1 if config.get("model_type") in _OFFSET_POSITIONS else 0
        )
        limits.append(positions - offset)
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
        limits.append(tok_max)
    saved = _read_json(root / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(saved, int) and saved > 0:
        limits.append(saved)
    if not limits:
        raise ValueError(f"{root}: cannot tell the model's maximum sequence length")
    return min(limits)


class SequenceClassifierRunner:
    """Runs an ``AutoModelForSequenceClassification`` eagerly, padded to each batch's longest input."""

    capture_stats = None  # no CUDA graphs here

    def __init__(
        self,
        path: str,
        *,
        name: str | None,
        task: Task,
        device: str = "auto",
        aliases: Sequence[str] = (),
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if task is Task.EMBED:
            raise ValueError("SequenceClassifierRunner serves classify and rerank, not embed")
        root = Path(path)
        self._torch = torch
        self.device = resolve_device(device)
        self.hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        self.model.to(self.device).eval()
        config = self.model.config.to_dict()
        n_labels = int(self.model.config.num_labels)
        if task is Task.RERANK and n_labels != 1:
            raise ValueError(
                f"{path}: reranking needs one relevance score per pair, but the model has {n_labels} "
                "labels; serve it with --task NAME=classify"
            )
        max_tokens = _max_tokens(root, config, self.hf_tokenizer)
        self.tokens = TokenizerAdapter(self.hf_tokenizer, max_tokens)
        self._segments = "token_type_ids" in self.hf_tokenizer.model_input_names and (
            int(config.get("type_vocab_size") or 0) >= 2
        )
        id2label = self.model.config.id2label
        self.info = ModelInfo(
            name=name or model_name_from_path(path),
            task=task,
            max_tokens=max_tokens,
            vocab_size=self.tokens.vocab_size,
            dim=n_labels,
            labels=tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(n_labels)),
            normalized=False,
            aliases=tuple(aliases),
            activation=_activation(root, config, task),
            dtype=str(self.model.dtype).removeprefix("torch."),
        )

    # -- CPU side ------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokens.tokenize(texts)

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return self.tokens.with_special_tokens(ids)

    def pair_with_special_tokens(self, a: Sequence[int], b: Sequence[int]) -> PairIds:
        ids, b_start = self.tokens.pair_with_special_tokens(a, b)
        return PairIds(ids, b_start)

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> Prepared:
        return Prepared(features=padded_features(batch, self.tokens.pad_id, self._segments), rows=len(batch))

    # -- model thread --------------------------------------------------------------------------------
    def forward(self, prepared: Prepared) -> Any:
        with self._torch.inference_mode():
            features = {k: v.to(self.device, non_blocking=True) for k, v in prepared.features.items()}
            return self.model(**features).logits

    def finish(self, output: Any, prepared: Prepared) -> np.ndarray:
        rows: np.ndarray = output[: prepared.rows].float().cpu().numpy()
        return rows

    def warmup(self) -> None:
        filler = [self.tokens.pad_id + 1000] * 16
        for batch in (
            [self.with_special_tokens(filler[:8])],
            [self.pair_with_special_tokens(filler[:4], filler)] * 4,
        ):
            prepared = self.prepare(batch)
            self.finish(self.forward(prepared), prepared)
