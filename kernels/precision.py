"""Which precision a forward runs in, and the warm-up guard that keeps bfloat16 honest on the CPU.

``--dtype auto`` runs float16 on CUDA (unchanged) and, on the CPU, bfloat16 where the CPU computes it
natively (x86 ``avx512_bf16`` or ``amx_bf16``: Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4
and later; Arm ``bf16``), float32 elsewhere: on those CPUs a BERT forward in bfloat16 is faster (about
1.5× the tuned float32 forward of ``cpu_forward`` on AVX512-BF16 without AMX) at a cosine to float32 of
about 0.9999, while without native support torch emulates it, slower than float32.
``--dtype bfloat16`` forces it anyway (logged when emulated), ``--dtype float32`` forces float32.

A model that bfloat16 does not suit (activations past its 8-bit mantissa, a deep stack that drifts) is
caught at load: :func:`guard_bf16` embeds a few sentences of the calibration corpus in float32 and in
bfloat16 and keeps float32, with a log line, when any row's cosine falls below :data:`BF16_MIN_COSINE`.

Which model families use this: the graph-safe BERT forward and the eager sentence-transformers runner
(embeddings, compared by cosine). Classifiers, cross-encoders and SPLADE stay float32 on the CPU
whatever ``--dtype`` says (their logits and sparse activations are thresholded and compared, where
cosine is no guard); LLM rerankers run bfloat16 on the CPU only when ``--dtype bfloat16`` asks.

Importing this module does not import torch: the torch-free runners ask :func:`native_bf16` too.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger("coalesce.kernels")

# The lowest cosine between a calibration row in bfloat16 and in float32 that keeps a model in bfloat16.
# all-MiniLM-L6-v2 keeps at least 0.99993 on an AMX CPU; a model below 0.999 has lost a significant digit.
BF16_MIN_COSINE = 0.999
# Flags in /proc/cpuinfo that mean bfloat16 arithmetic in hardware (x86: AVX-512 BF16, AMX; Arm: BF16).
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
_CPUINFO = Path("/proc/cpuinfo")

# ``--dtype`` spellings → torch's dtype names.
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def cpu_flags(cpuinfo: str) -> set[str]:
    """Every feature flag of ``/proc/cpuinfo``'s text (x86 ``flags``, Arm ``Features`` lines)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def bf16_flag(cpuinfo: str) -> str | None:
    """The flag in ``/proc/cpuinfo``'s text that says the CPU computes bfloat16 natively (``amx_bf16``,
    ``avx512_bf16`` or Arm's ``bf16``), or None."""
    flags = cpu_flags(cpuinfo)
    return next((f for f in BF16_FLAGS if f in flags), None)


def native_bf16() -> str | None:
    """This CPU's :func:`bf16_flag`, or None (none, or no ``/proc/cpuinfo`` to read)."""
    try:
        return bf16_flag(_CPUINFO.read_text(errors="replace"))
    except OSError:
        return None


def resolve_dtype(dtype: str, device: torch.device, *, cpu_auto_bf16: bool = True) -> torch.dtype:
    """The precision ``--dtype`` asks for on ``device``.

    ``auto``: float16 on CUDA; on the CPU bfloat16 where :func:`native_bf16` finds the hardware (and
    ``cpu_auto_bf16``: the model family takes it), else float32. ``bfloat16`` on the CPU runs bfloat16
    (logged when the CPU only emulates it); ``float16`` on the CPU runs float32 (logged).
    """
    import torch

    if dtype not in ("auto", *DTYPES):
        raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(DTYPES)}")
    if device.type == "cuda":
        return torch.float16 if dtype == "auto" else getattr(torch, DTYPES[dtype])
    if dtype == "auto":
        if not cpu_auto_bf16:
            return torch.float32
        flag = native_bf16()
        if flag is None:
            log.info("dtype auto: this CPU has no native bfloat16 (none of %s in /proc/cpuinfo); "
                     "running float32", ", ".join(BF16_FLAGS))
            return torch.float32
        return torch.bfloat16
    chosen: torch.dtype = getattr(torch, DTYPES[dtype])
    if chosen == torch.float16:
        log.info("dtype %s is for CUDA; running float32 on %s", dtype, device)
        return torch.float32
    if chosen == torch.bfloat16 and native_bf16() is None:
        log.warning("dtype bfloat16 forced on a CPU without native bfloat16: emulated, likely slower "
                    "than float32")
    return chosen


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``, ``float16``, ``bfloat16``: how ``/info`` names the precision a forward runs in."""
    return str(dtype).removeprefix("torch.")


def min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    """The lowest row-wise cosine between two (n, dim) arrays (a zero row against a non-zero one: 0)."""
    a = np.asarray(got, dtype=np.float64)
    b = np.asarray(want, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    cos = np.where(both_zero, 1.0, dots / np.where(norms > 0, norms, 1.0))
    return float(cos.min()) if len(cos) else 1.0


def guard_bf16(model: Any, embed: Callable[[Any], np.ndarray], *, what: str) -> Any:
    """``model`` (float32, on the CPU) in bfloat16 when that keeps every row ``embed`` computes within
    :data:`BF16_MIN_COSINE` of float32, else ``model`` itself, still float32 (logged either way).

    ``embed(m)`` returns float rows of a fixed set of inputs (a few calibration sentences) through
    ``m``; the bfloat16 copy is made from the float32 weights, which are dropped when it passes.
    """

    want = embed(model)
    candidate = _bf16_copy(model)
    got = embed(candidate)
    cosine = min_cosine(got, want)
    if not np.isfinite(cosine) or cosine < BF16_MIN_COSINE:
        log.warning(
            "model %s stays float32: in bfloat16 its calibration rows drift to cosine %.6f, below the "
            "%.4f this service keeps bfloat16 for", what, cosine, BF16_MIN_COSINE,
        )
        return model
    log.info("model %s runs bfloat16 on the CPU (native: %s); calibration rows' cosine to float32 is "
             "at least %.6f", what, native_bf16() or "no, forced", cosine)
    return candidate


def _bf16_copy(model: Any) -> Any:
    """A copy of ``model`` whose floating-point parameters and buffers are bfloat16, made tensor by
    tensor (no second float32 copy of the weights on the way)."""
    import torch

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.to(torch.bfloat16) if b.is_floating_point() else b.clone()
    return copy.deepcopy(model, memo).to(torch.bfloat16)


def guard_sentences() -> list[str]:
    """The sentences :func:`guard_bf16` checks: two of each calibration topic (16 rows)."""
    from .calibration import TOPICS

    return [s for sentences in TOPICS.values() for s in sentences[:2]]


def to_precision(model: Any, dtype: str, device: torch.device, embed: Callable[[Any], np.ndarray],
                 *, what: str) -> Any:
    """``model`` (float32, CPU-resident) on ``device`` in the precision ``--dtype`` resolves to there;
    bfloat16 on the CPU only past :func:`guard_bf16`. CUDA: converted as asked, no guard."""
    import torch

    chosen = resolve_dtype(dtype, device)
    if device.type == "cpu" and chosen == torch.bfloat16:
        with torch.no_grad():
            return guard_bf16(model, embed, what=what)
    return model.to(device=device, dtype=chosen)
