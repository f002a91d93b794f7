"""The shape of a load test's results, as saved in ``result.json`` and read back by ``coalesce plan``.

Times are milliseconds unless a name says otherwise; rates are per second.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

SCHEMA_VERSION = 1


class Latency(msgspec.Struct):
    """Percentiles of one latency distribution (HDR histogram, 3 significant digits)."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float


class BucketCount(msgspec.Struct):
    """Batches whose size fell in ``(lo, hi]``; ``hi`` is None for the overflow bucket."""

    lo: float
    hi: float | None
    count: int


class BatchStats(msgspec.Struct):
    """What the server's own metrics say happened during the measured window (deltas of a scrape)."""

    batches: int
    inputs: int
    mean_batch_size: float | None
    size_buckets: list[BucketCount]
    mean_padding_ratio: float | None
    mean_queue_ms: float | None
    p50_queue_ms: float | None
    p99_queue_ms: float | None
    mean_forward_ms: float | None
    mean_batch_tokens: float | None
    forward_tokens_per_s: float | None
    server_requests: dict[str, int]  # coalesce_requests_total by status
    server_rejected: dict[str, int] = {}  # coalesce_rejected_total by reason


class Tail(msgspec.Struct):
    """Where the slowest admitted requests spent their time: the successful requests at or past the
    latency p99 (from their scheduled send), as means. ``queue_ms`` and ``forward_ms`` are what the
    server's headers say (``x-queue-time``, ``x-inference-time``); ``outside_ms`` is the rest of each
    one's latency: the generator's send, the time before the server stamped its head, tokenising, and
    the response's way back (an event loop busy with other requests shows here). ``first_s``: how many
    of them were due in the step's first second (a soak's phase: an overload's onset)."""

    count: int
    latency_ms: float
    queue_ms: float
    forward_ms: float
    outside_ms: float
    first_s: int = 0


class Cost(msgspec.Struct):
    """Cost of the measured throughput at a price per replica-hour."""

    per_hour: float
    per_1k_requests: float | None
    per_1m_embeddings: float | None


class Timeline(msgspec.Struct):
    """Per-bin view of a step for latency-over-time plots; bins by scheduled send time."""

    bin_s: float
    start_s: list[float]
    sent: list[int]
    ok: list[int]
    failed: list[int]
    p50_ms: list[float | None]
    p99_ms: list[float | None]


class StepResult(msgspec.Struct):
    """One measured load level: a whole run, one step of a ramp, or one server of a comparison."""

    label: str
    mode: str
    offered_rps: float | None  # the asked rate (open loop); None for closed loop
    concurrency: int | None  # clients (closed loop)
    duration_s: float
    requests: int  # requests whose send was due in the measured window
    ok: int
    by_status: dict[str, int]  # "200", "429", "timeout", "connection", "bad_response", ...
    error_rate: float  # share of requests that did not get a good 200
    achieved_rps: float
    achieved_inputs_per_s: float
    mean_inputs_per_request: float
    latency: Latency | None  # successful requests, from scheduled send time to response
    send_lag: Latency | None  # how late the generator sent (open loop); a generator health check
    header_queue_ms: float | None  # mean of the server's x-queue-time header
    header_inference_ms: float | None
    batch: BatchStats | None = None
    cost: Cost | None = None
    timeline: Timeline | None = None
    note: str = ""
    refusals_without_retry_after: int = 0  # 429s and 503s that did not say when to retry
    tail: Tail | None = None  # the slowest 1% of the good responses, taken apart (servers that send timings)


class GeneratorStats(msgspec.Struct):
    """How hard the generator itself worked: if it was busy, the server was not the bound."""

    cpu_util: float  # process CPU seconds per wall second (1.0 = one core busy)
    send_lag_p99_ms: float | None
    saturated: bool
    note: str
    ceiling_closed_rps: float | None = None  # `--selftest`: this machine's ceiling, closed loop
    ceiling_open_rps: float | None = None  # and the highest open-loop rate it held


class RunResult(msgspec.Struct):
    """Everything one ``coalesce loadtest`` invocation measured."""

    created: str
    command: list[str]
    url: str
    model: str
    mode: str
    scenario: dict[str, object]
    steps: list[StepResult]
    generator: GeneratorStats
    slo_p99_ms: float | None = None
    max_rps_within_slo: float | None = None
    schema: int = SCHEMA_VERSION


def save(result: RunResult, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")


def load(path: Path) -> RunResult:
    return msgspec.json.decode(path.read_bytes(), type=RunResult)
