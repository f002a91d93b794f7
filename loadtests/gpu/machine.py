"""What a check run says of the machine its figures come from: device, versions, attention backends."""

from __future__ import annotations

import importlib.metadata
import platform

import torch


def sdpa_backends(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str:
    """The scaled-dot-product attention backends torch has enabled, their priority order, and the one
    it picks for this forward's attention (its dtype, head size, additive mask) at a small and a large
    shape. Each part is left out where this torch lacks the call: ``torch.backends.cuda.
    {flash,mem_efficient,math}_sdp_enabled`` (public, torch >= 2.0), ``cudnn_sdp_enabled`` (public,
    newer), ``torch._C._get_sdp_priority_order`` (private; 2.13 installed here has it) and
    ``torch._fused_sdp_choice`` (private; the dispatcher's own choice, torch >= 2.0)."""
    from torch.nn.attention import SDPBackend

    def name(value: int) -> str:
        try:
            return str(SDPBackend(value).name)
        except (TypeError, ValueError):
            return str(value)

    parts = []
    enabled = [kind for kind in ("flash", "mem_efficient", "math", "cudnn")
               if (fn := getattr(torch.backends.cuda, f"{kind}_sdp_enabled", None)) is not None and fn()]
    parts.append("enabled " + ",".join(enabled))
    priority = getattr(torch._C, "_get_sdp_priority_order", None)
    if priority is not None:
        parts.append("priority " + ">".join(name(v) for v in priority()))
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is not None:
        picked = []
        for b, s in ((1, 16), (64, 128)):
            q = torch.zeros(b, heads, s, head_dim, device=device, dtype=dtype)
            mask = torch.zeros(b, 1, 1, s, device=device, dtype=dtype)
            try:
                picked.append(f"{b}×{s} {name(int(choose(q, q, q, mask)))}")
            except RuntimeError as exc:
                picked.append(f"{b}×{s} none ({str(exc).splitlines()[0]})")
        parts.append("picked for this forward: " + ", ".join(picked))
    return "; ".join(parts)


def versions() -> str:
    found = []
    for package in ("transformers", "sentence-transformers"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{package} missing")
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    return f"python {platform.python_version()}; torch {torch.__version__}{cuda}; " + "; ".join(found)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"
