"""Reading the server's ``/metrics`` before and after a run, and what the difference says about batching.

A snapshot maps each sample (name and labels) to its value; the delta of two snapshots over the
measured window gives batches formed, inputs served, the batch-size histogram, padding and queue time.
Metric names are Coalesce's (``coalesce_*``); other servers' metrics are ignored, and a server without
``/metrics`` simply yields no batch figures.
"""

from __future__ import annotations

import math
from collections import defaultdict

import aiohttp
from coalesce.loadtests.results import BatchStats, BucketCount
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Snapshot = dict[tuple[str, Labels], float]


def parse(text: str) -> Snapshot:
    """All samples of a Prometheus text exposition, keyed by sample name and sorted labels."""
    snap: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            snap[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return snap


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> Snapshot | None:
    """One snapshot of ``url``, or None when the server has no usable metrics endpoint."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return parse(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """``after - before`` for every sample of ``after`` (a sample new in ``after`` counts from zero)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


class _View:
    """Sums samples over label sets, keeping only the served model's when the metric carries one."""

    def __init__(self, snap: Snapshot, model: str | None) -> None:
        self._snap = snap
        models = {dict(labels).get("model") for (_, labels) in snap} - {None}
        # If the model label never names ours (an alias, another name), take every model's samples.
        self._model = model if model in models else None

    def _keep(self, labels: Labels) -> bool:
        d = dict(labels)
        return self._model is None or d.get("model", self._model) == self._model

    def has(self, name: str) -> bool:
        return any(n == name for (n, _) in self._snap)

    def total(self, name: str) -> float:
        return sum(v for (n, labels), v in self._snap.items() if n == name and self._keep(labels))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (n, labels), v in self._snap.items():
            if n == name and self._keep(labels):
                out[dict(labels).get(label, "")] += v
        return dict(out)

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative ``(le, count)`` pairs of histogram ``name``, ascending, ``+Inf`` last."""
        by_le = self.by_label(f"{name}_bucket", "le")
        return sorted((float(le), count) for le, count in by_le.items())

    def mean(self, name: str) -> float | None:
        count = self.total(f"{name}_count")
        return self.total(f"{name}_sum") / count if count > 0 else None


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Estimate a quantile from cumulative buckets by linear interpolation (as PromQL does)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # the overflow bucket has no upper bound: report its lower edge
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _size_buckets(buckets: list[tuple[float, float]]) -> list[BucketCount]:
    out = []
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        out.append(
            BucketCount(lo=prev_le, hi=None if math.isinf(le) else le, count=round(count - prev_count))
        )
        prev_le, prev_count = le, count
    return out


def _counts(by_label: dict[str, float]) -> dict[str, int]:
    return {k: round(c) for k, c in sorted(by_label.items()) if c}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def batch_stats(window: Snapshot, model: str | None = None) -> BatchStats | None:
    """Batching figures from the delta of two scrapes; None when the server exports no batch metrics."""
    v = _View(window, model)
    if not (v.has("coalesce_batches_total") or v.has("coalesce_batch_size_count")):
        return None
    batches = v.total("coalesce_batches_total") or v.total("coalesce_batch_size_count")
    inputs = v.total("coalesce_inputs_total") or v.total("coalesce_batch_size_sum")
    queue = v.buckets("coalesce_queue_wait_seconds")
    batch_tokens = v.total("coalesce_batch_tokens_sum")
    forward_s = v.total("coalesce_forward_seconds_sum")
    return BatchStats(
        batches=round(batches),
        inputs=round(inputs),
        mean_batch_size=inputs / batches if batches > 0 else None,
        size_buckets=_size_buckets(v.buckets("coalesce_batch_size")),
        mean_padding_ratio=v.mean("coalesce_batch_padding_ratio"),
        mean_queue_ms=_ms(v.mean("coalesce_queue_wait_seconds")),
        p50_queue_ms=_ms(bucket_quantile(queue, 0.50)),
        p99_queue_ms=_ms(bucket_quantile(queue, 0.99)),
        mean_forward_ms=_ms(v.mean("coalesce_forward_seconds")),
        mean_batch_tokens=v.mean("coalesce_batch_tokens"),
        forward_tokens_per_s=batch_tokens / forward_s if forward_s > 0 else None,
        server_requests=_counts(v.by_label("coalesce_requests_total", "status")),
        server_rejected=_counts(v.by_label("coalesce_rejected_total", "reason")),
    )
