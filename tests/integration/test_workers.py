"""`coalesce serve --workers 2`: two gateway processes on one port in front of one engine process.

Every answer is right whichever gateway gives it, inputs from both gateways share the engine's queue,
refusals read exactly as in one process, a caller that leaves has its queued inputs dropped in the
engine, and either half dying is noticed at once: an engine killed answers 503 within moments and a
gateway killed has its queued work dropped; the supervisor then exits non-zero. Gateways never load
torch. (SIGTERM under load with --workers 2 is in test_shutdown.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from coalesce.loadtests import procs
from coalesce.loadtests.bench_longinput import long_texts
from coalesce.service.metrics import FLUSH_S

from ..conftest import REPO, metric, metrics_text, roles, wait_all_gateways, wait_ready
from ..fakes import FileGate
from .test_long_input import by_hand

MODEL = "all-MiniLM-L6-v2"
# The real tokenizer, 200 ms a batch; backlogs are the point here, so the queue-wait bound is off.
SLOW = ["--runner-factory", "tests.fakes:slow_minilm", "--max-queue-wait-ms", "0"]


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileGate:
    """The device gate of the ``slow_minilm`` servers this test starts (they inherit the environment):
    while the test holds it, batches wait, so what queues behind them does not depend on timing."""
    monkeypatch.setenv("SLOW_MINILM_GATE", str(tmp_path / "gate"))
    return FileGate(tmp_path / "gate")


async def until(url: str, name: str, at_least: float, model: str | None = None, **labels: str) -> str:
    """Poll ``/metrics`` (at most 20 s) until ``name`` reaches ``at_least``; the scrape that showed it."""
    for _ in range(1000):
        text = await metrics_text(url)
        if metric(text, name, model, **labels) >= at_least:
            return text
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} {labels} never reached {at_least}")


async def test_two_gateways_one_engine_answer_as_one_process(replica: Any, st_model: Any) -> None:
    r = replica(2)
    await wait_all_gateways(r)
    tree = roles(r.proc.pid)
    assert len(tree["gateway"]) == 2 and len(tree["engine"]) == 1

    # Only the engine loads torch: a gateway tokenises with the tokenizer the engine sent it.
    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    assert "libtorch" in maps(tree["engine"][0])
    for gateway in tree["gateway"]:
        assert "libtorch" not in maps(gateway)

    texts = [f"worker test sentence number {i}" for i in range(24)]
    gateways: set[str] = set()
    rows = []
    # A fresh connection per request, so the kernel spreads them over both gateways' sockets.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for text in texts:
            async with s.post(r.url + "/v1/embeddings", json={"model": MODEL, "input": text}) as resp:
                assert resp.status == 200
                gateways.add(resp.headers["x-request-id"][:12])
                rows.append((await resp.json())["data"][0]["embedding"])
        pairs = [[f"pair {i} first text", f"pair {i} second text"] for i in range(8)]
        batch = await asyncio.gather(*(
            s.post(r.url + "/embed", json={"inputs": p}) for p in pairs
        ))
        batch_rows = [await resp.json() for resp in batch]
    # The engine writes its batch series to the shared files a few times a second (BatchTally), and each
    # gateway its answered requests (Metrics.request_done): a scrape reads another process's up to 50 ms late.
    await until(r.url, "coalesce_inputs_total", 24 + 16, MODEL)
    metrics = await until(r.url, "coalesce_requests_total", 24, route="/v1/embeddings", status="200")
    assert len(gateways) == 2, "both gateways must have served"
    want = st_model.encode(texts, normalize_embeddings=True)
    assert np.sum(np.asarray(rows) * want, axis=1).min() >= 0.99999
    for p, got in zip(pairs, batch_rows, strict=True):
        want_pair = st_model.encode(p, normalize_embeddings=True)
        assert np.sum(np.asarray(got) * want_pair, axis=1).min() >= 0.99999

    # One scrape, whichever gateway answered it, counts what both served and the engine's batches.
    assert metric(metrics, "coalesce_requests_total", route="/v1/embeddings", status="200") == 24
    assert metric(metrics, "coalesce_inputs_total", MODEL) == 24 + 16
    assert metric(metrics, "coalesce_batches_total", MODEL) >= 1
    assert metric(metrics, "coalesce_ready") == 1

    r.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(r.proc.wait, 60) == 0
    assert procs.children(r.proc.pid) == []


async def test_tei_token_similarity_and_decode_routes_through_the_engine(replica: Any, st_model: Any) -> None:
    r = replica(2)
    await wait_all_gateways(r)
    texts = [f"token route sentence number {i}" + " more" * i for i in range(8)]
    want_tokens = st_model.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    want = st_model.encode(texts, normalize_embeddings=True)
    count = lambda t: len(st_model.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    long_text = long_texts(1, 700, count)[0]
    gateways: set[str] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:

        async def post(path: str, body: Any) -> Any:
            async with s.post(r.url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                gateways.add(resp.headers["x-request-id"][:12])
                return await resp.json()

        # Token and pooled requests at once, from both gateways: they share the engine's queue but
        # never a forward, and each caller gets its own rows.
        answers = await asyncio.gather(
            *(post("/embed_all", {"inputs": t}) for t in texts),
            *(post("/embed", {"inputs": t}) for t in texts),
        )
        pair = {"source_sentence": texts[0], "sentences": texts[1:]}
        similarity = await post("/similarity", {"inputs": pair})
        ids = st_model.tokenizer(texts[3])["input_ids"]
        decoded = await post("/decode", {"ids": ids})
        # A long input's windows cross to the engine marked to come back unnormalised.
        chunked = await post("/v1/embeddings", {"model": MODEL, "input": long_text, "long_input": "chunk"})
        async with s.get(r.url + "/info") as resp:
            info = await resp.json()
    assert len(gateways) == 2, "both gateways must have served"
    for got, w in zip(answers[: len(texts)], want_tokens, strict=True):
        w = w.float().numpy()
        assert np.asarray(got[0]).shape == w.shape
        got_unit = np.asarray(got[0]) / np.linalg.norm(got[0], axis=1, keepdims=True)
        assert np.sum(got_unit * (w / np.linalg.norm(w, axis=1, keepdims=True)), axis=1).min() >= 0.99999
    for got, w in zip(answers[len(texts) :], want, strict=True):
        assert float(np.asarray(got[0]) @ w) >= 0.99999
    assert similarity == pytest.approx([float(want[0] @ w) for w in want[1:]], abs=1e-5)
    assert decoded == [texts[3]]
    long_want, long_tokens = by_hand(st_model, long_text)
    assert float(np.dot(chunked["data"][0]["embedding"], long_want)) >= 0.99999
    assert chunked["usage"]["prompt_tokens"] == long_tokens
    assert info["tokenization_workers"] == 4 and info["model_dtype"] == "float32"


def _shape(status: int, body: dict[str, Any], headers: Any) -> tuple[Any, ...]:
    """What a client sees of a refusal, numbers in the message aside (queue sizes differ by timing)."""
    err = body["error"]
    message = re.sub(r"\d+(\.\d+)?", "N", err["message"])
    return status, err["type"], err["code"], err["param"], message, "Retry-After" in headers


async def _refusals(url: str, gate: FileGate) -> dict[str, tuple[Any, ...]]:
    """Provoke each refusal: a held batch keeps the model busy while the rest arrive."""
    long_text = " ".join(["word"] * 30)  # 32 tokens with [CLS] and [SEP]
    other_long = " ".join(["page"] * 30)  # as long, but not the same input (that would wait for it)
    mid_text = " ".join(["word"] * 18)  # 20 tokens
    out = {}
    async with aiohttp.ClientSession() as s:

        async def post(text: str, **headers: str) -> tuple[int, Any, Any]:
            async with s.post(url + "/v1/embeddings", json={"model": MODEL, "input": text},
                              headers=headers) as resp:
                return resp.status, await resp.json(), resp.headers

        # (refusal, what waits, headers of the waiting and refused requests): the queue takes 60
        # tokens, a named tenant 30.
        for name, waiting, refused, first, then in (
            ("queue_full", long_text, other_long, {}, {}),
            ("tenant_queue_full", mid_text, other_long, {"X-Tenant": "t"}, {"X-Tenant": "t"}),
            ("deadline_unmeetable", long_text, "a short query", {}, {"X-Request-Timeout": "60"}),
        ):
            gate.hold()
            try:
                busy = asyncio.ensure_future(post("holds the model", **first))
                await gate.wait_entered()
                queued = asyncio.ensure_future(post(waiting, **first))
                await until(url, "coalesce_queue_depth", 1)
                status, body, headers = await post(refused, **then)
            finally:
                gate.release()
            assert status in (429, 503), (name, status, body)
            assert body["error"]["code"] == name, body
            out[name] = _shape(status, body, headers)
            assert (await busy)[0] == 200 and (await queued)[0] == 200
    return out


async def test_every_refusal_reads_as_in_one_process(replica: Any, gate: FileGate) -> None:
    # No cache: each case's busy and waiting inputs must be computed, not answered from an earlier case.
    flags = [*SLOW, "--max-queued-tokens", "60", "--tenant-max-queued-tokens", "30", "--cache-mb", "0"]
    one, two = replica(1, flags), replica(2, flags)
    await wait_ready(one.url, one.proc)
    await wait_all_gateways(two)
    assert await _refusals(one.url, gate) == await _refusals(two.url, gate)


async def test_a_caller_that_leaves_has_its_queued_inputs_dropped_in_the_engine(
    replica: Any, gate: FileGate
) -> None:
    r = replica(2, SLOW)
    await wait_all_gateways(r)
    async with aiohttp.ClientSession() as s:
        gate.hold()
        try:
            busy = asyncio.ensure_future(
                s.post(r.url + "/v1/embeddings", json={"model": MODEL, "input": "busy"})
            )
            await gate.wait_entered()
            leaver = asyncio.ensure_future(s.post(
                r.url + "/v1/embeddings", json={"model": MODEL, "input": [f"gone {i}" for i in range(5)]}
            ))
            await until(r.url, "coalesce_queue_depth", 5)
            leaver.cancel()  # the client hangs up while its inputs wait behind the busy batch
            await until(r.url, "coalesce_rejected_total", 5, MODEL, reason="cancelled")
        finally:
            gate.release()
        assert (await busy).status == 200
    await until(r.url, "coalesce_inputs_total", 1, MODEL)  # the busy batch, written by the engine
    await asyncio.sleep(4 * FLUSH_S)  # and anything written after it
    text = await metrics_text(r.url)
    assert metric(text, "coalesce_rejected_total", MODEL, reason="cancelled") == 5
    assert metric(text, "coalesce_inputs_total", MODEL) == 1, "never computed"


async def test_an_engine_that_dies_is_answered_503_at_once_and_takes_the_replica_down(
    replica: Any, gate: FileGate
) -> None:
    r = replica(2, [*SLOW, "--max-batch-size", "1"])  # 8 requests, the first held on the device at the kill
    await wait_all_gateways(r)
    engine = roles(r.proc.pid)["engine"][0]
    async with aiohttp.ClientSession() as s:

        async def embed(i: int) -> tuple[int, Any, float]:
            body = {"model": MODEL, "input": [f"in flight {i}"] * 3}
            async with s.post(r.url + "/v1/embeddings", json=body,
                              headers={"X-Request-Timeout": "30000"}) as resp:
                return resp.status, await resp.json(), time.monotonic()

        gate.hold()
        try:
            in_flight = [asyncio.ensure_future(embed(i)) for i in range(8)]
            await gate.wait_entered()
            await until(r.url, "coalesce_inflight_requests", 8 + 1)  # and the scrape asking
            killed = time.monotonic()
            os.kill(engine, signal.SIGKILL)
        finally:
            gate.release()
        answers = await asyncio.gather(*in_flight)
    for status, body, at in answers:
        if status == 200:
            continue  # finished before the kill
        assert status == 503 and body["error"]["code"] == "engine_unavailable", body
        assert at - killed < 5, "answered at once, not at the request's 30 s deadline"
    assert any(status == 503 for status, _, _ in answers)
    assert await asyncio.to_thread(r.proc.wait, 60) == 1, "the platform must see the failure"
    assert procs.children(r.proc.pid) == []


async def test_a_gateway_that_dies_has_its_queued_work_dropped_and_takes_the_replica_down(
    replica: Any, gate: FileGate
) -> None:
    r = replica(2, [*SLOW, "--max-batch-size", "2"])  # 10 inputs a second: work stays queued
    await wait_all_gateways(r)
    victim = roles(r.proc.pid)["gateway"][0]
    engine = roles(r.proc.pid)["engine"][0]
    # Many connections, so the kernel hands some to each gateway; each request queues 4 inputs.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        gate.hold()
        try:
            bodies = [{"model": MODEL, "input": [f"q {n} {i}" for i in range(4)]} for n in range(16)]
            tasks = [asyncio.ensure_future(s.post(r.url + "/v1/embeddings", json=b)) for b in bodies]
            await until(r.url, "coalesce_queue_depth", 60)  # of 64 inputs, 2 held on the device
            os.kill(victim, signal.SIGKILL)
        finally:
            gate.release()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await asyncio.to_thread(r.proc.wait, 60) == 1
    assert not Path(f"/proc/{engine}").exists(), "the engine must be stopped too"
    log = [json.loads(line) for line in r.stop().splitlines() if line.startswith("{")]
    lost = [e for e in log if e["event"] == "gateway_lost"]
    assert len(lost) == 1 and lost[0]["dropped_requests"] > 0, log


async def test_a_garbage_message_on_the_engine_socket_is_refused_and_logged(tmp_path: Path) -> None:
    import msgspec
    from coalesce.service.engine import messages as wire

    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "coalesce.service.cli", "serve", "--role", "engine", "--engine-dir",
         str(engine_dir), "--workers", "1", *SLOW],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    # A stream that breaks the framing itself (a message claiming 10,000 frames) ends that connection,
    # logged, as a gateway that went away; the engine serves the next one.
    for _ in range(600):
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            reader, writer = await asyncio.open_unix_connection(wire.endpoint(str(engine_dir), 0))
            break
        await asyncio.sleep(0.05)
    writer.write((10_000).to_bytes(4, "little"))
    try:
        ended = await asyncio.wait_for(reader.read(), 30) == b""
    except ConnectionResetError:  # (aborted: the engine sends nothing more on it)
        ended = True
    assert ended, "the engine closes that connection"
    writer.close()
    raw = _RawGateway(engine_dir)
    try:
        welcome = await raw.hello()
        assert isinstance(welcome, wire.Welcome) and welcome.models[0].info.name == MODEL

        raw.send([b"\x93not a message"])
        refused, _ = await raw.reply()
        assert isinstance(refused, wire.Refused) and "undecodable" in refused.reason
        no_frames = {"type": "Submit", "jobs": [[1, 0, 1, False, "t", 1.0, 1, 0.0]], "sizes": [4]}
        raw.send([msgspec.msgpack.encode(no_frames)])
        refused, _ = await raw.reply()
        assert isinstance(refused, wire.Refused) and "frames" in refused.reason
        short = wire.Submit([wire.Job(1, 0, 1, False, "t", 1.0, 1, 0.0)], [5])  # 5 ids in a frame of 4
        raw.send([wire.encoder.encode(short), np.array([3, 101, 7592, 102], np.int32).tobytes()])
        refused, _ = await raw.reply()
        assert isinstance(refused, wire.Refused) and "in a frame of 16 bytes" in refused.reason

        deadline = time.monotonic() + 30
        bad = wire.Job(2, 0, 1, False, "default", 1.0, 1, deadline)
        good = wire.Job(3, 0, 1, False, "default", 1.0, 1, deadline)
        frame_bad = np.array([3, 101, 10**7, 102], dtype=np.int32).tobytes()  # an id past the vocabulary
        frame_good = np.array([3, 101, 7592, 102], dtype=np.int32).tobytes()
        raw.send([wire.encoder.encode(wire.Submit([bad, good], [4, 4])), frame_bad + frame_good])
        seen: dict[int, Any] = {}
        await raw.answers({2, 3}, seen)
        assert seen[2].code == "protocol_error" and "vocabulary" in seen[2].message
        assert seen[3].shape == (1, 384), "the engine still serves after refusing garbage"

        assert proc.poll() is None
    finally:
        raw.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    log = err.decode()
    assert proc.returncode == 0
    assert log.count("gateway_message_refused") == 3 and "gateway_job_refused" in log
    assert "link_protocol_broken" in log


async def test_a_supervisor_killed_outright_takes_its_engine_and_gateways_with_it(replica: Any) -> None:
    r = replica(2, ["--runner-factory", "coalesce.loadtests.nullmodel:factory"])
    await wait_all_gateways(r)
    children = procs.children(r.proc.pid)
    assert len(children) == 3
    r.proc.kill()
    r.proc.wait(10)
    for _ in range(100):
        if not any(Path(f"/proc/{pid}").exists() for pid in children):
            break
        await asyncio.sleep(0.05)
    left = [pid for pid in children if Path(f"/proc/{pid}/stat").exists()
            and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert left == [], "no engine or gateway may outlive its supervisor"


class _RawGateway:
    """A gateway's socket to an engine started alone, spoken to directly: whole bulk messages, exactly
    as a gateway sends them, and every reply read back."""

    def __init__(self, engine_dir: Path) -> None:
        from coalesce.service.engine import messages as wire
        from coalesce.service.engine.channel import Link

        self.wire = wire
        self.replies: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.link = Link("test-gateway", lambda parts: self.replies.put_nowait([bytes(p) for p in parts]))
        self.link.connect(wire.endpoint(str(engine_dir), 0))

    def send(self, parts: list[bytes]) -> None:
        assert self.link.send(parts)

    async def reply(self) -> Any:
        parts = await asyncio.wait_for(self.replies.get(), 60)
        return self.wire.gateway_decoder.decode(parts[0]), parts[1:]

    async def hello(self) -> Any:
        self.send([self.wire.encoder.encode(self.wire.Hello(0, os.getpid()))])
        welcome, _ = await self.reply()
        return welcome

    async def submit(self, jobs: dict[int, list[list[int]]]) -> None:
        """One Submit holding every job of ``jobs`` (id → its token-id sequences)."""
        wire, deadline = self.wire, time.monotonic() + 60
        packed = {i: wire.pack_job(seqs) for i, seqs in jobs.items()}
        msg = wire.Submit([wire.Job(i, 0, len(jobs[i]), marked, "default", 1.0, 1, deadline)
                           for i, (marked, _) in packed.items()],
                          [len(frame) // 4 for _, frame in packed.values()])
        self.send([wire.encoder.encode(msg), b"".join(f for _, f in packed.values())])

    async def answers(self, ids: set[int], seen: dict[int, Any]) -> None:
        """Read replies into ``seen`` (id → rows, or the refusal) until every one of ``ids`` is there."""
        while not ids <= seen.keys():
            results, frames = await self.reply()
            seen.update({f.id: f.error for f in results.failed})
            pieces = self.wire.split_frame([d.n * d.dim for d in results.done], frames[0])
            for d, piece in zip(results.done, pieces, strict=True):
                seen[d.id] = np.frombuffer(piece, dtype=np.float32).reshape(d.n, d.dim)

    def close(self) -> None:
        self.link.close()


def _engine_alone(engine_dir: Path) -> subprocess.Popen[bytes]:
    """An engine with no gateway process, gated (``slow_echo``: each row is its sequence's ids)."""
    engine_dir.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "coalesce.service.cli", "serve", "--role", "engine", "--engine-dir",
         str(engine_dir), "--workers", "1", "--cache-mb", "0", "--runner-factory", "tests.fakes:slow_echo",
         "--max-queue-wait-ms", "0"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def test_a_bulk_message_is_answered_request_by_request_and_a_cancel_in_its_middle_drops_one(
    tmp_path: Path, gate: FileGate
) -> None:
    """Ten requests in one message come back to the right ids with the right rows; the one cancelled in
    the middle of the message is never answered; a gateway that dies with a bulk message queued has all
    of it dropped, and the engine serves the next gateway."""
    from coalesce.kernels.tokens import TokenizerAdapter

    proc = _engine_alone(tmp_path / "engine")
    raw = _RawGateway(tmp_path / "engine")
    try:
        welcome = await raw.hello()
        tokens = TokenizerAdapter.from_spec(welcome.models[0].tokenizer)
        texts = {i: [f"bulk request {i} asks about topic {i * 7}"] for i in range(1, 11)}
        texts[6] = ["a request of two inputs", "its second input, longer than its first one"]
        gate.hold()
        try:
            await raw.submit({100: tokens.tokenize(["holds the device"])})
            await gate.wait_entered()
            await raw.submit({i: tokens.tokenize(t) for i, t in texts.items()})
            raw.send([raw.wire.encoder.encode(raw.wire.Cancel([5]))])
            await asyncio.sleep(0.5)  # the cancel is read while every request still waits
        finally:
            gate.release()
        seen: dict[int, Any] = {}
        await raw.answers({100, *texts} - {5}, seen)
        assert 5 not in seen, "the cancelled request is never answered"
        for i, t in texts.items():
            if i != 5:  # each request's rows are its own sequences' (echoed ids), in its order
                ids = tokens.tokenize(t)
                assert seen[i].shape == (len(t), 384), i
                assert [row[: len(s)].tolist() for row, s in zip(seen[i], ids, strict=True)] == ids, i

        gate.hold()
        try:
            await raw.submit({200: tokens.tokenize(["holds the device again"])})
            await gate.wait_entered()
            bulk = {i: tokens.tokenize([f"never computed {i}"]) for i in range(201, 209)}
            bulk[209] = [[101, 10**7, 102]]  # malformed: refused at once, so the bulk was surely read
            await raw.submit(bulk)
            refused: dict[int, Any] = {}
            await raw.answers({209}, refused)
            assert refused[209].code == "protocol_error"
            raw.close()  # the gateway dies with 8 requests queued and one on the device
            await asyncio.sleep(1.0)
        finally:
            gate.release()
        raw = _RawGateway(tmp_path / "engine")
        await raw.hello()
        await raw.submit({1: tokens.tokenize(["the next gateway"])})
        again: dict[int, Any] = {}
        await raw.answers({1}, again)
        assert again[1].shape == (1, 384)
    finally:
        raw.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    log = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    lost = [e for e in log if e["event"] == "gateway_lost"]
    assert [e["dropped_requests"] for e in lost] == [9], log


async def test_bursts_of_mixed_requests_answer_under_workers_2_exactly_as_in_one_process(
    replica: Any
) -> None:
    """Many concurrent requests, so each gateway sends them in bulk and gets them back in bulk: every
    answer is the one a single process gives for the same request."""
    one, two = replica(1, ["--cache-mb", "0"]), replica(2, ["--cache-mb", "0"])
    await wait_ready(one.url, one.proc)
    await wait_all_gateways(two)
    requests: list[tuple[str, dict[str, Any]]] = []
    for i in range(40):
        if i % 4 == 0:
            requests.append(("/embed", {"inputs": [f"pair {i} first", f"pair {i} second, longer"]}))
        elif i % 4 == 1:
            requests.append(("/v1/embeddings", {"model": MODEL, "input": [f"text {i}", f"more text {i}"]}))
        else:
            requests.append(("/v1/embeddings", {"model": MODEL, "input": f"a query number {i} here"}))

    async def burst(url: str) -> list[np.ndarray]:
        async with aiohttp.ClientSession() as s:

            async def post(route: str, body: dict[str, Any]) -> np.ndarray:
                async with s.post(url + route, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    got = await resp.json()
                rows = got if route == "/embed" else [d["embedding"] for d in got["data"]]
                return np.asarray(rows, dtype=np.float32)

            return await asyncio.gather(*(post(route, body) for route, body in requests))

    for a, b in zip(await burst(one.url), await burst(two.url), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=2e-5)
