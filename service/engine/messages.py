"""The protocol between gateway processes and the engine: every message, and how arrays travel.

Each gateway has its own Unix socket to the engine, in a private directory (``channel.py`` frames
messages on it). A message is a list of frames: frame 0 is one of the msgspec Structs below,
msgpack-encoded; arrays follow as raw frames, never inside the encoding, one frame per message however
many requests it carries (every message costs each side a send and a receive: per request, that was the
largest share of both processes' CPU once the model costs nothing):

* ``Submit`` carries one int32 frame: each request's ids back to back, ``Submit.sizes[i]`` of them for
  ``jobs[i]``. A request's ids are its sequences' lengths, then (for marked sequences: text pairs,
  prompts left out of pooling, windows of long inputs) where each one's second segment and its pooling
  start, and whether its row comes back unnormalised (1) or not (0), then every token id, concatenated;
* ``Results`` carries one float32 frame: each finished request's rows, ``n × dim``, back to back in the
  order of ``done``, in input order (one row per sequence, or for a ``tokens`` job one per token,
  which the gateway splits by the lengths it sent).

Gateway → engine: ``Hello`` (once connected), ``Submit`` (requests of one event-loop turn), ``Cancel``
(callers that left or ran out of time). Engine → gateway: ``Welcome`` (the served models, once
loaded, or the load error), ``Results`` (finished and refused requests, and each model's queue),
``Refused`` (a message it could not take, with why). A refusal of a request carries its error's class
name, so the gateway raises the same error class an in-process batcher would have raised. With tracing
on, a ``Job`` carries its request's span context and a ``Done`` its batches' spans (``tracing.pack``).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from coalesce.kernels.protocol import MarkedIds, ModelInfo, is_raw, marks
from coalesce.kernels.tokens import TokenizerSpec

from .. import errors


def endpoint(directory: str, gateway: int) -> str:
    """The path of gateway ``gateway``'s Unix socket in the private runtime ``directory``."""
    return str(Path(directory) / f"gateway-{gateway}.sock")


class ModelOffer(msgspec.Struct, frozen=True):
    """What a gateway needs to serve a model: its facts and tokenizer, and the engine's queue bound."""

    info: ModelInfo
    tokenizer: TokenizerSpec
    device: str
    max_queued_tokens: int
    calibration: bytes = b""  # the calibration corpus's embeddings, float32 rows of info.dim (embed)


class Hello(msgspec.Struct, frozen=True, tag=True):
    gateway: int
    pid: int


class Welcome(msgspec.Struct, frozen=True, tag=True):
    models: list[ModelOffer]
    error: str | None = None  # the engine could not load its models; it exits next


class Job(msgspec.Struct, frozen=True, array_like=True):
    """One request: ``n`` sequences for model ``model`` (its index in ``Welcome.models``). ``tokens``:
    it asks for every token's vector (``OutputKind.TOKENS``), not one row per sequence."""

    id: int
    model: int
    n: int
    marked: bool  # the frame holds each sequence's b_start, pool_start and raw (``MarkedIds``)
    tenant: str
    weight: float
    priority: int
    deadline: float  # time.monotonic(), the same clock in every process of the host
    tokens: bool = False
    arrived: float = 0.0  # when its head reached the gateway (time.monotonic()); 0: unknown
    trace: bytes = b""  # tracing on: the request's sampled span (``tracing.pack``), which batches link


class Submit(msgspec.Struct, frozen=True, tag=True):
    jobs: list[Job]
    sizes: list[int]  # int32 values of each job in the message's one frame, in order


class Cancel(msgspec.Struct, frozen=True, tag=True):
    ids: list[int]


class Done(msgspec.Struct, frozen=True, array_like=True):
    id: int
    n: int
    dim: int
    queue_s: float
    forward_s: float
    batches: tuple[bytes, ...] = ()  # tracing on: the spans of the batches it rode in


class Failure(msgspec.Struct, frozen=True, array_like=True):
    """A ``CoalesceError`` as data: ``kind`` is its class name in ``coalesce.service.errors``."""

    kind: str
    message: str
    code: str | None
    param: str | None
    retry_after: float


class Failed(msgspec.Struct, frozen=True, array_like=True):
    id: int
    error: Failure


class Queue(msgspec.Struct, frozen=True, array_like=True):
    """One model's queue as the engine saw it when it sent this: what a gateway refuses a request on
    before tokenising it (``judge_wait`` in ``batching/admit.py``, for the default tenant)."""

    tokens: int  # tokens waiting
    drain_s: float  # predicted seconds until what is admitted has run
    standing: bool = False  # the queue's regime
    waits: list[float] = msgspec.field(default_factory=list)  # Scheduler.waits, by priority class
    overhead_s: float = 0.0  # the cost model: a forward is overhead_s + per_token_s × padded tokens
    per_token_s: float = 0.0
    capacity: float = 0.0  # tokens per second the model serves (Admitter.capacity): refusals are paced on it


class Results(msgspec.Struct, frozen=True, tag=True):
    done: list[Done]  # their rows back to back in the message's one float32 frame, in this order
    failed: list[Failed]
    queues: list[Queue]  # per model, by index


class Refused(msgspec.Struct, frozen=True, tag=True):
    reason: str


ToEngine = Hello | Submit | Cancel
ToGateway = Welcome | Results | Refused

encoder = msgspec.msgpack.Encoder()
engine_decoder = msgspec.msgpack.Decoder(ToEngine)
gateway_decoder = msgspec.msgpack.Decoder(ToGateway)


_NUMPY_FROM = 512  # ids in a job from which numpy checks them faster than Python


class ProtocolError(ValueError):
    """A message that breaks this protocol: logged and refused, never fatal."""


def pack_job(seqs: Sequence[Sequence[int]]) -> tuple[bool, bytes]:
    """(whether the sequences carry marks, the int32 frame of ``seqs``)."""
    values = [len(s) for s in seqs]
    marked = False
    for s in seqs:  # (a loop, not any() over a generator: most requests are one sequence)
        if isinstance(s, MarkedIds):
            marked = True
            break
    if marked:
        pairs = [marks(s) for s in seqs]
        values += [b for b, _ in pairs] + [p for _, p in pairs] + [int(is_raw(s)) for s in seqs]
    for s in seqs:
        values += s
    return marked, array("i", values).tobytes()


def split_frame(sizes: Sequence[int], frame: Any, itemsize: int = 4) -> list[memoryview]:
    """``frame`` cut into consecutive pieces of ``sizes`` items (views, no copy); raises
    :class:`ProtocolError` unless the sizes account for the frame exactly."""
    view = memoryview(frame).cast("B")
    if any(size < 0 for size in sizes) or sum(sizes) * itemsize != view.nbytes:
        raise ProtocolError(f"{len(sizes)} pieces of {sum(sizes)} items in a frame of {view.nbytes} bytes")
    ends = [end * itemsize for end in itertools.accumulate(sizes)]
    return [view[a:b] for a, b in zip([0, *ends], ends, strict=False)]


def unpack_submit(
    msg: Submit, frame: Any, infos: Sequence[ModelInfo], raws: list[bytes] | None = None
) -> list[list[list[int]] | ProtocolError]:
    """Each job's sequences from the message's frame, checked against its model's facts (``infos``, by
    index), or why that job breaks the protocol (the others stand). Raises :class:`ProtocolError` when
    the sizes do not account for the frame: then nothing in it can be trusted. ``raws``, if given, gets
    one entry per job: for a plain query (one unmarked sequence, pooled output) its ids as the frame
    holds them (int32 bytes, what ``batcher.input_key`` would pack them into again), else ``b""``.

    The frame becomes Python ints once per message, not once per job: a job of a few dozen ids then
    costs slices and Python's min and max, which beat numpy's fixed microsecond or two per call there;
    only a job of many ids has its vocabulary checked by numpy."""
    sizes = msg.sizes
    data = np.frombuffer(frame, dtype=np.int32)
    if len(sizes) != len(msg.jobs) or (sizes and min(sizes) < 0) or sum(sizes) != data.size:
        raise ProtocolError(f"{len(sizes)} sizes for {len(msg.jobs)} jobs, {sum(sizes)} ids in a frame of "
                            f"{data.nbytes} bytes")
    values = data.tolist()
    raw = data.tobytes() if raws is not None else b""
    models = len(infos)
    out: list[list[list[int]] | ProtocolError] = []
    at = 0
    for job, size in zip(msg.jobs, sizes, strict=True):
        end = at + size
        plain = b""
        try:
            if not 0 <= job.model < models:
                raise ProtocolError(f"job {job.id}: no model {job.model}")
            out.append(_unpack(job, values, data, at, end, infos[job.model]))
            if raws is not None and job.n == 1 and not job.marked and not job.tokens:
                plain = raw[4 * at + 4 : 4 * end]  # (past its one length)
        except ProtocolError as exc:
            out.append(exc)
        if raws is not None:
            raws.append(plain)
        at = end
    return out


def _unpack(job: Job, values: list[int], data: np.ndarray, at: int, end: int,
            info: ModelInfo) -> list[list[int]]:
    """``job``'s sequences from ``values[at:end]`` (``data`` holds the same ids as numpy)."""
    n = job.n
    head = n * 4 if job.marked else n
    if n < 1 or end - at < head:
        raise ProtocolError(f"job {job.id}: {n} sequences in a frame of {end - at} ids")
    if job.tokens and not info.token_embeddings:
        raise ProtocolError(f"job {job.id}: model {job.model} returns no token embeddings")
    start = at + head
    lengths = values[at : at + n]
    if n == 1:  # (the common query: one length, compared as a value, not reduced as a list)
        fits = 0 < lengths[0] == end - start <= info.max_tokens
    else:
        fits = min(lengths) >= 1 and max(lengths) <= info.max_tokens and sum(lengths) == end - start
    if not fits:
        raise ProtocolError(f"job {job.id}: sequence lengths do not match the frame")
    flat = values[start:end]
    ids = data[start:end] if end - start > _NUMPY_FROM else flat
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise ProtocolError(f"job {job.id}: a token id is outside the model's vocabulary")
    if n == 1 and not job.marked:
        return [flat]  # the common query: one plain sequence
    ends = list(itertools.accumulate(lengths))
    starts = [0, *ends[:-1]]
    if not job.marked:
        return [flat[a:b] for a, b in zip(starts, ends, strict=True)]
    b_starts, pool_starts, raws = values[at + n : at + 2 * n], values[at + 2 * n : at + 3 * n], \
        values[at + 3 * n : start]
    marks_ = zip(b_starts, pool_starts, raws, lengths, strict=True)
    if any(k >= length or not 0 <= p < length or r not in (0, 1) for k, p, r, length in marks_):
        raise ProtocolError(f"job {job.id}: a mark is outside its sequence")
    return [
        MarkedIds(flat[a:b], b_start=k, pool_start=p, raw=bool(r))
        for a, b, k, p, r in zip(starts, ends, b_starts, pool_starts, raws, strict=True)
    ]


def failure(err: errors.CoalesceError) -> Failure:
    return Failure(type(err).__name__, err.message, err.code, err.param, getattr(err, "retry_after", 0.0))


def error_from(f: Failure) -> errors.CoalesceError:
    """The error ``f`` describes, as the same class the engine raised."""
    kind = getattr(errors, f.kind, None)
    if not (isinstance(kind, type) and issubclass(kind, errors.CoalesceError)):
        return errors.CoalesceError(f.message, code=f.code)
    if issubclass(kind, errors.RetryableError):
        return kind(f.message, retry_after=f.retry_after, code=f.code)
    return kind(f.message, param=f.param, code=f.code)
