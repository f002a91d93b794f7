"""``fastload.read_plan``: which sentence-transformers directories the cold-start loader reproduces, read
from their JSON files alone (weights and tokenizer are empty placeholders here; nothing is loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from coalesce.kernels.fastload import FastPlan, read_plan

ST = "sentence_transformers"
FEATURES = {"method": "forward", "method_output_name": "last_hidden_state"}
BERT = {"model_type": "bert", "hidden_size": 384, "max_position_embeddings": 512, "hidden_act": "gelu"}


def _module(idx: int, path: str, kind: str) -> dict[str, Any]:
    return {"idx": idx, "name": str(idx), "path": path, "type": kind}


def _write(root: Path, files: dict[str, Any]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return root


def _dir(tmp_path: Path, **overrides: Any) -> Path:
    """A legacy (sentence-transformers 2) MiniLM-style directory, with ``overrides`` by file name."""
    files: dict[str, Any] = {
        "modules.json": [
            _module(0, "", f"{ST}.models.Transformer"),
            _module(1, "1_Pooling", f"{ST}.models.Pooling"),
            _module(2, "2_Normalize", f"{ST}.models.Normalize"),
        ],
        "config.json": BERT,
        "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": False},
        "1_Pooling/config.json": {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True},
        "tokenizer_config.json": {"tokenizer_class": "BertTokenizer", "model_max_length": 512},
        "model.safetensors": "",
        "tokenizer.json": "",
    }
    files.update({k.replace("__", "/"): v for k, v in overrides.items()})
    return _write(tmp_path, {k: v for k, v in files.items() if v is not None})


def _plan(root: Path) -> FastPlan:
    plan = read_plan(root)
    assert isinstance(plan, FastPlan), plan
    return plan


def test_the_legacy_minilm_layout_is_mean_pooled_normalised_and_256_tokens(tmp_path: Path) -> None:
    plan = _plan(_dir(tmp_path))
    assert (plan.pooling, plan.normalize, plan.max_tokens, plan.do_lower_case) == ("mean", True, 256, False)
    assert plan.transformer_dir == tmp_path


def test_the_v6_layout_reads_pooling_mode_and_takes_max_length_from_the_tokenizer(tmp_path: Path) -> None:
    plan = _plan(
        _dir(
            tmp_path,
            **{
                "modules.json": [
                    _module(0, "", f"{ST}.base.modules.transformer.Transformer"),
                    _module(1, "1_Pooling", f"{ST}.sentence_transformer.modules.pooling.Pooling"),
                ],
                "sentence_bert_config.json": {
                    "transformer_task": "feature-extraction",
                    "modality_config": {"text": FEATURES},
                    "module_output_name": "token_embeddings",
                },
                "1_Pooling__config.json": {"embedding_dimension": 384, "pooling_mode": "cls"},
                "tokenizer_config.json": {"tokenizer_class": "BertTokenizer", "model_max_length": 128},
            },
        )
    )
    assert (plan.pooling, plan.normalize, plan.max_tokens) == ("cls", False, 128)


def test_max_length_is_capped_at_the_position_table(tmp_path: Path) -> None:
    plan = _plan(_dir(tmp_path, **{"sentence_bert_config.json": {}, "tokenizer_config.json": {}}))
    assert plan.max_tokens == 512


def test_a_transformer_in_a_subfolder_is_found(tmp_path: Path) -> None:
    root = _dir(
        tmp_path,
        **{
            "modules.json": [
                _module(0, "0_Transformer", f"{ST}.models.Transformer"),
                _module(1, "1_Pooling", f"{ST}.models.Pooling"),
            ],
            "config.json": None,
            "model.safetensors": None,
            "tokenizer.json": None,
            "sentence_bert_config.json": None,
            "0_Transformer__config.json": BERT,
            "0_Transformer__model.safetensors": "",
            "0_Transformer__tokenizer.json": "",
            "0_Transformer__sentence_bert_config.json": {"max_seq_length": 64, "do_lower_case": True},
        },
    )
    plan = _plan(root)
    assert plan.transformer_dir == root / "0_Transformer"
    assert (plan.max_tokens, plan.do_lower_case) == (64, True)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"modules.json": None}, "no modules.json"),
        (
            {"modules.json": [_module(0, "", f"{ST}.models.Transformer"), _module(1, "1_P", "my.Pooling")]},
            "module pipeline",
        ),
        (
            {
                "modules.json": [
                    _module(0, "", f"{ST}.models.Transformer"),
                    _module(1, "1_Pooling", f"{ST}.models.Pooling"),
                    _module(2, "2_Dense", f"{ST}.models.Dense"),
                ]
            },
            "Dense",
        ),
        ({"config.json": {**BERT, "model_type": "xlm-roberta"}}, "model_type"),
        ({"model.safetensors": None}, "model.safetensors"),
        ({"tokenizer.json": None}, "tokenizer.json"),
        ({"1_Pooling__config.json": {"pooling_mode": "max"}}, "pooling 'max'"),
        ({"1_Pooling__config.json": {"pooling_mode_cls_token": 1, "pooling_mode_mean_tokens": 1}}, "pooling"),
        ({"1_Pooling__config.json": {"embedding_dimension": 768}}, "dimension"),
        ({"sentence_bert_config.json": {"transformer_task": "sequence-classification"}}, "transformer_task"),
        ({"sentence_bert_config.json": {"processing_kwargs": {"text": {"truncation": False}}}}, "processing"),
        ({"config_sentence_transformers.json": {"model_type": "SparseEncoder"}}, "SparseEncoder"),
        ({"config.json": "{not json"}, "unreadable config.json"),
    ],
)
def test_directories_it_does_not_reproduce_say_why(
    tmp_path: Path, overrides: dict[str, Any], reason: str
) -> None:
    plan = read_plan(_dir(tmp_path, **overrides))
    assert isinstance(plan, str)
    assert reason in plan
