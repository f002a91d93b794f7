"""A faster CPU forward for ``GraphSafeBert``: linear layers on weights packed once for oneDNN (the
activation fused into the first feed-forward projection) and, in bfloat16, matrix-product attention.

* **Packed weights.** ``F.linear`` on the CPU hands its weight to the BLAS (float32) or oneDNN
  (bfloat16) in the plain row-major layout on every call, and the library reorders it into the blocked
  layout its kernels read; at the short sequences an embedding service runs that is a large share of
  each call. The projections here are reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``)
  and run by ``torch.ops.mkldnn._linear_pointwise``, the pair PyTorch's own compiler (inductor's
  ``freezing`` on the CPU) emits for frozen linear layers, with GELU/ReLU as a fused post-op.
* **Attention in bfloat16** runs as two batched matrix products and a softmax
  (``bert.matmul_attention``) for batches of :data:`MATMUL_ATTENTION_MIN_ROWS` rows and more: PyTorch's
  fused CPU attention up-casts bfloat16 blocks to float32 and, at these sequence lengths, is slower in
  bfloat16 than in float32. A lone request (one or two rows) keeps the fused kernel, faster there.

What it gains is measured side by side in BENCHMARKS.md (the quality section's ``--no-cpu-fast-forward``
rows); ``--no-cpu-fast-forward`` turns it off. Nothing is taken on trust: the tuned model embeds the
calibration rows the precision guard uses and is kept only when every row stays within
:data:`TUNED_MIN_COSINE` of the plain forward's; otherwise (a build of torch without oneDNN, a CPU
oneDNN refuses, a layout it gets wrong) the model is put back as it was, with a log line. The packed
weights replace the plain ones, so no second copy stays resident. CUDA never comes here.

:func:`pack_linear_layers` does the packing alone (no fused activation, no attention change) for any
other CPU model: the eager sentence-transformers runner's (models outside the BERT family, pipelines
with a Dense layer), under the same check.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from .bert import matmul_attention, sdpa_attention
from .precision import min_cosine

log = logging.getLogger("coalesce.kernels")

# The lowest cosine between a calibration row of the tuned and of the plain forward that keeps the tuned
# one. Both compute the same function in another order of additions (float32: ~1e-7 apart; bfloat16,
# rounded at other points: ~1e-5); a wrong weight layout gives unrelated rows.
TUNED_MIN_COSINE = 0.9999

# bfloat16 batches of at least this many rows attend by matrix products (fewer: PyTorch's fused kernel).
MATMUL_ATTENTION_MIN_ROWS = 4

# Hugging Face ``hidden_act`` → oneDNN post-op (attr, algorithm) computing exactly the same function.
FUSED_ACTIVATIONS: dict[str, tuple[str, str]] = {
    "gelu": ("gelu", "none"),  # erf GELU
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}

_PROJECTIONS = ("qkv", "attn_out", "ffn_in", "ffn_out")


def packing_unavailable(dtype: torch.dtype = torch.float32) -> str | None:
    """Why this torch cannot pack linear weights of ``dtype`` for oneDNN here, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this build of torch has no oneDNN"
    for op in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, op):
            return f"torch.ops.mkldnn.{op} is missing"
    if dtype == torch.bfloat16 and not bf16_kernels():
        return "this CPU has no oneDNN bfloat16 kernels (they need AVX-512 BW, VL and DQ, or AVX-NE-CONVERT)"
    return None


def bf16_kernels() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (its own check: packing a bfloat16 weight
    raises where it has none, as on a CPU with AVX2 only)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else True  # (an older torch: packing itself may refuse)


class PackedLinear(nn.Module):
    """``nn.Linear`` (then the post-op ``attr``, e.g. GELU) on a weight oneDNN has reordered once.

    The packed weight is an opaque oneDNN tensor held as a buffer, not a parameter, and not persistent:
    it is not in the state dict (this module lives on the CPU, in one dtype; nothing moves it). A
    buffer, so that ``traced_forward`` can trace the module: the tracer reads a buffer from its module
    and cannot record an opaque tensor as a constant.
    """

    def __init__(self, linear: nn.Linear, attr: str = "none", algorithm: str = "") -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = weight.dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)
        self.packed: torch.Tensor
        self.bias: torch.Tensor | None
        self.attr, self.algorithm = attr, algorithm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            return _scripted_linear().linear(x, self.packed, self.bias, self.attr, self.algorithm)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.attr, [], self.algorithm)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.dtype}, post-op={self.attr}"


@functools.cache
def _scripted_linear() -> Any:
    """The packed linear layer's call compiled by TorchScript, for the tracer: traced from Python, the
    empty list of post-op scalars (``Scalar?[]``) is a value the tracer cannot record; compiled, the
    call is one operator of the trace. Compiled on first use (start-up pays it only when tracing)."""
    return torch.jit.CompilationUnit("""
def linear(x: Tensor, packed: Tensor, bias: Optional[Tensor], attr: str, algorithm: str) -> Tensor:
    scalars: List[Optional[number]] = []
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, scalars, algorithm)
""")


def bf16_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``matmul_attention`` for batches of :data:`MATMUL_ATTENTION_MIN_ROWS` rows or more, the fused
    kernel below that (the batch's row count is a shape: no data-dependent branch)."""
    if q.shape[0] >= MATMUL_ATTENTION_MIN_ROWS:
        return matmul_attention(q, k, v, bias)
    return sdpa_attention(q, k, v, bias)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# A change to a model: (owner, attribute, new value).
_Swap = tuple[Any, str, Any]


def _layer_swaps(model: Any, *, pack: bool, bf16: bool) -> Iterator[_Swap]:
    """What tunes each of a ``GraphSafeBert``'s layers (built as it is applied: packing may raise)."""
    for layer in model.layers:
        if pack:
            fused = FUSED_ACTIVATIONS.get(layer.act_name)
            for name in _PROJECTIONS:
                post = fused if name == "ffn_in" and fused is not None else ("none", "")
                yield layer, name, PackedLinear(getattr(layer, name), *post)
            if fused is not None:
                yield layer, "act", _identity
        if bf16:
            yield layer, "attend", bf16_cpu_attention


def _linear_swaps(model: Any) -> Iterator[_Swap]:
    """Every plain ``nn.Linear`` of any CPU model on packed weights (not subclasses, whose owners may
    read ``.weight``; no activation fused: the module graph is not known here)."""
    sites = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype in (torch.float32, torch.bfloat16)
        and child.weight.device.type == "cpu"
    ]
    for parent, name, child in sites:
        yield parent, name, PackedLinear(child)


def _checked(model: Any, embed: Callable[[Any], np.ndarray], swaps: Iterable[_Swap], *, what: str,
             changes: str) -> Any:
    """``model`` with ``swaps`` applied when every calibration row ``embed`` computes stays within
    :data:`TUNED_MIN_COSINE` of the plain model's; else put back as it was (logged). In place."""
    undo: list[_Swap] = []

    def put_back() -> None:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)

    with torch.inference_mode():
        want = embed(model)
        try:
            for owner, attr, value in swaps:
                undo.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, value)
            if not undo:
                return model
            got = embed(model)
        except Exception as e:  # a oneDNN build, CPU or model code that refuses: the plain model stays
            put_back()
            log.warning("model %s keeps its plain CPU forward: %s failed (%s)", what, changes, e)
            return model
    cosine = min_cosine(got, want)
    if not np.isfinite(cosine) or cosine < TUNED_MIN_COSINE:
        put_back()
        log.warning("model %s keeps its plain CPU forward: with %s its calibration rows moved to cosine "
                    "%.6f of the plain forward's (below %.4f)", what, changes, cosine, TUNED_MIN_COSINE)
        return model
    log.info("model %s runs on the tuned CPU forward (%s); calibration rows' cosine to the plain "
             "forward at least %.7f", what, changes, cosine)
    return model


def tune_cpu_forward(model: Any, embed: Callable[[Any], np.ndarray], *, what: str) -> Any:
    """``model`` (a CPU ``GraphSafeBert``, float32 or bfloat16) tuned in place as this module describes
    when that keeps every calibration row ``embed`` computes within :data:`TUNED_MIN_COSINE` of the
    plain forward's; else as it was (logged). Returns ``model``."""
    bf16 = model.word.weight.dtype == torch.bfloat16
    reason = packing_unavailable(model.word.weight.dtype)
    if reason is not None:
        log.info("model %s keeps plain linear layers: %s", what, reason)
    pack = reason is None
    if not pack and not bf16:
        return model
    changes = ", ".join(
        part for part, on in (("oneDNN-packed linear layers", pack), ("matmul attention", bf16)) if on
    )
    return _checked(model, embed, _layer_swaps(model, pack=pack, bf16=bf16), what=what, changes=changes)


def pack_linear_layers(model: Any, embed: Callable[[Any], np.ndarray], *, what: str) -> Any:
    """Any CPU model (the eager sentence-transformers runner's) with every plain ``nn.Linear`` on
    oneDNN-packed weights, under the same check as :func:`tune_cpu_forward`. In place; returns
    ``model``."""
    dtypes = {p.dtype for p in model.parameters()}
    reason = packing_unavailable(torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32)
    if reason is not None:
        log.info("model %s keeps plain linear layers: %s", what, reason)
        return model
    return _checked(model, embed, _linear_swaps(model), what=what, changes="oneDNN-packed linear layers")


def is_tuned(model: Any) -> bool:
    """Whether :func:`tune_cpu_forward` changed ``model``'s layers."""
    layers = getattr(model, "layers", ())
    return any(isinstance(m, PackedLinear) for m in model.modules()) or any(
        getattr(layer, "attend", sdpa_attention) is not sdpa_attention for layer in layers
    )
