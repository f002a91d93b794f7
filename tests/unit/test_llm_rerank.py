"""LLM rerankers without a model: which directories are ones and their templates, how a pair is built
and cut (the document only), left padding, and the template crossing to a gateway process."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import pytest
from coalesce.kernels.hf_runners import detect_task
from coalesce.kernels.llm_rerank import left_padded
from coalesce.kernels.protocol import ModelInfo, RerankTemplate, Task
from coalesce.kernels.rerank_template import QWEN3_RERANKER, llm_reranker_template, read_template
from coalesce.kernels.tokens import TokenizerSpec
from coalesce.service.client_wire import Wire
from coalesce.service.engine import messages as wire
from coalesce.service.errors import InvalidRequest
from coalesce.service.gateway.facade import ServedModel
from coalesce.service.gateway.llm_pairs import document_span, encode_template_pairs
from coalesce.service.settings import build

QWEN3_CAUSAL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
QWEN3_SEQ_CLS = {"architectures": ["Qwen3ForSequenceClassification"], "model_type": "qwen3",
                 "id2label": {"0": "LABEL_0"}}
BERT_CROSS_ENCODER = {"architectures": ["BertForSequenceClassification"], "model_type": "bert",
                      "id2label": {"0": "LABEL_0"}}


def model_dir(tmp_path: Path, config: dict[str, Any], template: Any = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if template is not None:
        (tmp_path / "rerank_template.json").write_text(json.dumps(template))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("config", "task", "template"),
    [
        (QWEN3_CAUSAL, Task.EMBED, QWEN3_RERANKER),  # a causal LM embeds unless --task NAME=rerank
        (QWEN3_SEQ_CLS, Task.RERANK, QWEN3_RERANKER),  # a converted Qwen3-Reranker ("seq-cls")
        ({**QWEN3_SEQ_CLS, "id2label": {"0": "a", "1": "b"}}, Task.CLASSIFY, None),
        (BERT_CROSS_ENCODER, Task.RERANK, None),  # a cross-encoder reads plain pairs
    ],
)
def test_which_directories_are_llm_rerankers(
    tmp_path: Path, config: dict[str, Any], task: Task, template: RerankTemplate | None
) -> None:
    path = model_dir(tmp_path, config)
    assert detect_task(path) is task
    assert llm_reranker_template(path) == template


def test_a_template_file_makes_a_causal_lm_a_reranker_and_fills_in_the_card(tmp_path: Path) -> None:
    mxbai = {"pair": "query: {query}\ndocument: {document}\n{instruction}\nRelevance:", "yes": "1", "no": "0",
             "instruction": "Judge relevance (0 or 1)."}
    path = model_dir(tmp_path, QWEN3_CAUSAL, mxbai)
    assert detect_task(path) is Task.RERANK
    got = llm_reranker_template(path)
    assert got == RerankTemplate(prefix=QWEN3_RERANKER.prefix, suffix=QWEN3_RERANKER.suffix, **mxbai)
    model_dir(tmp_path, QWEN3_CAUSAL, {"no": None})
    assert llm_reranker_template(path) == RerankTemplate(**{**_fields(QWEN3_RERANKER), "no": None})


def _fields(t: RerankTemplate) -> dict[str, Any]:
    return {k: getattr(t, k) for k in ("prefix", "suffix", "pair", "instruction", "yes", "no")}


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ({"pair": "{query} then nothing"}, "exactly once"),
        ({"pair": "{query} {document} {document}"}, "exactly once"),
        ({"pair": "{query} {document} {title}"}, "may name only"),
        ({"pair": "{query} {document} }"}, "may name only"),
        ({"prompt": "x"}, "expected a JSON object"),
        ({"yes": 1}, "'yes' must be a string"),
        ({"yes": ""}, "answer token"),
        ([], "expected a JSON object"),
    ],
)
def test_a_bad_template_file_is_refused_at_load_with_why(tmp_path: Path, template: Any, why: str) -> None:
    (tmp_path / "t.json").write_text(json.dumps(template))
    with pytest.raises(ValueError, match=re.escape(why)):
        read_template(tmp_path / "t.json")


def test_left_padding_ends_every_row_on_its_last_token_with_positions_from_zero() -> None:
    got = left_padded([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(got["input_ids"], [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(got["attention_mask"], [[1, 1, 1], [0, 0, 1]])
    np.testing.assert_array_equal(got["position_ids"], [[0, 1, 2], [0, 0, 0]])


@pytest.mark.parametrize(
    ("full", "head", "tail", "span"),
    [
        ([1, 2, 3, 4, 5], [1, 2], [], (2, 5)),
        ([1, 2, 9, 4, 5], [1, 2, 3], [], (2, 5)),  # the head's last token merged into the document's
        ([1, 2, 4, 5, 7, 8], [1, 2], [7, 8], (2, 4)),
        ([1, 2, 4, 5, 6, 8], [1, 2], [7, 8], (2, 5)),  # merged at the tail's boundary
        ([1, 2, 7, 8], [1, 2], [7, 8], (2, 2)),
    ],
)
def test_the_documents_tokens_are_found_between_the_templates(
    full: list[int], head: list[int], tail: list[int], span: tuple[int, int]
) -> None:
    assert document_span(full, head, tail) == span


class WordTokens:
    """A word-level tokenizer with [CLS]/[SEP] around a text: ids are assigned as words first appear."""

    max_tokens = 64
    pad_id = 0

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2}

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.vocab.setdefault(w, len(self.vocab)) for w in t.split()] for t in texts]

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return [1, *ids[: self.max_tokens - 2], 2]

    def words(self, ids: Sequence[int]) -> str:
        names = {v: k for k, v in self.vocab.items()}
        return " ".join(names[i] for i in ids)


class WordModel:
    """The parts of a served model that pair building uses."""

    specials = 2

    def __init__(self, template: RerankTemplate) -> None:
        self.tokens = WordTokens()
        self.info = ModelInfo("llm", Task.RERANK, 64, 1000, 1, rerank_template=template)

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokens.tokenize(texts)

    def estimate(self, texts: Sequence[str], prompt: str | None = None) -> tuple[int, int]:
        return 1, len(texts)

    def check_room(self, *args: object) -> None:
        pass


TAIL_TEMPLATE = RerankTemplate(prefix="<sys> judge </sys>", suffix="<answer>",
                               pair="I: {instruction} Q: {query} D: {document} END", instruction="find")


async def encode(model: WordModel, docs: list[str], *, limit: int = 64, cut: bool = True,
                 query: str = "q1 q2", max_b: int | None = None) -> list[str]:
    seqs = await encode_template_pairs(
        cast(ServedModel, model), cast(Any, None), [(query, d) for d in docs], instruction="find",
        cut=cut, field="documents", limit=limit, max_b=max_b,
    )
    return [model.tokens.words(s) for s in seqs]


async def test_a_pair_is_prefix_then_the_formatted_pair_with_special_tokens_then_suffix() -> None:
    model = WordModel(TAIL_TEMPLATE)
    got = await encode(model, ["d1 d2 d3"])
    assert got == ["<sys> judge </sys> [CLS] I: find Q: q1 q2 D: d1 d2 d3 END [SEP] <answer>"]


async def test_truncation_cuts_the_document_only_and_keeps_the_rest_of_the_template() -> None:
    model = WordModel(TAIL_TEMPLATE)
    doc = " ".join(f"w{i}" for i in range(100))
    (got,) = await encode(model, [doc], limit=20)
    assert len(got.split()) == 20
    assert got == "<sys> judge </sys> [CLS] I: find Q: q1 q2 D: w0 w1 w2 w3 w4 w5 w6 END [SEP] <answer>"
    (cut,) = await encode(model, ["a b c d e"], max_b=2)
    assert cut.endswith("D: a b END [SEP] <answer>")
    with pytest.raises(InvalidRequest, match=r"documents\[1\] makes a pair of 113 tokens") as err:
        await encode(model, ["short", doc], limit=20, cut=False)
    assert err.value.code == "input_too_long"
    with pytest.raises(InvalidRequest, match="leaves no room for a document") as err:
        await encode(model, ["d"], limit=20, query=" ".join(["long"] * 10))
    assert (err.value.code, err.value.param) == ("query_too_long", "query")


def test_the_template_crosses_to_a_gateway_process_intact() -> None:
    info = ModelInfo("llm", Task.RERANK, 512, 30522, 1, activation="sigmoid", rerank_template=QWEN3_RERANKER)
    offer = wire.ModelOffer(info, TokenizerSpec("{}", 512, 0, 30522), "cpu", 1000)
    sent = wire.encoder.encode(wire.Welcome(models=[offer]))
    got = wire.gateway_decoder.decode(sent)
    assert isinstance(got, wire.Welcome) and got.models[0].info == info
    assert msgspec.json.decode(msgspec.json.encode(info), type=ModelInfo) == info


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--rerank-instruction", "nope=find"], "--rerank-instruction names nope"),
        (["--max-rerank-tokens", "0"], "max_rerank_tokens must be at least 1"),
    ],
)
def test_rerank_flags_are_checked_at_start_up(argv: list[str], why: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(why)):
        build(["--model", "llm=/models/qwen3-reranker", *argv], environ={})


def test_the_client_sends_an_instruction_only_when_given() -> None:
    client = Wire("http://x", None, 1.0, 0, 0.0, 8, None)
    (_, body), = client.rerank_requests("q", ["a"], "llm")
    assert body == {"query": "q", "documents": ["a"], "model": "llm"}
    (_, body), = client.rerank_requests("q", ["a"], None, "find code")
    assert body == {"query": "q", "documents": ["a"], "instruction": "find code"}
