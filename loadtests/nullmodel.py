"""``coalesce serve`` with the model's forward replaced by a constant: what the service itself costs.

    coalesce serve --runner-factory coalesce.loadtests.nullmodel:factory [other serve flags]
    python -m coalesce.loadtests.nullmodel [serve flags]          # the same

Everything a request goes through is the real service — HTTP, validation, the packaged model's
tokenizer, admission, the batcher, the worker threads, metrics, response encoding; with ``--workers N``
also the engine process and the sockets between them — except the forward, which hands back the same
unit vector for every input at no cost. The bench's ``gateway`` and ``engine`` sections measure CPU per
request with it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from coalesce.kernels.protocol import ModelInfo, Tokens


class NullForward:
    """A runner's tokenizer, padding and facts, with a forward that costs nothing."""

    capture_stats = None

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.info: ModelInfo = dataclasses.replace(inner.info, token_embeddings=False)  # pooled rows only
        self.tokens: Tokens = inner.tokens
        self.device = "cpu"
        row = np.ones(self.info.dim, dtype=np.float32)
        self._rows = np.tile(row / np.linalg.norm(row), (4096, 1))

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


def factory(spec: Any) -> NullForward:
    """``--runner-factory coalesce.loadtests.nullmodel:factory``: the model's tokenizer, a free forward."""
    from coalesce.kernels.loader import RunnerOptions, load_runner

    # The forward never runs, so nothing is done at load to make it faster: no bfloat16 guard, no tuned
    # CPU forward, no trace (each a few forwards of the real model: 0.5 s a load of the packaged one, 0.05 s
    # without; the model's facts, tokenizer and padding are the same either way).
    options = RunnerOptions(device="cpu", dtype="float32", cpu_fast_forward=False, cpu_traced_forward=False)
    return NullForward(load_runner(spec.path, spec.name, options, task=spec.task))


def main(argv: Sequence[str] | None = None) -> int:
    from coalesce.service.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    # By its full name: under `python -m` this module is `__main__`, which the allocator's re-exec of
    # `coalesce.service.cli` is not.
    return cli_main(["serve", *args, "--runner-factory", "coalesce.loadtests.nullmodel:factory"])


if __name__ == "__main__":
    raise SystemExit(main())
