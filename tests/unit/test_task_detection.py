"""Which task a model directory serves, read from its JSON files (no weights), and the --task override."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coalesce.kernels.hf_runners import _activation, detect_task
from coalesce.kernels.protocol import PairIds, Task
from coalesce.service.gateway.responses import activate
from coalesce.service.settings import ModelSpec, build


def model_dir(tmp_path: Path, files: dict[str, Any]) -> Path:
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def classifier_config(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": ["BertForSequenceClassification"],
        "id2label": {str(i): f"L{i}" for i in range(n)},
        **extra,
    }


@pytest.mark.parametrize(
    ("files", "task"),
    [
        ({"modules.json": [], "config.json": {"architectures": ["BertModel"]}}, Task.EMBED),
        ({"config.json": {"architectures": ["BertModel"]}}, Task.EMBED),  # plain encoder: mean pooling
        ({"config.json": classifier_config(3)}, Task.CLASSIFY),
        (
            {"config.json": {"architectures": ["XLMRobertaForSequenceClassification"], "num_labels": 2}},
            Task.CLASSIFY,
        ),
        ({"config.json": classifier_config(1)}, Task.RERANK),  # how cross-encoders are published
        (
            {"config.json": classifier_config(2, sbert_ce_default_activation_function="torch.nn.Identity")},
            Task.RERANK,
        ),  # a cross-encoder saved by sentence-transformers < 4
        (
            {
                "modules.json": [],
                "config_sentence_transformers.json": {"model_type": "CrossEncoder"},
                "config.json": classifier_config(1),
            },
            Task.RERANK,
        ),  # sentence-transformers >= 4
    ],
)
def test_task_is_detected_from_the_directory(tmp_path: Path, files: dict[str, Any], task: Task) -> None:
    assert detect_task(str(model_dir(tmp_path, files))) is task


@pytest.mark.parametrize(
    ("files", "task", "activation"),
    [
        ({"config.json": classifier_config(3)}, Task.CLASSIFY, "softmax"),
        (
            {"config.json": classifier_config(3, problem_type="multi_label_classification")},
            Task.CLASSIFY,
            "sigmoid",
        ),
        ({"config.json": classifier_config(1)}, Task.CLASSIFY, "sigmoid"),
        ({"config.json": classifier_config(1)}, Task.RERANK, "sigmoid"),  # CrossEncoder's default
        (
            {
                "config.json": classifier_config(1),
                "config_sentence_transformers.json": {"activation_fn": "torch.nn.modules.linear.Identity"},
            },
            Task.RERANK,
            "none",
        ),
        (
            {
                "config.json": classifier_config(
                    1, sentence_transformers={"activation_fn": "torch.nn.modules.activation.Sigmoid"}
                )
            },
            Task.RERANK,
            "sigmoid",
        ),
    ],
)
def test_scores_use_the_activation_the_config_asks_for(
    tmp_path: Path, files: dict[str, Any], task: Task, activation: str
) -> None:
    root = model_dir(tmp_path, files)
    config = json.loads((root / "config.json").read_text())
    assert _activation(root, config, task) == activation


def test_an_unknown_activation_fails_loudly(tmp_path: Path) -> None:
    root = model_dir(tmp_path, {"config_sentence_transformers.json": {"activation_fn": "my.Custom"}})
    with pytest.raises(ValueError, match="not supported"):
        _activation(root, classifier_config(1), Task.RERANK)


def test_activations() -> None:
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    soft = activate(logits, "softmax")
    np.testing.assert_allclose(soft.sum(axis=1), 1.0)
    assert soft[0].argmax() == 0 and soft[1] == pytest.approx([1 / 3] * 3)
    np.testing.assert_allclose(activate(np.array([[0.0], [100.0]]), "sigmoid")[:, 0], [0.5, 1.0])
    np.testing.assert_array_equal(activate(logits, "none"), logits)


def test_task_flag_overrides_by_served_name() -> None:
    s = build(["--model", "a=/m/a", "--model", "b=/m/b", "--task", "b=RERANK"], environ={})
    assert s.model_specs == (ModelSpec("a", "/m/a"), ModelSpec("b", "/m/b", "rerank"))
    env = build([], environ={"COALESCE_MODEL": "a=/m/a;b=/m/b", "COALESCE_TASK": "a=classify;b=embed"})
    assert [m.task for m in env.model_specs] == ["classify", "embed"]
    one = build(["--model", "/m/x", "--served-model-name", "x", "--task", "x=classify"], environ={})
    assert one.model_specs == (ModelSpec("x", "/m/x", "classify"),)


@pytest.mark.parametrize(
    "argv", [["--model", "a=/m", "--task", "a=summarize"], ["--model", "a=/m", "--task", "a"]]
)
def test_task_flag_rejects_an_unknown_task(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build(argv, environ={})
    assert "embed|classify|rerank" in capsys.readouterr().err


def test_task_flag_must_name_a_served_model() -> None:
    with pytest.raises(SystemExit, match="--task names b"):
        build(["--model", "a=/m", "--task", "b=embed"], environ={})


def test_pair_ids_flow_as_a_plain_sequence_and_keep_where_b_starts() -> None:
    pair = PairIds([101, 7, 102, 8, 9, 102], 3)
    assert pair == [101, 7, 102, 8, 9, 102] and len(pair) == 6 and pair.b_start == 3
    assert pair[:3] == [101, 7, 102] and not isinstance(list(pair), PairIds)
