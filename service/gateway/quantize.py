"""Compact embedding types: sentence-transformers' binary ones, and int8/uint8 that rank like float.

``ubinary``: the sign bits, 8 dimensions per byte (``np.packbits(rows > 0)``); ``binary``: the same
bytes as int8, minus 128 (both exactly as sentence-transformers' ``quantize_embeddings``). ``int8``:
``round(x / scale)`` clipped to ±127, one symmetric scale per model and width from the calibration corpus
(``kernels.calibration.int8_scale``: embedded once at warm-up, or stored with an export), so zero stays
zero, an integer dot product ranks like the float one, and a text's bytes never depend on the other texts
of its request. ``uint8``: int8 + 128, for stores that want unsigned bytes; shift it back (subtract 128)
before a dot product. ``base64``: the float32 bytes.
"""

from __future__ import annotations

import base64

import numpy as np
from coalesce.kernels.calibration import INT8_MAX

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
CALIBRATED = frozenset({"int8", "uint8"})


def quantize(rows: np.ndarray, kind: str, scale: float | None = None) -> np.ndarray:
    """``rows`` (n × dim, float) as ``kind`` (one of ``EMBEDDING_TYPES`` but float and base64);
    int8/uint8 need ``scale`` (one int8 step, > 0)."""
    x = np.asarray(rows, dtype=np.float32)
    if kind in ("ubinary", "binary"):
        packed = np.packbits(x > 0, axis=-1)
        return packed if kind == "ubinary" else (packed.astype(np.int16) - 128).astype(np.int8)
    if kind in CALIBRATED:
        if scale is None or not scale > 0:
            raise ValueError(f"{kind} needs a positive calibration scale, got {scale!r}")
        q = np.clip(np.rint(x / np.float32(scale)), -INT8_MAX, INT8_MAX).astype(np.int16)
        return (q + 128).astype(np.uint8) if kind == "uint8" else q.astype(np.int8)
    raise ValueError(f"unknown embedding type {kind!r}")


def base64_rows(rows: np.ndarray) -> list[str]:
    """Each row's little-endian float32 bytes, base64-encoded (what Cohere's and OpenAI's base64 are)."""
    x = np.ascontiguousarray(rows, dtype="<f4")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in x]
