"""The ``features`` bench section: what the result cache saves, and what compact output types keep.

* Cache: a closed-loop run where 30% of requests repeat an earlier request's text (``--repeat 0.3``),
  against the same run with ``--cache-mb 0``: throughput and latency side by side.
* Binary and int8 output: for each sentence of the built-in corpus (eight topics), its ten nearest
  neighbours by Hamming distance on ``ubinary`` (and by dot product on ``int8``) against its ten nearest
  by cosine on ``float``, all from ``/v2/embed`` of one server: the recall a vector store keeps.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import numpy as np
from coalesce.loadtests import servers
from coalesce.loadtests.bench_sections import _HEADERS, CLIENTS, _met, _row, _run, _spec
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix
from msgspec.structs import replace

REPEAT = 0.3
NEIGHBOURS = 10


def recall_at_k(reference: np.ndarray, candidate: np.ndarray, k: int = NEIGHBOURS) -> float:
    """Mean overlap of each row's top ``k`` by ``candidate`` similarity with its top ``k`` by
    ``reference`` similarity (both n × n, higher is nearer; the diagonal is ignored)."""
    ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
    np.fill_diagonal(ref, -np.inf)
    np.fill_diagonal(cand, -np.inf)
    hits = [
        len(set(np.argsort(-ref[i], kind="stable")[:k]) & set(np.argsort(-cand[i], kind="stable")[:k]))
        for i in range(ref.shape[0])
    ]
    return float(np.mean(hits)) / k


def _embed_v2(base_url: str, texts: list[str], types: list[str]) -> dict[str, list[list[float]]]:
    body = json.dumps({"texts": texts, "input_type": "search_document", "embedding_types": types}).encode()
    req = urllib.request.Request(base_url + "/v2/embed", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.load(resp)["embeddings"])


def features(args: argparse.Namespace) -> tuple[str, str]:
    from coalesce.kernels.calibration import CORPUS

    out = args.out / "features"
    closed = Scenario(
        mode=Mode.CLOSED,
        concurrency=CLIENTS,
        duration=args.duration,
        warmup=3.0,
        mix=Mix.SHORT,
        repeat=REPEAT,
    )
    single = replace(closed, concurrency=1)
    runs = {}
    for name, flags in (("cache on (64 MiB)", []), ("--cache-mb 0", ["--cache-mb", "0"])):
        with servers.running(
            _spec(args, name, [*flags, "--log-level", "warning"]), out / "logs", args.ready_timeout
        ) as srv:
            runs[name] = (
                _run(srv.url, closed, f"{name} c{CLIENTS}", out),
                _run(srv.url, single, f"{name} c1", out),
            )
    (on32, on1), (off32, off1) = runs["cache on (64 MiB)"], runs["--cache-mb 0"]
    speedup = on32.achieved_rps / off32.achieved_rps if off32.achieved_rps else 0.0
    p50_on = on1.latency.p50_ms if on1.latency else float("nan")
    p50_off = off1.latency.p50_ms if off1.latency else float("nan")
    rows = [
        _row("cache on (64 MiB)", on32, f"{CLIENTS} clients"),
        _row("--cache-mb 0", off32, f"{CLIENTS} clients"),
        _row("cache on (64 MiB)", on1, "1 client"),
        _row("--cache-mb 0", off1, "1 client"),
    ]

    with servers.running(
        _spec(args, "quantised", ["--log-level", "warning"]), out / "logs", args.ready_timeout
    ) as srv:
        got = _embed_v2(srv.base_url, list(CORPUS), ["float", "int8", "ubinary"])
    floats = np.asarray(got["float"], dtype=np.float64)
    int8 = np.asarray(got["int8"], dtype=np.float64)
    bits = np.unpackbits(np.asarray(got["ubinary"], dtype=np.uint8), axis=1).astype(np.float64)
    cosine = floats @ floats.T
    matching_bits = bits @ bits.T + (1 - bits) @ (1 - bits).T  # bits - Hamming distance
    recall_bin = recall_at_k(cosine, matching_bits)
    recall_int8 = recall_at_k(cosine, int8 @ int8.T)
    body = (
        f"**Result cache.** Short single-sentence requests, closed loop, {REPEAT:.0%} of them repeating "
        f"an earlier request's text (`coalesce loadtest --repeat {REPEAT}`), {args.duration:g} s after "
        "3 s warm-up; the same run against the default cache and against `--cache-mb 0` (identical "
        "inputs in flight are computed once either way).\n\n"
        + markdown_table(_HEADERS, rows)
        + f"\n\nThroughput with the cache ÷ without: **{speedup:.2f}×**; 1-client p50 {fmt(p50_on)} ms "
        f"against {fmt(p50_off)} ms.\n\n"
        f"**Compact output types.** `/v2/embed` of the {len(CORPUS)}-sentence built-in corpus (8 topics "
        f"of 12): each sentence's {NEIGHBOURS} nearest neighbours by another representation against its "
        f"{NEIGHBOURS} nearest by cosine on `float`.\n\n"
        + markdown_table(
            ["representation", "bytes per vector", f"recall@{NEIGHBOURS} against float", "target"],
            [
                ["float (float32)", str(floats.shape[1] * 4), "1.00", "-"],
                [
                    "int8 (one symmetric corpus scale), dot product",
                    str(int8.shape[1]),
                    f"{recall_int8:.2f}",
                    "-",
                ],
                [
                    "ubinary, Hamming distance",
                    str(bits.shape[1] // 8),
                    f"{recall_bin:.2f}",
                    f"≥ 0.60 (the test's floor): {_met(recall_bin >= 0.6)}",
                ],
            ],
        )
        + "\n"
    )
    return "Features: result cache, compact output types (CPU)", body
