"""The Python client's wire logic, without a server: errors, retry delays, splitting, decoding."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from coalesce.service.client_wire import APIError, Ranked, Wire, parse_error


def wire(**kw: Any) -> Wire:
    options: dict[str, Any] = {
        "base_url": "http://h:1/",
        "api_key": None,
        "timeout": 5.0,
        "max_retries": 2,
        "max_retry_wait": 30.0,
        "batch_size": None,
        "on_retry": None,
    }
    options.update(kw)
    return Wire(**options)


INFO = {
    "max_client_batch_size": 2,
    "models": [{"id": "clf", "task": "classify"}, {"id": "emb", "task": "embed"}],
}


def test_openai_shaped_error_keeps_the_servers_message_code_and_retry_after() -> None:
    body = {
        "error": {
            "message": "Too much work queued",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
    }
    err = parse_error(429, json.dumps(body).encode(), {"Retry-After": "3"})
    assert (err.status, err.message, err.code, err.type, err.retry_after) == (
        429,
        "Too much work queued",
        "queue_full",
        "rate_limit_error",
        3.0,
    )
    assert "Too much work queued" in str(err)


def test_the_exact_retry_after_ms_wins_over_whole_seconds() -> None:
    # The server plans retries to the millisecond (callers refused together come back one after the
    # other); Retry-After can only say whole seconds.
    headers = {"Retry-After": "1", "retry-after-ms": "240"}
    assert parse_error(429, b"{}", headers).retry_after == pytest.approx(0.24)
    assert parse_error(429, b"{}", {"Retry-After": "2"}).retry_after == 2.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": "Input validation error", "error_type": "Validation"}', "Input validation error"),
        (b'{"message": "flat", "code": 400, "type": "x"}', "flat"),
        (b"upstream exploded", "upstream exploded"),
        (b"", "Service Unavailable"),
    ],
)
def test_other_error_shapes_still_surface_a_message(body: bytes, message: str) -> None:
    err = parse_error(503, body, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert err.message == message
    assert err.retry_after is None  # an HTTP date: the client falls back to its own backoff


@pytest.mark.parametrize(
    "body",
    [
        b'{"error": "inputs[1] is too long", "error_type": "Validation"}',
        b'{"message": "inputs[1] is too long"}',
    ],
)
def test_tei_and_cohere_errors_take_their_code_from_the_header(body: bytes) -> None:
    err = parse_error(422, body, {"x-error-code": "input_too_long"})
    assert (err.message, err.code) == ("inputs[1] is too long", "input_too_long")


def test_only_429_and_503_are_retried_and_only_while_retries_remain() -> None:
    w = wire(max_retries=1)
    assert w.refused(0, 429, b'{"error": {"message": "busy"}}', {}).message == "busy"
    assert w.refused(0, 503, b"{}", {}).status == 503
    with pytest.raises(APIError) as info:
        w.refused(1, 429, b'{"error": {"message": "still busy"}}', {})
    assert info.value.message == "still busy"
    with pytest.raises(APIError) as info:
        w.refused(0, 400, b'{"error": {"message": "bad input", "code": "empty_input"}}', {})
    assert info.value.code == "empty_input"
    assert w.unreachable(0, ConnectionRefusedError("refused")).status == 0
    with pytest.raises(APIError, match="Could not reach"):
        w.unreachable(1, ConnectionRefusedError("refused"))


def test_delay_waits_at_least_retry_after_capped_and_reports_it() -> None:
    seen: list[tuple[APIError, float]] = []
    w = wire(max_retry_wait=5.0, on_retry=lambda err, wait: seen.append((err, wait)))
    for _ in range(50):
        assert 2.0 <= w.delay(0, APIError(429, "x", retry_after=2.0)) <= 2.5
        assert 5.0 <= w.delay(0, APIError(429, "x", retry_after=120.0)) <= 6.25
        assert 0.0 < w.delay(3, APIError(0, "down")) <= 2.0  # backoff without Retry-After
    assert len(seen) == 150 and seen[0][0].retry_after == 2.0


def test_requests_split_to_the_servers_cap_and_default_to_its_first_model_of_the_task() -> None:
    w = wire()
    w.learn(INFO)
    bodies = w.embed_requests(["a", "b", "c", "d", "e"], None, 16)
    assert [b["input"] for b in bodies] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(
        b["model"] == "emb" and b["encoding_format"] == "base64" and b["dimensions"] == 16 for b in bodies
    )
    assert w.embed_requests([], "m", None) == [{"model": "m", "input": [], "encoding_format": "base64"}]
    chunked = w.embed_requests(["a", "b", "c"], None, None, "chunk", 8)  # every part says so
    assert [(b["long_input"], b["chunk_overlap"]) for b in chunked] == [("chunk", 8), ("chunk", 8)]
    assert [a for a, _ in w.rerank_requests("q", ["x", "y", "z"], "rr")] == [0, 2]
    assert w.classify_requests("one", None, ["l1"], True) == [
        {"input": ["one"], "raw_scores": True, "labels": ["l1"]}
    ]
    with pytest.raises(APIError, match="serves no rerank model"):
        w.default_model("rerank")
    explicit = wire(batch_size=10)
    explicit.learn(INFO)
    assert explicit.parts(25) == [(0, 10), (10, 20), (20, 25)]


def test_base64_embeddings_decode_in_index_order() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = [
        {"index": i, "embedding": base64.b64encode(rows[i].astype("<f4").tobytes()).decode()} for i in (1, 0)
    ]
    got = Wire.embeddings({"data": data})
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, rows)


def test_split_rerank_results_merge_into_one_ranking() -> None:
    parts = [
        (0, {"results": [{"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.1}]}),
        (2, {"results": [{"index": 0, "relevance_score": 0.5}]}),
    ]
    assert Wire.ranks(parts, 2) == [Ranked(1, 0.9), Ranked(2, 0.5)]
    assert [r.index for r in Wire.ranks(parts, None)] == [1, 2, 0]


def test_the_client_imports_neither_torch_nor_the_server() -> None:
    code = (
        "import sys, coalesce.service.client; "
        "bad = [m for m in ('torch', 'transformers', 'coalesce.service.gateway', 'coalesce.kernels') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
