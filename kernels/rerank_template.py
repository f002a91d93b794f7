"""Which model directories are LLM rerankers, and the template each one reads its pairs through.

Torch-free (the loader calls it before anything imports torch; the gateway never does). An LLM
reranker is a decoder LM that judges a (query, document) pair by the logits of an answer token
("yes"/"no") at the last position of a chat template, as Qwen3-Reranker does. Its
:class:`~coalesce.kernels.protocol.RerankTemplate` comes, in this order, from:

* ``rerank_template.json`` in the model directory: any of ``prefix``, ``suffix``, ``pair`` (with
  ``{instruction}``, ``{query}`` and ``{document}``), ``instruction`` (the default one), ``yes`` and
  ``no`` (``null``: the score is the "yes" logit alone); what it leaves out is the Qwen3-Reranker's;
* the Qwen3-Reranker model card's template, for a ``*ForCausalLM`` served as a reranker and for a
  converted Qwen3 "seq-cls" reranker (a ``Qwen3ForSequenceClassification`` with one output).
"""

from __future__ import annotations

import json
from pathlib import Path

from .hf_runners import _num_labels, _read_json
from .protocol import RERANK_TEMPLATE_FILE, RerankTemplate

# The Qwen/Qwen3-Reranker-0.6B model card's reference code, string for string.
QWEN3_RERANKER = RerankTemplate(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
        'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    ),
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    pair="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    instruction="Given a web search query, retrieve relevant passages that answer the query",
)

_FIELDS = ("prefix", "suffix", "pair", "instruction", "yes", "no")


def llm_reranker_template(path: str, template_file: str | None = None) -> RerankTemplate | None:
    """The template of the reranker at ``path`` when it is an LLM reranker, else None (a cross-encoder).

    Called for models served as rerankers only: one given a template file (``--rerank-template``), a
    causal LM, a directory with ``rerank_template.json``, or a Qwen3 sequence classifier of one output
    (how the Qwen3-Reranker "seq-cls" conversions are published: ``lm_head[yes] − lm_head[no]`` as the
    head) is one.
    """
    if template_file is not None:
        return read_template(Path(template_file))
    root = Path(path)
    if (root / RERANK_TEMPLATE_FILE).is_file():
        return read_template(root / RERANK_TEMPLATE_FILE)
    config = _read_json(root / "config.json")
    architectures = [str(a) for a in config.get("architectures") or []]
    if any(a.endswith("ForCausalLM") for a in architectures):
        return QWEN3_RERANKER
    seq_cls = any(a.endswith("ForSequenceClassification") for a in architectures)
    if seq_cls and config.get("model_type") == "qwen3" and _num_labels(config) == 1:
        return QWEN3_RERANKER
    return None


def read_template(file: Path) -> RerankTemplate:
    """The template a ``rerank_template.json`` describes (the Qwen3-Reranker's for what it leaves out)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not a readable JSON object ({exc})") from exc
    if not isinstance(data, dict) or set(data) - set(_FIELDS):
        raise ValueError(f"{file}: expected a JSON object with some of {', '.join(_FIELDS)}")
    for key, value in data.items():
        if not (isinstance(value, str) or (key == "no" and value is None)):
            raise ValueError(f"{file}: '{key}' must be a string{' or null' if key == 'no' else ''}")
    template = RerankTemplate(**{k: data.get(k, getattr(QWEN3_RERANKER, k)) for k in _FIELDS})
    check_template(template, str(file))
    return template


def check_template(template: RerankTemplate, where: str) -> None:
    """``pair`` must hold ``{document}`` once and ``{query}``, and format with nothing else."""
    pair = template.pair
    if pair.count("{document}") != 1 or "{query}" not in pair:
        raise ValueError(f"{where}: 'pair' must contain {{document}} exactly once, and {{query}}")
    try:
        for part in (pair, *pair.split("{document}")):
            part.format(instruction="", query="", document="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"{where}: 'pair' may name only {{instruction}}, {{query}} and {{document}} "
            f"(write {{{{ and }}}} for literal braces): {exc}"
        ) from exc
    if not template.yes:
        raise ValueError(f"{where}: 'yes' must name the answer token that scores a relevant pair")
