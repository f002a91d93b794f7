"""Compact embedding types, exactly as sentence-transformers' ``quantize_embeddings`` defines them.

``ubinary``: the sign bits, 8 dimensions per byte (``np.packbits(rows > 0)``); ``binary``: the same
bytes as int8, minus 128. ``int8``/``uint8``: each dimension cut into 255 steps between that dimension's
minimum and maximum over a calibration set (the engine's built-in corpus, embedded once at warm-up, so
a text's bytes never depend on the other texts of its request). ``base64``: the float32 bytes.
"""

from __future__ import annotations

import base64

import numpy as np

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
CALIBRATED = frozenset({"int8", "uint8"})


def quantize(rows: np.ndarray, kind: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """``rows`` (n × dim, float) as ``kind`` (one of ``EMBEDDING_TYPES`` but float and base64);
    int8/uint8 need ``ranges`` (2 × dim: per-dimension minimum, maximum)."""
    x = np.asarray(rows, dtype=np.float32)
    if kind in ("ubinary", "binary"):
        packed = np.packbits(x > 0, axis=-1)
        return packed if kind == "ubinary" else (packed.astype(np.int16) - 128).astype(np.int8)
    if kind in CALIBRATED:
        if ranges is None:
            raise ValueError(f"{kind} needs calibration ranges")
        starts = ranges[0].astype(np.float32)
        steps = (ranges[1].astype(np.float32) - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        q = np.clip(np.floor((x - starts) / steps), 0, 255)
        return q.astype(np.uint8) if kind == "uint8" else (q - 128).astype(np.int8)
    raise ValueError(f"unknown embedding type {kind!r}")


def base64_rows(rows: np.ndarray) -> list[str]:
    """Each row's little-endian float32 bytes, base64-encoded (what Cohere's and OpenAI's base64 are)."""
    x = np.ascontiguousarray(rows, dtype="<f4")
    return [base64.b64encode(row.tobytes()).decode("ascii") for row in x]
