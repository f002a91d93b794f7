"""What one engine process takes when it is the bottleneck: requests/s and its CPU per request, fed over
its real sockets by many gateways at once, as a GPU host's gateways feed it.

    python -m coalesce.loadtests.engine_ceiling [--gateways 1,4,15] [--outstanding 2] [--seconds 4]
                                                [--model PATH] [--real] [--serve-arg FLAG ...]
                                                [--profile S] [--json]

The bench's engine section measures the engine behind HTTP gateways on this machine's two cores, where
the gateways and the load generator take most of the CPU and the engine is never the busy process: at
"saturation" it gets two or three requests a batch, and its CPU per request is mostly per-batch cost
spread thin. A 16-core GPU host runs one engine behind 15 gateways; what caps it is how many requests/s
the engine itself takes when every core in front of it is sending. That is what this measures.

The engine is the real one (``coalesce serve --role engine``: the ``Submit`` decode, admission, the fair
queue, the scheduler, the batcher, the device thread, metrics, the ``Results`` message, the Unix sockets)
with the null model's forward (``coalesce.loadtests.nullmodel``: the packaged model's tokenizer and facts,
a forward that costs nothing) and no result cache. In front of it, this process plays ``--gateways`` G
gateways: G of the gateways' own engine clients (``service/gateway/remote.py``'s ``EngineClient``, no
HTTP), each keeping ``--outstanding`` K one-sentence requests (distinct, already tokenised) in flight and
sending the next as each is answered. After a second's warm-up, for ``--seconds``: requests answered
per second; each request's time from its submit to its answer (p50, p99: the engine's share of a
request's latency, its socket trips included); the engine process's CPU (every thread, from /proc) per
request and as a share of one core; the mean batch (the engine's own ``coalesce_batch_size``, its
metrics shared through a directory as under ``--workers``); and the requests each answer message carried
(one message a batch to each gateway that has rows in it).

The engine has no one ceiling: the more requests wait in it, the larger its batches and the less
each one costs (per-batch work shared), at the price of latency; so a row for each count in flight, with
the latency it took. Where the engine's share of a core is near 1, the row's requests/s is what it takes
at that many in flight; below that, this process (on another core) could not send faster. A request's
cost to the gateways is not here: see the bench's engine section (gateways µs/req) and ``gateway_ops``.
The forward costs nothing: a real device's own CPU (a GPU's launches and copies, on the device thread)
comes on top, and a batch that waits on a busy device costs the engine more wake-ups (``engine_ops
--forward-us``). ``--real`` measures those too: the engine runs the model's own forward on its device
(on a GPU host, the engine as served; on a CPU the forward itself then takes the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROFILE_TOP = 15  # functions a row's profile lists
SENTENCES = 4096  # distinct inputs, cycled: far more than are ever in flight, so none is shared in a batch


def _sentences(n: int) -> list[str]:
    """``n`` texts of the bench's short mix (``workload``'s search queries: the HTTP rows' requests)."""
    from coalesce.loadtests.workload import Mix, TextSource, sample_length

    rng = random.Random(0)
    source = TextSource(rng)
    return [source.text(sample_length(Mix.SHORT, rng)) for _ in range(n)]


def _engine_command(directory: str, gateways: int, model: str | None, real: bool,
                    serve_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "coalesce.service.cli", "serve", "--role", "engine",
            "--engine-dir", directory, "--workers", str(gateways), "--worker-id", "0", "--cache-mb", "0",
            *([] if real else ["--runner-factory", "coalesce.loadtests.nullmodel:factory"]),
            *(["--model", model] if model else []), *serve_args]


async def _drive(directory: str, metrics_dir: str, gateways: int, outstanding: int, warmup_s: float,
                 seconds: float, engine_pid: int, profile_s: int = 0) -> dict[str, Any]:
    from coalesce.kernels.tokens import TokenizerAdapter
    from coalesce.loadtests.procs import cpu_seconds
    from coalesce.loadtests.pyspy_summary import record_gil
    from coalesce.loadtests.stats import summarize
    from coalesce.service.batching.fair import DEFAULT_TENANT, PRIORITIES
    from coalesce.service.engine import messages as wire
    from coalesce.service.gateway.admission import Admission
    from coalesce.service.gateway.remote import EngineClient

    answers = [0]  # Results messages with rows, over every client

    class Client(EngineClient):
        def _results(self, msg: wire.Results, frames: Sequence[memoryview]) -> None:
            if msg.done:
                answers[0] += 1
            super()._results(msg, frames)

    lost: list[str] = []
    clients = [Client(wire.endpoint(directory, i), i, lost.append) for i in range(gateways)]
    welcomes = await asyncio.wait_for(asyncio.gather(*(c.start() for c in clients)), 120)
    welcome = welcomes[0]
    if welcome.error is not None:
        raise SystemExit(f"the engine could not load its model: {welcome.error}")
    tokens = TokenizerAdapter.from_spec(welcome.models[0].tokenizer)
    inputs = [[tokens.with_special_tokens(ids)] for ids in tokens.tokenize(_sentences(SENTENCES))]
    failed: list[BaseException] = []
    state = {"stop": False, "next": 0}

    latencies: list[float] = []  # seconds from submit to answer, of requests answered in the window
    window = [False]

    def send(client: EngineClient) -> None:
        now = time.monotonic()
        k = state["next"]
        state["next"] = k + 1
        adm = Admission(DEFAULT_TENANT, 1.0, PRIORITIES["normal"], 30.0, now + 30.0, now)
        fut = client.submit(0, inputs[k % SENTENCES], adm)
        fut.add_done_callback(lambda f: done(client, f, now))

    def done(client: EngineClient, fut: asyncio.Future[Any], sent: float) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:
            failed.append(fut.exception())  # type: ignore[arg-type]
            return
        if window[0]:
            latencies.append(time.monotonic() - sent)
        if not state["stop"]:
            send(client)

    for client in clients:
        for _ in range(outstanding):
            send(client)
    def read() -> tuple[int, float, float, float, tuple[float, float]]:
        # (answer messages, the engine's CPU, this process's, the clock, the engine's batches)
        return (answers[0], cpu_seconds(engine_pid), cpu_seconds(os.getpid()), time.perf_counter(),
                _batches(metrics_dir))

    await asyncio.sleep(warmup_s)

    m0, e0, d0, t0, b0 = read()
    window[0] = True
    spying = asyncio.ensure_future(asyncio.to_thread(record_gil, {"engine": engine_pid}, profile_s)) \
        if profile_s > 0 else None
    await asyncio.sleep(seconds)
    window[0] = False
    m1, e1, d1, t1, b1 = read()
    spied = await spying if spying is not None else None
    state["stop"] = True
    for client in clients:
        await client.drain(10.0)
        await client.close()
    if failed or lost:
        raise SystemExit(f"{len(failed)} requests failed ({failed[:1]!r}); lost: {lost[:1]}")
    n, wall, latency = len(latencies), t1 - t0, summarize(latencies)  # (the window's answers)
    if n == 0 or latency is None:
        raise SystemExit(f"no request answered in the {seconds:g} s window")
    return {"gateways": gateways, "outstanding": outstanding, "requests": n, "rps": n / wall,
            "engine_us": (e1 - e0) / n * 1e6, "engine_core": (e1 - e0) / wall,
            "driver_us": (d1 - d0) / n * 1e6, "per_answer": n / max(m1 - m0, 1),
            "mean_batch": (b1[0] - b0[0]) / max(b1[1] - b0[1], 1),
            "p50_ms": latency.p50_ms, "p99_ms": latency.p99_ms,
            **({"profile": _top(spied, PROFILE_TOP)} if spied is not None else {})}


def _top(spied: Any, n: int) -> dict[str, Any] | str:
    """``record_gil``'s engine summary as JSON: its samples and the ``n`` functions with the most of
    their own; or why there are none."""
    if isinstance(spied, str):
        return spied
    total, _, own = spied["engine"]
    return {"total": total, "own": own.most_common(n)}


def _batches(metrics_dir: str) -> tuple[float, float]:
    """Inputs batched and batches run, as the engine's shared metrics files say (written every
    ``FLUSH_S``: read at both ends of the window, the lag is the same at each)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    found = {s.name: s.value for m in registry.collect() if m.name == "coalesce_batch_size"
             for s in m.samples}
    return found.get("coalesce_batch_size_sum", 0.0), found.get("coalesce_batch_size_count", 0.0)


def measure(gateways: int, outstanding: int, seconds: float, warmup_s: float = 1.0,
            model: str | None = None, profile_s: int = 0, real: bool = False,
            serve_args: Sequence[str] = ()) -> dict[str, Any]:
    """One row: an engine process of its own, fed by ``gateways`` clients of ``outstanding`` each;
    ``model``: the model directory (None: the packaged one), whose tokenizer and facts the null model
    takes, or which the engine serves itself with ``real``; ``profile_s`` > 0: py-spy on the engine for
    that long from the window's start (the row's ``profile``); ``real``: the engine runs the model itself
    (its forward on its device), not the null model; ``serve_args``: more ``coalesce serve`` flags for
    the engine."""
    import uvloop

    with tempfile.TemporaryDirectory(prefix="coalesce-ceiling-") as directory:
        os.chmod(directory, 0o700)
        metrics_dir = os.path.join(directory, "metrics")
        os.mkdir(metrics_dir)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        log = Path(directory) / "engine.log"
        with log.open("wb") as out:
            engine = subprocess.Popen(_engine_command(directory, gateways, model, real, serve_args), env=env,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return uvloop.run(_drive(directory, metrics_dir, gateways, outstanding, warmup_s, seconds,
                                     engine.pid, profile_s))
        except BaseException:
            sys.stderr.write(log.read_text(errors="replace")[-3000:])
            raise
        finally:
            engine.send_signal(signal.SIGTERM)
            try:
                engine.wait(30)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()


def main(argv: Sequence[str] | None = None) -> int:
    from coalesce.loadtests.pyspy_summary import shares

    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.engine_ceiling",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateways", default="1,4,15", help="comma-separated gateway counts (1,4,15)")
    p.add_argument("--outstanding", default="2",
                   help="comma-separated requests in flight per gateway (2); a row for each pair of the two")
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per row (4)")
    p.add_argument("--model", metavar="PATH", help="the model directory (default: the packaged one; the GPU "
                   "bundle's where there is none)")
    p.add_argument("--profile", type=int, default=0, metavar="S",
                   help="py-spy (--gil) on the engine for S whole seconds of each row's window, S at most "
                   "--seconds: the functions holding its interpreter lock most, after the table (py-spy "
                   "beside it takes CPU of its own: read the row's other figures from a run without it)")
    p.add_argument("--real", action="store_true",
                   help="the engine runs the model's own forward on its device (auto: the GPU where there is "
                   "one) instead of the null model's: what the device's own CPU work adds")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="a `coalesce serve` flag for the engine, repeated for each (--serve-arg=--dtype ...)")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = p.parse_args(argv)
    if args.profile > args.seconds:
        p.error("--profile must be at most --seconds")
    rows = [measure(int(g), int(k), args.seconds, model=args.model, profile_s=args.profile, real=args.real,
                    serve_args=args.serve_arg)
            for g in args.gateways.split(",") for k in args.outstanding.split(",")]
    print("gateways  in flight  requests/s  engine µs/request  engine core  mean batch  requests/answer  "
          "p50 ms  p99 ms  driver µs/request")
    for r in rows:
        print(f"{r['gateways']:>8}  {r['gateways'] * r['outstanding']:>9}  {r['rps']:>10,.0f}  "
              f"{r['engine_us']:>17.1f}  {r['engine_core']:>11.2f}  {r['mean_batch']:>10.2f}  "
              f"{r['per_answer']:>15.2f}  {r['p50_ms']:>6.2f}  {r['p99_ms']:>6.2f}  {r['driver_us']:>17.1f}")
    for r in rows:
        if "profile" in r:
            spied = r["profile"]
            said = f" ({spied['total']:,}):" if isinstance(spied, dict) else f": {spied}"
            print(f"\n{r['gateways']} gateways x {r['outstanding']}: where the engine's interpreter lock "
                  f"went, own samples{said}")
            if isinstance(spied, dict):
                print("\n".join(shares(spied["total"], spied["own"])))
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
