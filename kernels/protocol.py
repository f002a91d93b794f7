"""The runner protocol: what the batcher needs from an execution engine.

A runner works in three steps, each on plain data:

* ``prepare`` (CPU, any thread but the model thread may be busy meanwhile): pad token ids to the
  shape the forward wants and build tensors;
* ``forward`` (the model thread only): run the model;
* ``finish`` (the model thread only): pool, normalise, copy to host, drop padded rows.

Tokenisation happens before batching, in the gateway, through the runner's ``tokens`` (a
:class:`Tokens`): the batcher needs true token counts to form batches under a token budget, and a
gateway process tokenises with the engine's own tokenizer without loading the model. Nothing here
imports torch, so the gateway and the batching policy can depend on this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from .graphs import CaptureStats
    from .tokens import TokenizerSpec


class Task(StrEnum):
    """What a served model does with a batch of token sequences."""

    EMBED = "embed"
    CLASSIFY = "classify"
    RERANK = "rerank"
    SPARSE = "sparse"  # SPLADE: one weight per vocabulary entry, most of them zero


class OutputKind(StrEnum):
    """What a request asks the runner for, per input.

    ``POOLED``: one row per input (a sentence embedding, or a classifier's logits). ``TOKENS``: one row
    per token of the input, special tokens included and padding never (TEI's ``/embed_all``); only
    runners whose ``ModelInfo.token_embeddings`` is set can answer it (:class:`TokenRunner`). Inputs of
    different kinds never share a batch.
    """

    POOLED = "pooled"
    TOKENS = "tokens"


RERANK_TEMPLATE_FILE = "rerank_template.json"  # an LLM reranker's template, in its model directory


@dataclass(frozen=True, slots=True)
class RerankTemplate:
    """How an LLM reranker (Qwen3-Reranker style) reads a (query, document) pair, as its model card does.

    A pair's ids are ``prefix``'s, then ``pair`` formatted with the instruction, query and document and
    tokenised as one text with the tokenizer's special tokens, then ``suffix``'s (prefix and suffix are
    tokenised alone). The runner reads the logits of the ``yes`` and ``no`` tokens at the last position:
    the score is P(yes) over the two, i.e. sigmoid(yes − no); with ``no`` None, sigmoid(yes).
    """

    prefix: str
    suffix: str
    pair: str  # holds {query} and {document} (once), and may hold {instruction}
    instruction: str  # the instruction a request that sends none gets (unless --rerank-instruction)
    yes: str = "yes"
    no: str | None = "no"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Static facts about a loaded model that the gateway validates against."""

    name: str
    task: Task
    max_tokens: int  # longest sequence the model accepts, special tokens included
    vocab_size: int
    dim: int  # embedding width (embed) or number of output scores (classify, rerank)
    labels: tuple[str, ...] = ()
    normalized: bool = True  # whether embeddings come out L2-normalised
    aliases: tuple[str, ...] = field(default_factory=tuple)
    # classify/rerank: how the gateway turns the logits a runner returns into scores
    # ("softmax", "sigmoid" or "none"), as the model's config asks.
    activation: str = "none"
    # sentence-transformers prompts (name → text put in front of a text), the one applied when a
    # request names none, and whether pooling includes the prompt's tokens (see kernels/st_config.py)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True
    dtype: str = "float32"  # the precision the forward runs in: float32, float16 or bfloat16
    token_embeddings: bool = False  # the runner answers OutputKind.TOKENS (a TokenRunner)
    # rerank by an LLM: the gateway formats each pair with this template (None: a cross-encoder's pair)
    rerank_template: RerankTemplate | None = None
    # the runner answers a sequence marked ``raw`` (a window of a long input) with its pooled vector
    # before the model's normalisation, so the gateway can pool windows as one long forward would
    raw_rows: bool = False


class MarkedIds(list[int]):
    """A complete id sequence with what its runner must know: where a text pair's second segment
    starts (segment ids), where pooling starts (a prompt the model's pooling leaves out), and whether
    its row comes back ``raw``: pooled but not normalised (a window of a long input, which the gateway
    pools with its other windows and normalises once; only runners with ``ModelInfo.raw_rows``).

    A plain list to everything above the runner, so it flows through the batcher as ``Sequence[int]``
    unchanged and the token budget charges all of it. A copy made with ``list(...)`` is unmarked.
    """

    __slots__ = ("b_start", "pool_start", "raw")

    def __init__(
        self, ids: Sequence[int], *, b_start: int = -1, pool_start: int = 0, raw: bool = False
    ) -> None:
        super().__init__(ids)
        self.b_start = b_start  # -1: a single text
        self.pool_start = pool_start  # 0: pool over every token
        self.raw = raw  # True: the pooled row before the model's normalisation


class PairIds(MarkedIds):
    """A text pair (query, document): segment B starts at ``b_start``."""

    __slots__ = ()

    def __init__(self, ids: Sequence[int], b_start: int) -> None:
        super().__init__(ids, b_start=b_start)


class PromptIds(MarkedIds):
    """A text behind a prompt that the model's pooling leaves out: pooling starts at ``pool_start``."""

    __slots__ = ()

    def __init__(self, ids: Sequence[int], pool_start: int) -> None:
        super().__init__(ids, pool_start=pool_start)


class WindowIds(MarkedIds):
    """A window of an input longer than the model: its row comes back ``raw`` (see ``MarkedIds``)."""

    __slots__ = ()

    def __init__(self, ids: Sequence[int], pool_start: int = 0) -> None:
        super().__init__(ids, pool_start=pool_start, raw=True)


def marks(seq: Sequence[int]) -> tuple[int, int]:
    """``(b_start, pool_start)`` of a sequence: ``(-1, 0)`` for an unmarked one."""
    return (seq.b_start, seq.pool_start) if isinstance(seq, MarkedIds) else (-1, 0)


def is_raw(seq: Sequence[int]) -> bool:
    """Whether ``seq``'s row must come back pooled but not normalised (a window of a long input)."""
    return isinstance(seq, MarkedIds) and seq.raw


class Tokens(Protocol):
    """A model's tokenizer as the gateway uses it: raw ids, length limits and special tokens."""

    max_tokens: int  # longest sequence the model accepts, special tokens included
    vocab_size: int
    pad_id: int

    @property
    def specials(self) -> int:
        """Special tokens added to every single text."""
        ...

    @property
    def prefix_len(self) -> int:
        """Special tokens added in front of every single text (where its own tokens start)."""
        ...

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text without special tokens and without truncation."""
        ...

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """Truncate raw ids to fit ``max_tokens`` and add the model's special tokens."""
        ...

    def pair_with_special_tokens(self, a: Sequence[int], b: Sequence[int]) -> tuple[list[int], int]:
        """Raw ids of A and B truncated longest-first and joined; also where B starts."""
        ...

    def spec(self) -> TokenizerSpec:
        """This tokenizer as data, for a gateway process to rebuild it exactly."""
        ...


@runtime_checkable
class Runner(Protocol):
    """An execution engine for one model. Only the model thread calls ``forward``, ``finish`` and
    ``warmup``; ``prepare`` and ``padded_cost`` may run on any thread."""

    info: ModelInfo

    @property
    def tokens(self) -> Tokens:
        """The tokenizer the model's inputs come from."""
        ...

    @property
    def device(self) -> object:
        """Where the forward runs; ``str()`` names it (``cpu``, ``cuda:0``, ...)."""
        ...

    @property
    def capture_stats(self) -> CaptureStats | None:
        """CUDA-graph runners' capture statistics; None for runners without graphs."""
        ...

    def padded_cost(self, n: int, max_len: int) -> int:
        """Padded tokens a batch of ``n`` sequences, the longest ``max_len``, will cost to run."""
        ...

    def prepare(self, batch: Sequence[Sequence[int]]) -> Any:
        """Pad a batch of complete id sequences into the forward's inputs (CPU work)."""
        ...

    def forward(self, prepared: Any) -> Any:
        """Run the model on prepared inputs. Model thread only."""
        ...

    def finish(self, output: Any, prepared: Any) -> np.ndarray:
        """A float32 array with one row per real (unpadded) input, in batch order. Model thread only."""
        ...

    def warmup(self) -> None:
        """Run representative batches so the first request pays no first-use costs. Model thread only."""
        ...


@runtime_checkable
class TokenRunner(Runner, Protocol):
    """A runner that can also return one vector per token (``OutputKind.TOKENS``).

    A token batch is prepared by ``prepare`` like any other and then run by these two instead of
    ``forward``/``finish``. Model thread only.
    """

    def forward_tokens(self, prepared: Any) -> Any:
        """Run the encoder on prepared inputs, keeping its last hidden states."""
        ...

    def finish_tokens(self, output: Any, prepared: Any) -> np.ndarray:
        """float32 ``(sum of the real inputs' lengths, width)``: each input's tokens in order, inputs in
        batch order, padded positions dropped."""
        ...


@runtime_checkable
class CalibratedRunner(Protocol):
    """A runner that brings the calibration corpus's rows with it (an ONNX export stores them), so the
    engine's warm-up need not embed the corpus. None: compute them as for any other runner."""

    calibration: np.ndarray | None
