"""LLM rerankers: a decoder LM that judges (query, document) pairs by its "yes" and "no" logits.

Qwen3-Reranker's model card scores a pair as P(yes) = softmax over the ("no", "yes") logits at the last
position of its chat template, which is sigmoid(yes − no). This runner returns that difference as the one
logit of each pair and declares ``activation="sigmoid"``, so a score equals the card's and TEI's
``raw_scores`` gives the log-odds. Two kinds of weights serve alike:

* a ``*ForCausalLM`` (the published reranker): the model's own forward, logits kept for the last
  position only (``logits_to_keep=1``: no vocabulary-wide logits for every token);
* a converted "seq-cls" variant (a ``*ForSequenceClassification`` of one output whose weights are
  ``lm_head[yes] − lm_head[no]``): its decoder, then its head at the last position.

Pairs arrive complete: the gateway formats and tokenises them with ``ModelInfo.rerank_template`` (see
``rerank_template`` and ``service/gateway/llm_pairs.py``), so every id the batcher charges is one the
forward computes. Batches are padded on the left, as the model card pads, with position ids counted from
each pair's first real token, so a pair scores the same in any batch as alone.

Construction loads weights; only the model thread may call ``forward``/``finish``/``warmup``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .hf_runners import _max_tokens
from .protocol import ModelInfo, RerankTemplate, Task
from .st_runner import Prepared, model_name_from_path, resolve_device
from .tokens import TokenizerAdapter


def left_padded(batch: Sequence[Sequence[int]], pad_id: int) -> dict[str, np.ndarray]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` (int64) of ``batch`` padded on the left to
    its longest sequence; each row's positions run 0, 1, ... from its first real token (padding: 0)."""
    length = max(len(s) for s in batch)
    ids = np.full((len(batch), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), length), dtype=np.int64)
    positions = np.zeros((len(batch), length), dtype=np.int64)
    for row, seq in enumerate(batch):
        start = length - len(seq)
        ids[row, start:] = seq
        mask[row, start:] = 1
        positions[row, start:] = np.arange(len(seq))
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def _dtype(dtype: str, device: str) -> Any:
    """``auto``: bfloat16 on CUDA where supported (these models are trained in it; float16 can overflow
    in their activations), else float16; float32 on the CPU (no cosine guard fits a yes/no logit
    difference, so bfloat16 there is the user's call: ``--dtype bfloat16``). Others as ``--dtype`` names
    them."""
    import torch

    from .precision import resolve_dtype

    if dtype == "auto" and device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return resolve_dtype(dtype, torch.device(device), cpu_auto_bf16=False)


class LlmRerankRunner:
    """Runs an LLM reranker eagerly (causal LM or its seq-cls conversion), padded to each batch's
    longest pair."""

    capture_stats = None  # no CUDA graphs here

    def __init__(
        self,
        path: str,
        *,
        name: str | None,
        template: RerankTemplate,
        device: str = "auto",
        dtype: str = "auto",
        aliases: Sequence[str] = (),
    ) -> None:
        import torch
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        self._torch = torch
        self.device = resolve_device(device)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        causal = any(str(a).endswith("ForCausalLM") for a in config.architectures or [])
        kind: Any = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
        self.model: Any = kind.from_pretrained(path, local_files_only=True, dtype=_dtype(dtype, self.device))
        self.model.to(self.device).eval()
        self.hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._answers: list[int] | None = None  # causal: the ids of "yes" and (when scored) "no"
        if causal:
            self._answers = [self._token_id(path, t) for t in (template.yes, template.no) if t is not None]
        elif self.model.config.num_labels != 1 or not hasattr(self.model, "score"):
            raise ValueError(
                f"{path}: an LLM reranker's classification head must give one logit (yes − no) per pair; "
                f"this one gives {self.model.config.num_labels}"
            )
        max_tokens = _max_tokens(Path(path), self.model.config.to_dict(), self.hf_tokenizer)
        self.tokens = TokenizerAdapter(self.hf_tokenizer, max_tokens)
        self.info = ModelInfo(
            name=name or model_name_from_path(path),
            task=Task.RERANK,
            max_tokens=max_tokens,
            vocab_size=self.tokens.vocab_size,
            dim=1,
            labels=(template.yes,),
            normalized=False,
            aliases=tuple(aliases),
            activation="sigmoid",
            dtype=str(self.model.dtype).removeprefix("torch."),
            rerank_template=template,
        )

    def _token_id(self, path: str, token: str) -> int:
        """The vocabulary id of the answer token ``token``, looked up as the model card does
        (``convert_tokens_to_ids``): a token, not a text to tokenise."""
        tid = self.hf_tokenizer.convert_tokens_to_ids(token)
        unk = self.hf_tokenizer.unk_token_id
        if not isinstance(tid, int) or (tid == unk and token != self.hf_tokenizer.unk_token):
            raise ValueError(
                f"{path}: the tokenizer has no token {token!r} to score pairs by; name the model's answer "
                f"tokens in its rerank_template.json ('yes', 'no')"
            )
        return tid

    # -- CPU side ------------------------------------------------------------------------------------
    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> Prepared:
        features = {k: self._torch.from_numpy(v) for k, v in left_padded(batch, self.tokens.pad_id).items()}
        return Prepared(features=features, rows=len(batch))

    # -- model thread --------------------------------------------------------------------------------
    def forward(self, prepared: Prepared) -> Any:
        with self._torch.inference_mode():
            features = {k: v.to(self.device, non_blocking=True) for k, v in prepared.features.items()}
            if self._answers is None:  # seq-cls: the decoder, then the one-logit head at the last position
                hidden = self.model.base_model(**features, use_cache=False).last_hidden_state
                return self.model.score(hidden[:, -1])
            logits = self.model(**features, use_cache=False, logits_to_keep=1).logits[:, -1]
            yes = logits[:, self._answers[0]]
            score = yes - logits[:, self._answers[1]] if len(self._answers) == 2 else yes
            return score.unsqueeze(1)

    def finish(self, output: Any, prepared: Prepared) -> np.ndarray:
        rows: np.ndarray = output[: prepared.rows].float().cpu().numpy()
        return rows

    def warmup(self) -> None:
        filler = [min(1000, self.tokens.vocab_size - 1)] * 16
        for batch in ([filler[:8]], [filler[:4], filler] * 2):
            prepared = self.prepare(batch)
            self.finish(self.forward(prepared), prepared)
