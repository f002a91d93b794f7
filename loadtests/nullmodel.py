"""``coalesce serve`` with the model's forward replaced by a constant: what the gateway itself costs.

    python -m coalesce.loadtests.nullmodel --host 127.0.0.1 --port 8080 [other serve flags]

Everything a request goes through is the real service — HTTP, validation, the packaged model's
tokenizer, admission, the batcher, the worker threads, metrics, response encoding — except the forward,
which hands back the same unit vector for every input at no cost. The bench's ``gateway`` section
measures its CPU per request beside the aiohttp stub (``stub.py``), which only parses the request and
answers a canned body: the difference is what Coalesce adds per request, and its reciprocal is the
most requests per second one process can take on one core, whatever the model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from coalesce.kernels.protocol import ModelInfo


class NullForward:
    """A runner's tokenizer, padding and facts, with a forward that costs nothing."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.info: ModelInfo = inner.info
        row = np.ones(self.info.dim, dtype=np.float32)
        self._rows = np.tile(row / np.linalg.norm(row), (4096, 1))

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return list(self._inner.tokenize(texts))

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return list(self._inner.with_special_tokens(ids))

    def padded_cost(self, n: int, max_len: int) -> int:
        return int(self._inner.padded_cost(n, max_len))

    def prepare(self, batch: Sequence[Sequence[int]]) -> int:
        return len(batch)

    def forward(self, prepared: int) -> int:
        return prepared

    def finish(self, output: int, prepared: int) -> np.ndarray:
        return self._rows[:output]

    def warmup(self) -> None:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    from coalesce.kernels.loader import RunnerOptions, load_runner
    from coalesce.service import settings as settings_mod
    from coalesce.service.gateway.server import run
    from coalesce.service.logs import configure

    settings = settings_mod.build(list(sys.argv[1:] if argv is None else argv))
    if settings.workers != 1:
        raise SystemExit("the null model serves one process (--workers 1)")
    configure(settings.log_level, settings.log_format)
    options = RunnerOptions(device="cpu")
    return run(settings, runner_factory=lambda spec: NullForward(load_runner(spec.path, spec.name, options)))


if __name__ == "__main__":
    raise SystemExit(main())
