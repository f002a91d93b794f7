"""Inputs longer than the model: truncated, refused, or chunked into windows and pooled back.

A request (its ``long_input`` field; else TEI's or Cohere's own ``truncate`` field, meaning what it
always meant; else ``--long-input``) picks one of three modes. ``chunk`` splits an input's tokens
(the prompt's excluded) into consecutive windows that fill the model once the prompt and the special
tokens are added, each repeating the last ``chunk_overlap`` tokens of the one before. Every window is
one more input of the request: windows of one text run in parallel batches, share batches with other
callers' inputs, and are the request's own flow in the fair queue. The input's vector is the mean of
its windows' pooled vectors weighted by the tokens each pooled, taken before the model's
normalisation (the runner returns windows unnormalised), then normalised if the model normalises: for
a mean-pooled model without overlap, exactly the mean over every token the windows read. An input
that fits runs as it always did.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from aiohttp import web
from coalesce.kernels.protocol import PromptIds, WindowIds

from ..errors import InvalidRequest
from ..settings import LONG_INPUTS
from .admission import Admission
from .facade import ServedModel
from .inputs import MODEL_DEFAULT, SEND_TRUNCATE, ModelDefault, fit_sequences, tokenize_texts
from .state import SETTINGS


@dataclass(frozen=True, slots=True)
class LongInput:
    """How one request treats inputs longer than the model: ``mode`` and, to chunk, the overlap and
    the most tokens one input may have (``--max-input-tokens``)."""

    mode: str  # truncate, chunk or error
    overlap: int = 0
    most: int = 32768


def long_input(request: web.Request, asked: str | None, truncate: bool | None = None,
               overlap: int | None = None, *, field: str = "long_input",
               overlap_field: str = "chunk_overlap") -> LongInput:
    """A request's ``long_input`` (``asked``) wins; without it, its own ``truncate`` field (TEI's,
    Cohere's) as it always meant (True: truncate, False: error); without either, ``--long-input``."""
    settings = request.app[SETTINGS]
    if asked is not None and asked.lower() not in LONG_INPUTS:
        raise InvalidRequest(f"'{field}' must be truncate, chunk or error; got {asked!r}.", param=field,
                             code="invalid_value")
    if overlap is not None and overlap < 0:
        raise InvalidRequest(f"'{overlap_field}' must be >= 0; got {overlap}.", param=overlap_field,
                             code="invalid_value")
    if asked is not None:
        mode = asked.lower()
    elif truncate is not None:
        mode = "truncate" if truncate else "error"
    else:
        mode = settings.default_long_input
    overlap = settings.chunk_overlap if overlap is None else overlap
    return _long_input(mode, overlap, settings.max_input_tokens)


@functools.lru_cache(maxsize=256)
def _long_input(mode: str, overlap: int, most: int) -> LongInput:
    return LongInput(mode, overlap, most)  # (immutable: one per distinct choice, not one per request)


def window_starts(length: int, room: int, overlap: int) -> list[int]:
    """Where each window of ``length`` tokens starts, windows of ``room`` tokens that repeat the last
    ``overlap`` of the one before; the last window ends at the text's end (it may be shorter)."""
    if not 0 <= overlap < room:
        raise ValueError(f"overlap {overlap} must be in 0..{room - 1}")
    step = room - overlap
    starts = [0]
    while starts[-1] + room < length:
        starts.append(starts[-1] + step)
    return starts


def pool_windows(
    rows: np.ndarray, counts: Sequence[int], weights: Sequence[int], normalize: bool
) -> np.ndarray:
    """One row per input from the rows of its ``counts`` sequences, one after the other: an input of one
    sequence keeps its row; the rows of an input's windows are averaged, weighted by ``weights`` (one
    per sequence), then L2-normalised when ``normalize``. float32 (len(counts), width)."""
    out = np.empty((len(counts), rows.shape[1]), dtype=np.float32)
    at = 0
    for i, n in enumerate(counts):
        if n == 1:
            out[i] = rows[at]
        else:
            w = np.asarray(weights[at : at + n], dtype=np.float64)
            v = (rows[at : at + n].astype(np.float64) * w[:, None]).sum(axis=0) / w.sum()
            if normalize:
                norm = float(np.linalg.norm(v))
                v = v / norm if norm > 0 else v
            out[i] = v
        at += n
    return out


@dataclass(frozen=True, slots=True)
class Fitted:
    """A request's inputs as they run: ``seqs`` holds each input's sequence, or its windows one after
    the other (``counts`` per input; None: one each), ``weights`` the tokens each sequence pools."""

    seqs: list[list[int]]
    counts: list[int] | None = None
    weights: list[int] | None = None
    normalize: bool = False  # the model normalises: so does the pooled mean of a chunked input

    @property
    def tokens(self) -> int:
        """Every token embedded (``usage``): all of every window, prompts and special tokens included."""
        return sum(len(s) for s in self.seqs)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """One row per input, from the rows the model returned for ``seqs``."""
        if self.counts is None or self.weights is None or len(self.counts) == len(self.seqs):
            return rows
        return pool_windows(rows, self.counts, self.weights, self.normalize)


def fit_long(
    model: ServedModel,
    raw: Sequence[Sequence[int]],
    how: LongInput,
    *,
    field: str,
    left: bool = False,
    positions: Sequence[int] | None = None,
    hint: str = SEND_TRUNCATE,
    prompt_len: int = 0,
    limit: int | None = None,
) -> Fitted:
    """Raw ids (each behind its ``prompt_len`` prompt tokens) fitted per ``how``: cut or refused as
    ``fit_sequences`` does, or chunked into windows of the model's length (``limit`` when shorter)."""
    if how.mode != "chunk":
        return Fitted(fit_sequences(model, raw, cut=how.mode == "truncate", field=field, left=left,
                                    positions=positions, hint=hint, prompt_len=prompt_len, limit=limit))
    info = model.info
    if info.normalized and not info.raw_rows:
        raise InvalidRequest(
            f"Model '{info.name}' cannot chunk long inputs: its runner normalises inside the model (an ONNX "
            "export), so windows cannot be pooled before normalisation. Serve it with --backend torch, or "
            "send long_input truncate or error.",
            param="long_input",
            code="unsupported",
        )
    longest = info.max_tokens if limit is None else min(limit, info.max_tokens)
    room = longest - model.specials - prompt_len  # text tokens per window
    if room <= 0:  # the prompt leaves no room: fit_sequences says so, by name
        fit_sequences(model, raw[:1], cut=True, field=field, prompt_len=prompt_len, limit=limit)
    if how.overlap >= room:
        raise InvalidRequest(
            f"'chunk_overlap' is {how.overlap} tokens; a window holds {room} of the text here, so the "
            f"overlap must be below {room}.",
            param="chunk_overlap",
            code="invalid_value",
        )
    most = how.most
    pool_from = model.tokens.prefix_len + prompt_len if prompt_len and not info.include_prompt else 0
    seqs: list[list[int]] = []
    counts: list[int] = []
    weights: list[int] = []
    for i, ids in enumerate(raw):
        text = ids[prompt_len:]
        if len(text) > most:
            at = positions[i] if positions else i
            raise InvalidRequest(
                f"{field}[{at}] has {len(text)} tokens; at most {most} are taken per chunked input "
                "(--max-input-tokens). Split it, or send long_input truncate.",
                param=f"{field}[{at}]",
                code="input_too_large",
            )
        if len(text) <= room:
            seq = fit_sequences(model, [ids], cut=False, field=field, prompt_len=prompt_len, limit=limit)[0]
            seqs.append(seq)
            weights.append(len(seq) - pool_from)
            counts.append(1)
            continue
        head = list(ids[:prompt_len])
        starts = window_starts(len(text), room, how.overlap)
        for start in starts:
            window = model.tokens.with_special_tokens([*head, *text[start : start + room]])
            if info.normalized:
                window = WindowIds(window, pool_from)
            elif pool_from:
                window = PromptIds(window, pool_from)
            seqs.append(window)
            weights.append(len(window) - pool_from)
        counts.append(len(starts))
    return Fitted(seqs, counts, weights, info.normalized)


async def encode_long(
    model: ServedModel,
    adm: Admission,
    texts: Sequence[str],
    how: LongInput,
    *,
    field: str,
    left: bool = False,
    hint: str = SEND_TRUNCATE,
    prompt: str | ModelDefault | None = MODEL_DEFAULT,
    limit: int | None = None,
) -> Fitted:
    """Texts behind ``prompt`` (the model's default unless a request chose one), tokenised and fitted
    per ``how`` (see ``fit_long``)."""
    raw, prompt_len = await tokenize_texts(model, adm, texts, prompt)
    return fit_long(model, raw, how, field=field, left=left, hint=hint, prompt_len=prompt_len, limit=limit)
