"""``GraphSafeBert.from_state_dict``: Hugging Face BERT key names under any prefix map to the same model,
and a state dict that does not fit is refused with a reason (no model files needed: tiny random weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from coalesce.kernels.bert import GraphSafeBert, config_unsupported_reason, own_state_dict

CONFIG: dict[str, Any] = {
    "model_type": "bert",
    "vocab_size": 50,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 32,
    "max_position_embeddings": 24,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}


def _hf_state(config: dict[str, Any] = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under ``BertModel``'s key names (plus the extras real checkpoints carry)."""
    g = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    state = {
        "embeddings.word_embeddings.weight": r(config["vocab_size"], h),
        "embeddings.position_embeddings.weight": r(config["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": r(2, h),
        "embeddings.LayerNorm.weight": 1 + 0.1 * r(h),
        "embeddings.LayerNorm.bias": 0.1 * r(h),
        "embeddings.position_ids": torch.arange(config["max_position_embeddings"])[None],
        "pooler.dense.weight": r(h, h),
        "pooler.dense.bias": r(h),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name, (out, inp) in {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (inter, h),
            "output.dense": (h, inter),
        }.items():
            state[f"{p}{name}.weight"] = r(out, inp) / inp**0.5
            state[f"{p}{name}.bias"] = 0.1 * r(out)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            state[f"{p}{norm}.weight"] = 1 + 0.1 * r(h)
            state[f"{p}{norm}.bias"] = 0.1 * r(h)
    return state


def _embed(model: GraphSafeBert) -> torch.Tensor:
    ids = torch.tensor([[2, 7, 9, 11, 3, 0], [2, 5, 3, 0, 0, 0]])
    with torch.inference_mode():
        return model(ids, torch.tensor([5, 3]))


def _build(state: dict[str, torch.Tensor], config: dict[str, Any] = CONFIG) -> GraphSafeBert:
    return GraphSafeBert.from_state_dict(state, config, pooling="mean", normalize=True)


@pytest.mark.parametrize("prefix", ["bert.", "0.auto_model.", "model.encoder_model."])
def test_a_prefixed_state_dict_builds_the_same_model(prefix: str) -> None:
    plain = _embed(_build(_hf_state()))
    extra = {"cls.predictions.bias": torch.zeros(50)}  # a pretraining head outside the prefix
    prefixed = _embed(_build({**{prefix + k: v for k, v in _hf_state().items()}, **extra}))
    assert torch.equal(plain, prefixed)
    assert plain.shape == (2, 16)
    assert torch.allclose(plain.norm(dim=1), torch.ones(2))


def test_legacy_layernorm_gamma_beta_names_are_read_as_weight_and_bias() -> None:
    renamed = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in _hf_state().items()
    }
    assert torch.equal(_embed(_build(_hf_state())), _embed(_build(renamed)))


def test_fused_qkv_and_folded_token_type_hold_the_right_weights() -> None:
    state = _hf_state()
    own = own_state_dict(state, layers=2)
    q, k, v = (state[f"encoder.layer.1.attention.self.{n}.weight"] for n in ("query", "key", "value"))
    assert torch.equal(own["layers.1.qkv.weight"], torch.cat([q, k, v]))
    positions = state["embeddings.position_embeddings.weight"]
    assert torch.equal(own["pos_type"], positions + state["embeddings.token_type_embeddings.weight"][0])


def test_weights_differ_so_the_mapping_is_not_vacuous() -> None:
    assert not torch.allclose(_embed(_build(_hf_state(seed=0))), _embed(_build(_hf_state(seed=1))))


def test_half_precision_weights_load_as_float32() -> None:
    model = _build({k: v.half() if v.is_floating_point() else v for k, v in _hf_state().items()})
    assert model.word.weight.dtype == torch.float32
    assert not model.word.weight.requires_grad


def test_a_missing_weight_is_named() -> None:
    state = _hf_state()
    del state["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.output\.dense\.bias"):
        _build(state)


def test_two_candidate_prefixes_are_refused() -> None:
    state = _hf_state()
    state["bert.embeddings.word_embeddings.weight"] = state["embeddings.word_embeddings.weight"]
    with pytest.raises(ValueError, match="found 2"):
        _build(state)


def test_more_layers_than_the_config_says_are_refused() -> None:
    with pytest.raises(ValueError, match="more than"):
        _build(_hf_state({**CONFIG, "num_hidden_layers": 3}), CONFIG)


def test_weights_of_the_wrong_size_fail_loudly() -> None:
    with pytest.raises(RuntimeError, match="size mismatch"):
        _build(_hf_state(), {**CONFIG, "intermediate_size": 64})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_type": "roberta"}, "model_type"),
        ({"model_type": None}, "model_type"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"is_decoder": True}, "decoder"),
        ({"num_attention_heads": 5}, "divisible"),
    ],
)
def test_configs_outside_the_forward_are_refused(change: dict[str, Any], reason: str) -> None:
    config = {**CONFIG, **change}
    assert reason in (config_unsupported_reason(config) or "")
    with pytest.raises(ValueError, match=reason):
        _build(_hf_state(), config)


def test_the_constructor_alone_is_a_weightless_skeleton() -> None:
    skeleton = GraphSafeBert(
        vocab_size=50, hidden=16, layers=1, heads=4, intermediate=32, max_positions=24, eps=1e-12,
        act="gelu", pooling="mean", normalize=True,
    )
    assert all(p.is_meta for p in skeleton.parameters())


def test_the_model_owns_its_weights_and_never_aliases_the_state_dict() -> None:
    state = _hf_state()
    model = _build(state)
    before = _embed(model)
    for tensor in state.values():
        if tensor.is_floating_point():
            tensor.zero_()  # a memory-mapped file's pages, or a Hugging Face model's parameters
    assert torch.equal(_embed(model), before)
