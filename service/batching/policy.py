"""Batch formation: a pure function of the waiting inputs' lengths, the limits and the cost model.

The first waiting input (the anchor: the oldest, or the one fair order serves first) is always in the
next batch, so nothing starves. Around it, the policy picks the inputs of most similar length: in length
order, every batch is a contiguous run that contains the anchor, because a run of neighbours wastes the
least padding. Among such runs it picks the one that computes the most real tokens per predicted second
— ``real / predict(padded_cost(n, longest))`` — under the batch-size and padded-token limits. That single
rule covers the trade-offs: a fixed cost per forward favours bigger batches, padding favours similar
lengths, and a cost that steps with a bucket grid (CUDA graph cells) favours batches that fill their cell.

One guard keeps the rule from being short-sighted: a run that adds inputs longer than the anchor to
inputs no longer than it must cost no more than the two parts would as separate batches. Otherwise a
short query behind a bulk request's long chunks would be padded to their length (on a CPU that costs
more than a forward of its own), only because the chunks raise that one batch's tokens per second —
they would run as efficiently in the next batch anyway.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Lengths at which padding cost is re-examined; runs are cut only where a longer input would raise the
# batch's padded length past one of these (or past the anchor's own length).
LENGTH_MARKS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_batch_tokens: int  # padded tokens, as ``padded_cost`` counts them


PaddedCost = Callable[[int, int], int]  # (inputs, longest) -> padded tokens
Predict = Callable[[int], float]  # padded tokens -> seconds


def window_size(limits: Limits) -> int:
    """How many of the oldest waiting inputs the policy looks at (bounds its work per batch)."""
    return max(256, 4 * limits.max_batch_size)


def form_batch(
    lengths: Sequence[int],
    anchor: int,
    limits: Limits,
    padded_cost: PaddedCost,
    predict: Predict,
    max_seconds: float | None = None,
) -> list[int]:
    """Indices into ``lengths`` of the next batch. Always contains ``anchor``.

    Among equal lengths, lower indices are preferred (callers list inputs most urgent first).
    ``max_seconds`` keeps only batches
    whose predicted time fits it (a latency target asks for that) — if none fits, not even the anchor
    alone, the constraint is dropped: the deadline is lost anyway, and throughput then matters most.
    """
    n = len(lengths)
    if n == 0:
        return []
    cap = limits.max_batch_size
    if cap <= 1 or n == 1:
        return [anchor]
    # Length order. Among equal lengths the more urgent input sits nearer the anchor, so a run that takes
    # only part of them takes the urgent ones: to its left (shorter) the urgent sit right; from the anchor
    # on (the anchor first) they sit left.
    alen = lengths[anchor]

    def key(i: int) -> tuple[int, ...]:
        length = lengths[i]
        return (length, -i) if length < alen else (length, i != anchor, i)

    order = sorted(range(n), key=key)
    pos = order.index(anchor)
    prefix = [0]
    for i in order:
        prefix.append(prefix[-1] + lengths[i])

    best = _best_run(lengths, order, pos, prefix, cap, limits, padded_cost, predict, max_seconds)
    if best is None:
        best = _best_run(lengths, order, pos, prefix, cap, limits, padded_cost, predict, None)
    assert best is not None  # without a time limit the anchor alone always qualifies
    k, r = best
    return sorted(order[r + 1 - k : r + 1])


def _best_run(
    lengths: Sequence[int],
    order: Sequence[int],
    pos: int,
    prefix: Sequence[int],
    cap: int,
    limits: Limits,
    padded_cost: PaddedCost,
    predict: Predict,
    max_seconds: float | None,
) -> tuple[int, int] | None:
    """(size, right end) of the run with the most real tokens per predicted second, or None."""

    def in_budget(k: int, longest: int) -> bool:
        return padded_cost(k, longest) <= limits.max_batch_tokens

    def in_time(k: int, longest: int) -> bool:
        return max_seconds is None or predict(padded_cost(k, longest)) <= max_seconds

    def largest_at(r: int) -> int:
        longest = lengths[order[r]]
        # (No run ending at r is longer than r + 1: the searches go no further. A small window's batch —
        # the usual one under a light or a launch-bound load — is then a step or two, not log2(cap).)
        k = _largest(min(cap, r + 1), longest, in_budget)
        return k if max_seconds is None else _largest(k, longest, in_time)

    alen = lengths[order[pos]]
    short_end = pos  # the last position no longer than the anchor
    while short_end + 1 < len(order) and lengths[order[short_end + 1]] <= alen:
        short_end += 1

    best: tuple[float, int, int] | None = None  # (real tokens per second, size, right end)
    tried = pos - 1
    for r in _right_ends(order, lengths, pos):
        k_max = largest_at(r)
        last = r - pos + 1 > k_max
        if last:
            # The run from the anchor to this mark is too big (or too slow): the longest run from the
            # anchor that stops short of it is the last worth trying, so a short anchor among many
            # longer inputs can still fill a batch.
            r = pos + k_max - 1
            if r <= tried:
                break
            k_max = largest_at(r)
        longest = lengths[order[r]]
        k_min = r - pos + 1
        if k_min > k_max or not in_time(k_min, longest):
            break  # runs ending further right are longer still
        # Inputs longer than the anchor in these runs: the run must cost no more than running them and
        # the rest (no longer than the anchor) as two batches.
        longer = r - short_end
        longer_alone = predict(padded_cost(longer, longest)) if longer > 0 else 0.0
        for k in _sizes_between(k_min, k_max):
            seconds = predict(padded_cost(k, longest))
            if longer > 0 and seconds > longer_alone + predict(padded_cost(k - longer, alen)):
                continue
            real = prefix[r + 1] - prefix[r + 1 - k]
            rate = real / max(seconds, 1e-12)
            if best is None or (rate, k) > best[:2]:
                best = (rate, k, r)
        tried = r
        if last:
            break
    return None if best is None else (best[1], best[2])


def _right_ends(order: Sequence[int], lengths: Sequence[int], pos: int) -> list[int]:
    """Right ends worth trying: the anchor's own run end, then the last input under each length mark."""
    anchor_len = lengths[order[pos]]
    last = len(order) - 1
    ends: list[int] = []
    r = pos
    # (The marks above the anchor's length; once a run reaches the last input no mark adds an end.)
    for mark in (anchor_len, *LENGTH_MARKS[bisect_right(LENGTH_MARKS, anchor_len):]):
        while r < last and lengths[order[r + 1]] <= mark:
            r += 1
        if not ends or ends[-1] != r:
            ends.append(r)
        if r == last:
            return ends
    ends.append(last)
    return ends


def _largest(cap: int, longest: int, fits: Callable[[int, int], bool]) -> int:
    """Largest k ≤ cap with ``fits(k, longest)``, ``fits`` monotone in k (at least 1: one input runs)."""
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid, longest):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sizes_between(lo: int, hi: int) -> list[int]:
    sizes = {lo, hi}
    p = 1
    while p < hi:
        if p > lo:
            sizes.add(p)
        p *= 2
    return sorted(sizes)


def padding_ratio(lengths: Sequence[int], padded_tokens: int) -> float:
    """Share of a batch's padded tokens that are padding."""
    return 0.0 if padded_tokens <= 0 else max(0.0, 1.0 - sum(lengths) / padded_tokens)
