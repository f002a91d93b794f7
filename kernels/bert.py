"""A graph-safe forward for BERT-family encoders, built from a BERT state dict and its ``config.json``.

BERT, MiniLM, bge, e5 and gte-small share one architecture. This module re-expresses it so a whole
batch — embeddings, attention, feed-forward, pooling, L2 normalisation — is one function of two
fixed-shape tensors, ``input_ids`` (B, S) and ``lengths`` (B,), with no host synchronisation and no
data-dependent Python branch. That is what CUDA graph capture needs, and it is also faster eagerly:

* the attention mask is additive and built on the device from ``lengths`` (the Hugging Face SDPA
  mask helper checks ``torch.all(mask == 1)`` on the host, which breaks capture);
* query, key and value are one fused projection (weights concatenated at load time);
* position and token-type embeddings are one precomputed table (token type is always 0 here).

Rows past a sequence's length are padding: masked out of attention and pooling. A row of length 0
(a padded row that fills a bucket) sees every key masked with a large finite negative bias, so its
softmax is uniform rather than NaN; its pooled vector is zero and is dropped by the runner anyway.

Weights arrive one way, ``from_state_dict`` (Hugging Face ``BertModel`` key names, any prefix), so a
model can be built straight from ``model.safetensors`` without importing ``transformers`` (seconds of
cold start); ``from_hf`` hands a loaded ``BertModel``'s state dict to the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

PoolingMode = Literal["mean", "cls"]

# Hugging Face `hidden_act` names this forward implements exactly.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` (a Hugging Face model) cannot use this forward, or None when it can."""
    from transformers import BertModel

    if not isinstance(model, BertModel):
        return f"{type(model).__name__} is not a BertModel"
    return config_unsupported_reason(model.config.to_dict())


def config_unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why a model with this ``config.json`` (as a dict) cannot use this forward, or None when it can.

    Only ``model_type`` ``bert`` is accepted: other types with similar layers (RoBERTa's offset
    positions, ELECTRA's embedding projection, DistilBERT's names) do not map weight for weight.
    """
    if config.get("model_type") != "bert":
        return f"model_type {config.get('model_type')!r} is not bert"
    if config.get("is_decoder") or config.get("add_cross_attention"):
        return "decoder / cross-attention BERT"
    position = config.get("position_embedding_type") or "absolute"
    if position != "absolute":
        return f"position_embedding_type {position!r}"
    act = config.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        return f"hidden_act {act!r}"
    shape = BertShape.from_config(config)
    if shape.hidden % shape.heads:
        return "hidden_size not divisible by num_attention_heads"
    return None


@dataclass(frozen=True, slots=True)
class BertShape:
    """A BERT encoder's sizes, read from its ``config.json`` with ``transformers.BertConfig``'s defaults."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    eps: float
    act: str

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BertShape:
        return cls(
            vocab_size=int(config.get("vocab_size", 30522)),
            hidden=int(config.get("hidden_size", 768)),
            layers=int(config.get("num_hidden_layers", 12)),
            heads=int(config.get("num_attention_heads", 12)),
            intermediate=int(config.get("intermediate_size", 3072)),
            max_positions=int(config.get("max_position_embeddings", 512)),
            eps=float(config.get("layer_norm_eps", 1e-12)),
            act=str(config.get("hidden_act", "gelu")),
        )


def own_state_dict(state: Mapping[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """``GraphSafeBert``'s state dict from a ``BertModel``-style one: fresh float32 tensors.

    Keys may carry any prefix (``bert.``, ``0.auto_model.``, ...) as long as exactly one
    ``…embeddings.word_embeddings.weight`` names it; keys outside that prefix (heads, pooler) are
    ignored. Old checkpoints' LayerNorm ``gamma``/``beta`` read as ``weight``/``bias``. Query, key and
    value are fused; position and token-type-0 embeddings are summed. Raises ValueError for a missing
    weight or an ambiguous prefix.

    Every tensor is a copy in anonymous memory, never a view of ``state``: safetensors hands out views
    of a memory-mapped file, whose clean pages the kernel drops first under memory pressure and faults
    back in during a forward (a latency spike under load), and a Hugging Face model's parameters must
    not be shared. The copy costs tens of milliseconds at start.
    """
    anchor = "embeddings.word_embeddings.weight"
    prefixes = [k[: -len(anchor)] for k in state if k == anchor or k.endswith("." + anchor)]
    if len(prefixes) != 1:
        raise ValueError(f"expected one '{anchor}' in the state dict, found {len(prefixes)}")
    prefix = prefixes[0]
    bare = {_legacy_norm_name(k[len(prefix) :]): v for k, v in state.items() if k.startswith(prefix)}

    def get(key: str) -> torch.Tensor:
        if key not in bare:
            raise ValueError(f"state dict lacks '{prefix}{key}'")
        return bare[key]

    def own(key: str) -> torch.Tensor:
        return get(key).to(torch.float32, copy=True)

    out = {
        "word.weight": own("embeddings.word_embeddings.weight"),
        # Token type is always 0 here, so its embedding folds into the position table (a new tensor).
        "pos_type": own("embeddings.position_embeddings.weight")
        + get("embeddings.token_type_embeddings.weight")[0].float(),
        "emb_norm.weight": own("embeddings.LayerNorm.weight"),
        "emb_norm.bias": own("embeddings.LayerNorm.bias"),
    }
    for i in range(layers):
        theirs, mine = f"encoder.layer.{i}.", f"layers.{i}."
        for part in ("weight", "bias"):
            qkv = [get(f"{theirs}attention.self.{name}.{part}") for name in ("query", "key", "value")]
            out[mine + "qkv." + part] = torch.cat(qkv).float()  # cat makes a new tensor
            out[mine + "attn_out." + part] = own(f"{theirs}attention.output.dense.{part}")
            out[mine + "attn_norm." + part] = own(f"{theirs}attention.output.LayerNorm.{part}")
            out[mine + "ffn_in." + part] = own(f"{theirs}intermediate.dense.{part}")
            out[mine + "ffn_out." + part] = own(f"{theirs}output.dense.{part}")
            out[mine + "ffn_norm." + part] = own(f"{theirs}output.LayerNorm.{part}")
    if f"encoder.layer.{layers}.output.dense.weight" in bare:
        raise ValueError(f"state dict has more than the config's {layers} layers")
    return out


def _legacy_norm_name(key: str) -> str:
    """``…LayerNorm.gamma``/``beta`` (TF-era checkpoints) as ``weight``/``bias``, as transformers does."""
    if ".LayerNorm." in key:
        for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
            if key.endswith(old):
                return key[: -len(old)] + new
    return key


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of (B, heads, S, head_dim) ``q``, ``k``, ``v`` under the additive ``bias`` (B, 1, 1, S):
    PyTorch's fused kernel (the default; the only one CUDA graphs capture here)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The same attention as two batched matrix products and a softmax (what SDPA's reference "math"
    backend computes, with only the scores up-cast). ``cpu_forward`` uses it for bfloat16 batches on the
    CPU, where PyTorch's fused CPU kernel is slower than this at the short sequences embedded here.

    The products run in the inputs' dtype; the scaling, mask and softmax in float32, which on the CPU
    is both closer to float32 attention and faster than PyTorch's bfloat16 softmax and in-place
    arithmetic (``python -m coalesce.loadtests.forward_ops`` times them per operator)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5).add_(bias)
    return torch.matmul(scores.softmax(-1).to(q.dtype), v)


class _Layer(nn.Module):
    """One post-norm transformer encoder layer with a fused QKV projection."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        meta = torch.device("meta")  # a skeleton: GraphSafeBert.from_state_dict assigns the weights
        self.qkv = nn.Linear(hidden, 3 * hidden, device=meta)
        self.attn_out = nn.Linear(hidden, hidden, device=meta)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, device=meta)
        self.ffn_in = nn.Linear(hidden, intermediate, device=meta)
        self.ffn_out = nn.Linear(intermediate, hidden, device=meta)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps, device=meta)
        self.act_name = act  # cpu_forward fuses it into ffn_in (then act is the identity)
        self.act = _ACTIVATIONS[act]
        self.attend: Callable[..., torch.Tensor] = sdpa_attention  # cpu_forward may pick another

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        ctx = self.attend(qkv[0], qkv[1], qkv[2], bias)
        x = self.attn_norm(self.attn_out(ctx.transpose(1, 2).reshape(b, s, h)) + x)
        return self.ffn_norm(self.ffn_out(self.act(self.ffn_in(x))) + x)


class GraphSafeBert(nn.Module):
    """BERT encoder + sentence-transformers pooling as one capture-safe function.

    ``forward(input_ids, lengths)`` returns float32 sentence embeddings (B, dim): mean or CLS pooling,
    then optional truncation to ``truncate_dim`` (a model-level Matryoshka width, applied before
    normalising, inside the captured region), then optional L2 normalisation. Pooling and
    normalisation run in float32 whatever the model's dtype.

    The constructor builds a weightless skeleton on the meta device (random initialisation of a
    22M-parameter model costs ~0.15 s of cold start, only to be overwritten); ``from_state_dict`` and
    ``from_hf`` are the ways to get a model that runs.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        hidden: int,
        layers: int,
        heads: int,
        intermediate: int,
        max_positions: int,
        eps: float,
        act: str,
        pooling: PoolingMode,
        normalize: bool,
        truncate_dim: int | None = None,
    ) -> None:
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise ValueError(f"unsupported pooling {pooling!r}")
        if truncate_dim is not None and not 0 < truncate_dim <= hidden:
            raise ValueError(f"truncate_dim must be in 1..{hidden}, got {truncate_dim}")
        self.pooling: PoolingMode = pooling
        self.normalize = normalize
        self.dim = truncate_dim or hidden
        meta = torch.device("meta")
        # `_weight` skips nn.Embedding's normal_() init, whose meta kernel imports sympy (~1.3 s).
        self.word = nn.Embedding(vocab_size, hidden, _weight=torch.empty(vocab_size, hidden, device=meta))
        self.pos_type = nn.Parameter(torch.empty(max_positions, hidden, device=meta))
        self.emb_norm = nn.LayerNorm(hidden, eps=eps, device=meta)
        self.layers = nn.ModuleList(_Layer(hidden, heads, intermediate, eps, act) for _ in range(layers))
        self.register_buffer("positions", torch.arange(max_positions), persistent=False)
        self.positions: torch.Tensor

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, torch.Tensor],
        config: Mapping[str, Any],
        *,
        pooling: PoolingMode,
        normalize: bool,
        truncate_dim: int | None = None,
    ) -> GraphSafeBert:
        """A float32 CPU model from a ``BertModel``-style state dict and its ``config.json`` dict.

        Raises ValueError when the config is outside this forward (see ``config_unsupported_reason``)
        or a weight is missing. The model copies what it keeps: ``state`` may be a memory map.
        """
        reason = config_unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"not a supported BERT-family model: {reason}")
        shape = BertShape.from_config(config)
        own = own_state_dict(state, shape.layers)
        out = cls(
            vocab_size=shape.vocab_size,
            hidden=shape.hidden,
            layers=shape.layers,
            heads=shape.heads,
            intermediate=shape.intermediate,
            max_positions=shape.max_positions,
            eps=shape.eps,
            act=shape.act,
            pooling=pooling,
            normalize=normalize,
            truncate_dim=truncate_dim,
        )
        out.load_state_dict(own, strict=True, assign=True)  # checks every shape against the config
        return out.eval().requires_grad_(False)

    @classmethod
    def from_hf(
        cls,
        model: Any,
        *,
        pooling: PoolingMode,
        normalize: bool,
        truncate_dim: int | None = None,
    ) -> GraphSafeBert:
        """Copy the weights of a Hugging Face ``BertModel`` (check ``unsupported_reason`` first)."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"not a supported BERT-family model: {reason}")
        return cls.from_state_dict(
            model.state_dict(), model.config.to_dict(), pooling=pooling, normalize=normalize,
            truncate_dim=truncate_dim,
        )

    @property
    def max_positions(self) -> int:
        return self.pos_type.shape[0]

    def _encode(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(last hidden states (B, S, hidden) in the model's dtype, the (B, S) bool mask of real tokens)."""
        s = input_ids.shape[1]
        keep = self.positions[:s].unsqueeze(0) < lengths.unsqueeze(1)  # (B, S) bool, on the device
        x = self.emb_norm(self.word(input_ids) + self.pos_type[:s])
        # Half the dtype's most negative value: exp() of it is 0, and adding an attention score to it
        # cannot overflow to -inf, so a fully masked row stays finite.
        neg = torch.finfo(x.dtype).min / 2
        bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill_(~keep, neg)
        bias = bias[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return x, keep

    def token_embeddings(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """float32 ``(sum(lengths), hidden)``: every real token's last hidden state (what
        sentence-transformers returns as ``token_embeddings``), row by row, padding dropped.

        Eager only: the output's size depends on the lengths (a host synchronisation)."""
        x, keep = self._encode(input_ids, lengths)
        return x[keep].float()

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Embeddings (B, dim) float32 of right-padded ``input_ids`` (B, S) with true ``lengths`` (B,)."""
        pooled = self.pool(input_ids, lengths)
        return F.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled

    def pool(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``forward`` before its L2 normalisation: pooled (and ``truncate_dim``-cut) float32 (B, dim)."""
        x, keep = self._encode(input_ids, lengths)
        h = x.float()
        if self.pooling == "cls":
            pooled = h[:, 0]
        else:
            weights = keep.unsqueeze(-1).float()
            pooled = (h * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.dim != pooled.shape[1]:
            pooled = pooled[:, : self.dim]
        return pooled

