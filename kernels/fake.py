"""A deterministic runner with no model, for tests of everything above the runner.

Each input's vector depends on its token ids alone, so a test can compute what any caller must get back
(``expected``) and catch results fanned out to the wrong caller. ``service_time`` makes the forward take
``a + b × padded tokens`` seconds; ``fail_token`` makes any batch containing that id raise.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .protocol import ModelInfo, Task


@dataclass
class FakeRunner:
    info: ModelInfo = field(
        default_factory=lambda: ModelInfo(name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8)
    )
    batch_seconds: float = 0.0  # a: fixed cost of one forward
    token_seconds: float = 0.0  # b: cost per padded token
    fail_token: int | None = None
    batches: list[int] = field(default_factory=list)  # sizes of the batches run, for assertions

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [
            [1 + zlib.crc32(w.encode()) % (self.info.vocab_size - 1) for w in t.split()] or [1] for t in texts
        ]

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return [0, *ids[: self.info.max_tokens - 2], 0]

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        return [list(s) for s in batch]

    def forward(self, prepared: list[list[int]]) -> list[list[int]]:
        self.batches.append(len(prepared))
        if self.fail_token is not None and any(self.fail_token in s for s in prepared):
            raise RuntimeError("injected runner failure")
        cost = self.batch_seconds + self.token_seconds * len(prepared) * max(len(s) for s in prepared)
        if cost > 0:
            time.sleep(cost)
        return prepared

    def finish(self, output: list[list[int]], prepared: list[list[int]]) -> np.ndarray:
        return np.stack([self.vector(s) for s in output])

    def warmup(self) -> None:
        return None

    def vector(self, seq: Sequence[int]) -> np.ndarray:
        seed = zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes())
        v = np.random.default_rng(seed).standard_normal(self.info.dim).astype(np.float32)
        out: np.ndarray = v / np.linalg.norm(v)
        return out

    def expected(self, text: str) -> np.ndarray:
        """The vector a caller must receive for ``text``."""
        return self.vector(self.with_special_tokens(self.tokenize([text])[0]))
