"""The CPU forward traced to TorchScript: a whole forward run without Python's interpreter lock.

The server runs each forward on a thread of its own beside the event loop's. Run from Python, the
forward drops the interpreter lock inside each operator and takes it back between them. While the
event loop runs Python without pause (a flood being refused, an engine reading many gateways'
messages) each take-back waits for the loop to be asked to drop it (``--switch-interval-ms``), and the
forward's thread sits idle, off the CPU, for as long.
Traced, the same operators run in TorchScript's interpreter, which holds no interpreter lock from the
call's start to its end: one take-back per forward instead of one per operator.
``python -m coalesce.loadtests.lock_contention`` times both beside a busy thread (BENCHMARKS.md).

* **The same function.** ``torch.jit.trace`` records the operators ``GraphSafeBert.pool`` runs,
  with every shape taken from the inputs' (batch rows and sequence length stay free). The one choice the
  forward makes in Python on a shape is ``cpu_forward``'s attention by the batch's row count, so it is
  traced twice, at one row and at :data:`~.cpu_forward.MATMUL_ATTENTION_MIN_ROWS`, and each batch runs
  the trace of its own side. Nothing is taken on trust: both traces embed ragged batches of each side
  and are kept only when every row matches the Python forward's (within ``TUNED_MIN_COSINE``; in
  practice bit for bit, the same kernels in the same order); otherwise, or when tracing raises, the
  Python forward stays, with a log line.
* **Run as traced.** The traces run with TorchScript's graph optimiser off
  (``torch.jit.optimized_execution(False)``, per calling thread): the profiling executor would
  specialise each graph on the shapes of its first batches and fall back on others, and the batches of
  an embedding service change shape every time.
* **Where.** The graph-safe encoder on the CPU, tuned or plain, float32 or bfloat16 (CUDA replays
  captured graphs, which hold no lock either). Token embeddings (``output: token_embeddings``) keep the
  Python forward: their output's size depends on the lengths. ``--no-cpu-traced-forward`` turns it off.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .cpu_forward import MATMUL_ATTENTION_MIN_ROWS, TUNED_MIN_COSINE
from .precision import min_cosine

log = logging.getLogger("coalesce.kernels")

Pool = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The ragged batches the traces are checked on, (rows, longest tokens), each side of the attention's split.
CHECK_SHAPES: tuple[tuple[int, int], ...] = (
    (1, 9), (MATMUL_ATTENTION_MIN_ROWS - 1, 23), (MATMUL_ATTENTION_MIN_ROWS, 17), (13, 41),
)


class TracedPool:
    """``pool(input_ids, lengths)`` on the trace of the batch's side of the attention's split."""

    __slots__ = ("few", "many")

    def __init__(self, few: Any, many: Any) -> None:
        self.few, self.many = few, many  # traced at 1 row, and at MATMUL_ATTENTION_MIN_ROWS rows

    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        traced = self.many if input_ids.shape[0] >= MATMUL_ATTENTION_MIN_ROWS else self.few
        with torch.jit.optimized_execution(False):
            out: torch.Tensor = traced(input_ids, lengths)
        return out


def ragged_batch(rows: int, longest: int, vocab: int, g: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random ids (``rows``, ``longest``) and their lengths, the first row ``longest`` long
    and the others from 1 up (as the service pads a batch: to its own longest row)."""
    lengths = torch.randint(1, longest + 1, (rows,), generator=g)
    lengths[0] = longest
    ids = torch.randint(1, vocab, (rows, longest), generator=g)
    ids[torch.arange(longest).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    return ids, lengths


def trace_pool(model: Any, *, what: str) -> TracedPool | None:
    """``model.pool`` (a CPU ``GraphSafeBert``) traced as this module describes, or None (logged) when
    tracing raises or a checked row moves; the caller keeps ``model.pool`` then."""
    t0 = time.perf_counter()
    vocab, positions = model.word.num_embeddings, model.max_positions
    g = torch.Generator().manual_seed(0)
    try:
        # (The tracer warns of the attention's choice on the row count, the reason there are two traces;
        # and that TorchScript is deprecated: torch 2.13 runs it, and a torch that does not lands in the
        # fallback below.)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            few, many = (
                torch.jit.trace_module(model, {"pool": ragged_batch(rows, min(8, positions), vocab, g)},
                                       check_trace=False)
                .pool for rows in (1, MATMUL_ATTENTION_MIN_ROWS)
            )
            traced = TracedPool(few, many)
            checks = [ragged_batch(rows, min(longest, positions), vocab, g) for rows, longest in CHECK_SHAPES]
            got = [traced(ids, lengths).float().numpy() for ids, lengths in checks]
            want = [model.pool(ids, lengths).float().numpy() for ids, lengths in checks]
    except Exception as e:  # an operator or module the tracer cannot record: the Python forward stays
        log.warning("model %s keeps its Python CPU forward: tracing it failed (%s)", what, e)
        return None
    cosine = min_cosine(np.concatenate(got), np.concatenate(want))
    if not np.isfinite(cosine) or cosine < TUNED_MIN_COSINE:
        log.warning("model %s keeps its Python CPU forward: its traced forward's rows moved to cosine %.6f "
                    "(below %.4f)", what, cosine, TUNED_MIN_COSINE)
        return None
    log.info("model %s runs its CPU forward traced, without the interpreter lock (%.3f s; rows' cosine to "
             "the Python forward at least %.7f)", what, time.perf_counter() - t0, cosine)
    return traced
