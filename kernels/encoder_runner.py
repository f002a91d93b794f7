"""The graph runner: BERT-family sentence-transformers models on the graph-safe forward.

On CUDA each batch is padded up to its cell of the bucket grid (or, past the grid's largest batch, to
its sequence bucket) and, with graphs on, replayed from a captured graph; batches outside the grid, in a
cell the capture budget left out, or with graphs off run the same forward eagerly at that padded shape.
Eager batches keep to bucket shapes on CUDA because the attention torch picks there for half
precision (cuDNN's, on sm90) builds a plan per distinct shape: tens of milliseconds of host time each,
cached without bound, so exact shapes would pay it again and again. Rows past the batch are fully
padded (length 0: the forward keeps them finite) and dropped. On CPU the forward runs at the batch's
own shape (n × longest), where padding is only wasted work. float16 is for CUDA; the CPU runs bfloat16
where it has it natively and the model passes the warm-up guard, float32 otherwise (``precision``).

Output is the model's full width (or its fixed ``truncate_dim``), L2-normalised when the model's
pipeline normalises: per-request ``dimensions`` stay with the gateway, which truncates and
re-normalises on the host, so one set of graphs serves every width. Graphs hold the pooled rows; the
normalisation runs after them, on the device, and skips rows marked ``raw`` (windows of a long input,
which the gateway pools together before it normalises), so windows share batches and graphs with
everything else.

``build_encoder_runner`` returns None, with a log line, for models outside the BERT family or with
a module pipeline this forward does not reproduce; the caller then uses the eager runner. It loads
through sentence-transformers; ``fastload.build_fast_encoder_runner`` builds the same runner from the
model directory's files without importing transformers (the cold-start path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .bert import GraphSafeBert, PoolingMode, unsupported_reason
from .buckets import BucketGrid, Cell, GraphOptions, pad_to_shape
from .cpu_forward import tune_cpu_forward
from .graphs import CaptureStats, CudaGraphs
from .precision import dtype_name, guard_sentences, to_precision
from .protocol import ModelInfo, Task, is_raw
from .st_config import prompt_fields
from .st_runner import model_name_from_path, resolve_device
from .tokens import TokenizerAdapter
from .traced_forward import Pool, trace_pool

log = logging.getLogger("coalesce.kernels")

@dataclass(frozen=True, slots=True)
class EncoderBatch:
    """A batch padded on the host: ``ids`` (rows, cols) and ``lengths`` (rows,), int64 CPU tensors."""

    ids: torch.Tensor
    lengths: torch.Tensor
    n: int  # real rows; rows past n are padding and never reach the results
    max_len: int  # longest real sequence
    cell: Cell | None  # the grid cell the batch is padded to (CUDA); None: outside the grid, or CPU
    raw: torch.Tensor | None = None  # (n,) bool: rows to leave unnormalised; None: none of them


class EncoderEngine:
    """Pads, runs and unpads batches of token ids through a ``GraphSafeBert``.

    ``prepare`` and ``padded_cost`` may run on any thread; ``forward``, ``finish`` and ``warmup`` on
    the model thread only (it owns the device, the graphs and their pool).
    """

    def __init__(
        self,
        model: GraphSafeBert,
        *,
        device: torch.device,
        max_tokens: int,
        pad_id: int,
        graphs: GraphOptions,
        cpu_pool: Pool | None = None,
    ) -> None:
        self.model = model
        self.cpu_pool = cpu_pool  # the model's pool traced (traced_forward); None: the Python forward
        self.device = device
        self.max_tokens = max_tokens
        self.pad_id = pad_id
        self.grid: BucketGrid | None = None
        self._graphs: CudaGraphs | None = None
        if device.type == "cuda":
            self.grid = BucketGrid.build(max_tokens, graphs.batch_sizes, graphs.seq_lens)
        if graphs.enabled and self.grid is not None:
            self._graphs = CudaGraphs(
                model.pool,
                device,
                pad_id=pad_id,
                budget_s=graphs.budget_s,
                budget_bytes=graphs.budget_bytes,
                lazy=graphs.lazy,
            )
        self.capture_stats: CaptureStats = self._graphs.stats if self._graphs else CaptureStats()

    @property
    def forward_releases_lock(self) -> bool:
        """Whether the forward holds no interpreter lock from call to return: a traced CPU forward runs in
        TorchScript's interpreter, so forwards side by side wait for nothing (``worker.cpu_forwards``).
        Read from ``cpu_pool``, which a copy may drop (``loadtests/lock_contention.py``)."""
        return self.cpu_pool is not None and self.device.type == "cpu"

    def padded_shape(self, n: int, max_len: int) -> tuple[int, int]:
        """The (rows, cols) a batch of ``n`` sequences (longest ``max_len``) runs at: its cell of the
        grid on CUDA (rows past the grid stay ``n``), else ``n × max_len``."""
        if self.grid is not None:
            return self.grid.padded_shape(n, max_len)
        return n, max_len

    def padded_cost(self, n: int, max_len: int) -> int:
        """Padded tokens the batch runs: its padded shape's area on CUDA, else ``n × max_len``."""
        if self.grid is not None:
            return self.grid.padded_cost(n, max_len)
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> EncoderBatch:
        """Pad to the batch's cell of the grid (CUDA) or to its own longest sequence (CPU)."""
        n = len(batch)
        max_len = max((len(seq) for seq in batch), default=0)
        cell: Cell | None = None
        if self.grid is not None:
            rows, cols = self.grid.padded_shape(n, max_len)
            cell = self.grid.cell(n, max_len)
        else:
            rows, cols = n, max_len
        ids, lengths = pad_to_shape(batch, rows, cols, self.pad_id)
        raw = [is_raw(seq) for seq in batch]
        return EncoderBatch(torch.from_numpy(ids), torch.from_numpy(lengths), n, max_len, cell,
                            torch.tensor(raw) if any(raw) else None)

    def forward(self, prepared: EncoderBatch) -> torch.Tensor:
        """Embeddings of the real rows, on the device (a copy: later replays cannot overwrite it)."""
        with torch.inference_mode():
            return self._normalized(self._pooled(prepared), prepared)

    def _pooled(self, prepared: EncoderBatch) -> torch.Tensor:
        if self._graphs is not None and prepared.cell is not None:
            out = self._graphs.run(prepared.cell, prepared.ids, prepared.lengths, prepared.n)
            if out is not None:
                return out
        self.capture_stats.eager_runs += 1
        ids = prepared.ids.to(self.device, non_blocking=True)
        lengths = prepared.lengths.to(self.device, non_blocking=True)
        pool = self.model.pool if self.cpu_pool is None else self.cpu_pool
        return pool(ids, lengths)[: prepared.n]

    def _normalized(self, pooled: torch.Tensor, prepared: EncoderBatch) -> torch.Tensor:
        """The model's L2 normalisation (when it has one) of every row but the ``raw`` ones."""
        if not self.model.normalize:
            return pooled
        unit = F.normalize(pooled, p=2.0, dim=-1)
        if prepared.raw is None:
            return unit
        return torch.where(prepared.raw.to(self.device, non_blocking=True).unsqueeze(1), pooled, unit)

    def finish(self, output: torch.Tensor, prepared: EncoderBatch) -> np.ndarray:
        """float32 (n, dim) on the host."""
        rows = np.ascontiguousarray(output.float().cpu().numpy())
        if rows.shape != (prepared.n, self.model.dim):
            raise AssertionError(f"runner produced {rows.shape}, expected ({prepared.n}, {self.model.dim})")
        return rows

    def forward_tokens(self, prepared: EncoderBatch) -> torch.Tensor:
        """Every real token's hidden state, ``(sum of lengths, hidden)`` on the device; always eager
        at the batch's own shape (graphs hold pooled outputs only)."""
        with torch.inference_mode():
            n, m = prepared.n, prepared.max_len
            ids = prepared.ids[:n, :m].to(self.device, non_blocking=True)
            lengths = prepared.lengths[:n].to(self.device, non_blocking=True)
            return self.model.token_embeddings(ids, lengths)

    def finish_tokens(self, output: torch.Tensor, prepared: EncoderBatch) -> np.ndarray:
        """float32 ``(sum of lengths, hidden)`` on the host."""
        rows = np.ascontiguousarray(output.float().cpu().numpy())
        expected = int(prepared.lengths[: prepared.n].sum())
        if rows.shape[0] != expected:
            raise AssertionError(f"runner produced {rows.shape[0]} token rows, expected {expected}")
        return rows

    def warmup(self) -> None:
        """Capture the grid within its budgets (CUDA graphs), else run two representative batches."""
        if self._graphs is not None and self.grid is not None:
            with torch.inference_mode():
                self._graphs.capture_grid(self.grid.cells())
            return
        with torch.inference_mode():
            for n, length in ((1, min(16, self.max_tokens)), (8, min(128, self.max_tokens))):
                rows, cols = self.grid.padded_shape(n, length) if self.grid is not None else (n, length)
                ids = torch.full((rows, cols), self.pad_id, dtype=torch.int64, device=self.device)
                lengths = torch.full((rows,), cols, dtype=torch.int64, device=self.device)
                self.model(ids, lengths).cpu()


class EncoderRunner(EncoderEngine):
    """The ``Runner`` for BERT-family sentence-transformers models: tokenizer + ``EncoderEngine``."""

    def __init__(
        self,
        model: GraphSafeBert,
        tokens: TokenizerAdapter,
        info: ModelInfo,
        *,
        device: torch.device,
        graphs: GraphOptions,
        cpu_pool: Pool | None = None,
    ) -> None:
        super().__init__(
            model, device=device, max_tokens=tokens.max_tokens, pad_id=tokens.pad_id, graphs=graphs,
            cpu_pool=cpu_pool,
        )
        self.tokens = tokens
        self.info = info

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokens.tokenize(texts)

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return self.tokens.with_special_tokens(ids)


def build_encoder_runner(
    model_path: str,
    *,
    name: str | None,
    device: str = "auto",
    dtype: str = "auto",
    graphs: GraphOptions = GraphOptions(),  # noqa: B008 (frozen, so one shared default is safe)
    truncate_dim: int | None = None,
    aliases: Sequence[str] = (),
    cpu_fast_forward: bool = True,
    cpu_traced_forward: bool = True,
) -> EncoderRunner | None:
    """The graph runner for the sentence-transformers model at ``model_path``, or None (logged) when
    the model is outside what the graph-safe forward reproduces and the eager runner should serve it."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_path, device="cpu", local_files_only=True)
    plan = _pipeline_plan(st)
    if isinstance(plan, str):
        log.info("model %s runs on the eager sentence-transformers forward: %s", model_path, plan)
        return None
    transformer, pooling, normalize = plan
    dev = torch.device(resolve_device(device))
    model = GraphSafeBert.from_hf(
        transformer.auto_model, pooling=pooling, normalize=normalize, truncate_dim=truncate_dim
    )
    max_tokens = min(int(st.max_seq_length or st.tokenizer.model_max_length), model.max_positions)
    tokens = TokenizerAdapter(st.tokenizer, max_tokens)
    model = place_model(model, tokens, dtype, dev, what=model_path, cpu_fast_forward=cpu_fast_forward)
    return make_encoder_runner(
        model, tokens, model_path=model_path, name=name, aliases=aliases, device=dev, graphs=graphs,
        cpu_traced_forward=cpu_traced_forward,
    )


def place_model(
    model: GraphSafeBert, tokens: TokenizerAdapter, dtype: str, device: torch.device, *, what: str,
    cpu_fast_forward: bool = True,
) -> GraphSafeBert:
    """``model`` (float32 on the CPU, as loaded) on ``device`` in the precision ``--dtype`` resolves to;
    on the CPU, bfloat16 only when the calibration rows it embeds stay within the guard's cosine, then
    (``cpu_fast_forward``) on ``cpu_forward``'s faster CPU forward when those rows stay put."""

    def embedding(sentences: list[str]) -> Callable[[GraphSafeBert], np.ndarray]:
        def embed(m: GraphSafeBert) -> np.ndarray:  # tokenised only when called (CUDA never is)
            seqs = [tokens.with_special_tokens(ids) for ids in tokens.tokenize(sentences)]
            ids, lengths = pad_to_shape(seqs, len(seqs), max(map(len, seqs)), tokens.pad_id)
            return m(torch.from_numpy(ids), torch.from_numpy(lengths)).float().numpy()

        return embed

    sentences = guard_sentences()
    model = to_precision(model, dtype, device, embedding(sentences), what=what)
    if device.type == "cpu" and cpu_fast_forward:
        # A quarter of the guard's rows, one per topic pair: enough rows for the bf16 matmul-attention
        # path (4), at a quarter of the start-up time the check costs (two forwards at load).
        model = tune_cpu_forward(model, embedding(sentences[::4]), what=what)
    return model


def make_encoder_runner(
    model: GraphSafeBert,
    tokens: TokenizerAdapter,
    *,
    model_path: str,
    name: str | None,
    aliases: Sequence[str],
    device: torch.device,
    graphs: GraphOptions,
    cpu_traced_forward: bool = True,
) -> EncoderRunner:
    """The runner over a built model (already on ``device``) and tokenizer, with its ``ModelInfo``;
    on the CPU (``cpu_traced_forward``) with its forward traced when that holds (``traced_forward``).

    Shared by ``build_encoder_runner`` and ``fastload.build_fast_encoder_runner``, so both describe a
    model the same way whichever loader read it.
    """
    info = ModelInfo(
        name=name or model_name_from_path(model_path),
        task=Task.EMBED,
        max_tokens=tokens.max_tokens,
        vocab_size=tokens.vocab_size,
        dim=model.dim,
        normalized=model.normalize,
        aliases=tuple(aliases),
        **prompt_fields(model_path),
        dtype=dtype_name(model.word.weight.dtype),
        token_embeddings=True,
        raw_rows=True,
    )
    log.info("model %s runs on the graph-safe BERT forward (%s, %s)", model_path, device,
             model.word.weight.dtype)
    cpu_pool = trace_pool(model, what=model_path) if cpu_traced_forward and device.type == "cpu" else None
    return EncoderRunner(model, tokens, info, device=device, graphs=graphs, cpu_pool=cpu_pool)


def _pipeline_plan(st: Any) -> tuple[Any, PoolingMode, bool] | str:
    """(transformer module, pooling, normalize) when the module pipeline is Transformer → Pooling
    (mean or CLS) → optional Normalize over a supported BERT; else the reason it is not."""
    modules = list(st)
    kinds = [type(m).__name__ for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        return f"module pipeline {kinds}"
    transformer, pool = modules[0], modules[1]
    reason = unsupported_reason(getattr(transformer, "auto_model", None))
    if reason is not None:
        return reason
    if not getattr(pool, "include_prompt", True):
        return "pooling leaves the prompt out (include_prompt: false)"
    mode = getattr(pool, "pooling_mode", None)
    if not isinstance(mode, str) and hasattr(pool, "get_pooling_mode_str"):  # sentence-transformers < 6
        mode = pool.get_pooling_mode_str()
    if mode not in ("mean", "cls"):
        return f"pooling {mode!r}"
    return transformer, mode, len(modules) == 3
