"""The gateway ↔ engine protocol's arrays: token ids and their marks survive the trip exactly, and a
frame that breaks the protocol is refused with why (never a crash, never a wrong sequence)."""

from __future__ import annotations

import numpy as np
import pytest
from coalesce.kernels.protocol import (
    MarkedIds,
    ModelInfo,
    OutputKind,
    PairIds,
    PromptIds,
    Task,
    WindowIds,
    is_raw,
    marks,
)
from coalesce.service.batching.batcher import _PLAIN_POOLED, input_key
from coalesce.service.engine import messages as wire
from coalesce.service.errors import DeadlineExceeded, InvalidRequest, Overloaded, Unavailable

INFO = ModelInfo(name="m", task=Task.EMBED, max_tokens=16, vocab_size=100, dim=4)


def _job(n: int, marked: bool) -> wire.Job:
    return wire.Job(7, 0, n, marked, "t", 1.0, 1, 0.0)


def unpack_job(job: wire.Job, frame: bytes) -> list[list[int]]:
    """``job``'s sequences, sent alone in a message."""
    (got,) = wire.unpack_submit(wire.Submit([job], [len(frame) // 4]), frame, [INFO])
    if isinstance(got, wire.ProtocolError):
        raise got
    return got


def test_sequences_and_their_marks_round_trip() -> None:
    plain = [[1, 5, 2], [1, 2]]
    marked, frame = wire.pack_job(plain)
    assert not marked
    assert unpack_job(_job(2, marked), frame) == plain
    longest = [list(range(16))]  # as long as the model takes, ids 0 and 99 at the vocabulary's ends
    assert unpack_job(_job(1, False), wire.pack_job(longest)[1]) == longest
    assert unpack_job(_job(1, False), wire.pack_job([[0, 99]])[1]) == [[0, 99]]

    mixed = [PairIds([1, 5, 2, 6, 2], 3), PromptIds([1, 9, 9, 4, 2], 3), [1, 8, 2],
             WindowIds([1, 7, 7, 2], 1)]
    marked, frame = wire.pack_job(mixed)
    got = unpack_job(_job(4, marked), frame)
    assert marked and [list(s) for s in got] == [list(s) for s in mixed]
    assert [marks(s) for s in got] == [(3, 0), (-1, 3), (-1, 0), (-1, 1)]
    assert [is_raw(s) for s in got] == [False, False, False, True]  # a window's row comes back unnormalised
    assert all(isinstance(s, MarkedIds) for s in got)


def test_one_frame_carries_every_job_of_a_message_and_a_broken_job_breaks_only_itself() -> None:
    jobs = [[[1, 5, 2]], [PairIds([1, 5, 2, 6, 2], 3)], [[1, 200, 2]], [[1, 2], [1, 9, 9, 2]]]
    packed = [wire.pack_job(seqs) for seqs in jobs]
    sizes = [len(frame) // 4 for _, frame in packed]
    msg = wire.Submit([_job(len(seqs), marked) for seqs, (marked, _) in zip(jobs, packed, strict=True)],
                      sizes)
    got = wire.unpack_submit(msg, b"".join(frame for _, frame in packed), [INFO])
    assert isinstance(got[2], wire.ProtocolError) and "vocabulary" in str(got[2])  # 200: past the vocabulary
    del got[2], jobs[2]
    assert [[list(s) for s in seqs] for seqs in got] == [[list(s) for s in seqs] for seqs in jobs]
    assert marks(got[1][0]) == (3, 0)
    assert wire.split_frame([], b"") == []  # a reply that refuses every request carries no rows


@pytest.mark.parametrize(("sizes", "n_ids"), [([3, 2], 4), ([3, 2], 6), ([3, -1], 2), ([], 1), ([1], 1)])
def test_a_message_whose_sizes_do_not_account_for_its_frame_is_refused_whole(sizes: list[int], n_ids: int
                                                                               ) -> None:
    msg = wire.Submit([_job(1, False) for _ in range(2 if sizes == [1] else len(sizes))], sizes)
    with pytest.raises(wire.ProtocolError, match="in a frame of"):
        wire.unpack_submit(msg, bytes(4 * n_ids), [INFO])


@pytest.mark.parametrize(("sizes", "nbytes"), [([3, 2], 16), ([3, 2], 24), ([3, -1], 8), ([], 4)])
def test_sizes_that_do_not_account_for_the_frame_are_refused(sizes: list[int], nbytes: int) -> None:
    with pytest.raises(wire.ProtocolError, match="in a frame of"):
        wire.split_frame(sizes, bytes(nbytes))


@pytest.mark.parametrize(
    ("frame", "n", "why"),
    [
        (np.array([3, 1, 2], dtype=np.int32), 1, "lengths do not match"),
        (np.array([2, 1, 200], dtype=np.int32), 1, "outside the model's vocabulary"),
        (np.array([2, -3, 1], dtype=np.int32), 1, "outside the model's vocabulary"),
        (np.array([17, *range(17)], dtype=np.int32), 1, "lengths do not match"),  # longer than the model
        (np.array([0], dtype=np.int32), 1, "lengths do not match"),
        (np.array([], dtype=np.int32), 1, "sequences in a frame"),
        (np.array([1, 5], dtype=np.int32), 0, "sequences in a frame"),
    ],
)
def test_a_broken_frame_is_refused_with_why(frame: np.ndarray, n: int, why: str) -> None:
    with pytest.raises(wire.ProtocolError, match=why):
        unpack_job(_job(n, False), frame.tobytes())


@pytest.mark.parametrize("bad", [-1, 100])
def test_a_large_job_is_checked_as_closely_as_a_small_one(bad: int) -> None:
    seqs = [[1, *range(3, 16), 2] for _ in range(100)]  # 1,500 ids: past the size checked in Python
    marked, frame = wire.pack_job(seqs)
    assert unpack_job(_job(100, marked), frame) == seqs
    seqs[57][4] = bad
    marked, frame = wire.pack_job(seqs)
    with pytest.raises(wire.ProtocolError, match="outside the model's vocabulary"):
        unpack_job(_job(100, marked), frame)


@pytest.mark.parametrize(
    "frame",
    [
        [2, -1, 5, 0, 1, 2],  # pool_start 5 in a 2-token sequence
        [2, -1, 0, 2, 1, 2],  # raw is 0 or 1
    ],
)
def test_a_mark_outside_its_sequence_is_refused(frame: list[int]) -> None:
    with pytest.raises(wire.ProtocolError, match="mark is outside"):
        unpack_job(_job(1, True), np.array(frame, dtype=np.int32).tobytes())


@pytest.mark.parametrize(
    "err",
    [
        Overloaded("full", retry_after=2.5, code="queue_full"),
        Unavailable("later", retry_after=1, code="deadline_unmeetable"),
        DeadlineExceeded("late"),
        InvalidRequest("bad", param="input[2]", code="input_too_long"),
    ],
)
def test_a_refusal_crosses_as_the_same_error(err: Exception) -> None:
    back = wire.error_from(wire.failure(err))  # type: ignore[arg-type]
    assert type(back) is type(err)
    assert (back.status, back.message, back.code, back.param) == (
        err.status,
        err.message,
        err.code,
        err.param,
    )  # type: ignore[attr-defined]
    assert back.headers() == err.headers()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("job", "why"),
    [
        (wire.Job(7, 1, 1, False, "t", 1.0, 1, 0.0), "no model 1"),
        (wire.Job(7, 0, 1, False, "t", 1.0, 1, 0.0, tokens=True), "returns no token embeddings"),
    ],
)
def test_a_job_for_a_model_that_cannot_serve_it_is_refused(job: wire.Job, why: str) -> None:
    with pytest.raises(wire.ProtocolError, match=why):
        unpack_job(job, np.array([2, 1, 2], dtype=np.int32).tobytes())


def test_a_plain_querys_ids_come_with_their_bytes_and_its_cache_key_is_the_one_process_key() -> None:
    # The engine keys a plain query (cache, dedup) on the frame's bytes rather than packing its ids
    # again: the key must be the one `--workers 1` computes from the ids, or a cached row would be
    # missed (or, worse, another input's found) across the two paths.
    jobs = [[[1, 5, 2]], [PairIds([1, 5, 2, 6, 2], 3)], [[1, 2], [1, 9, 9, 2]], [[1, 99, 0, 2]], [[1, 200]]]
    packed = [wire.pack_job(seqs) for seqs in jobs]
    msg = wire.Submit([_job(len(seqs), marked) for seqs, (marked, _) in zip(jobs, packed, strict=True)],
                      [len(frame) // 4 for _, frame in packed])
    msg.jobs[3] = wire.Job(8, 0, 1, False, "t", 1.0, 1, 0.0, tokens=True)  # every token's vector
    raws: list[bytes] = []
    got = wire.unpack_submit(msg, b"".join(frame for _, frame in packed), [INFO], raws)
    assert isinstance(got[4], wire.ProtocolError)  # 200: past the vocabulary, fast path or not
    assert got[0] == [[1, 5, 2]] and raws[0] and raws[1:] == [b"", b"", b"", b""]
    assert _PLAIN_POOLED + raws[0] == input_key([1, 5, 2], OutputKind.POOLED)
