"""``make fuzz``: schemathesis against a real ``coalesce serve`` on loopback, every route of its document.

    .venv/bin/python -m tests.integration.fuzz [--max-examples N] [--seed S] [-- schemathesis options]

Starts ``coalesce serve`` (a subprocess, as an operator runs it) with the packaged MiniLM, which
``make serve`` serves, beside the tiny classifier ``clf``, cross-encoder ``rr`` and SPLADE model
``splade`` (``tiny_models``, built into a temporary folder), so every route has a model of its task;
waits for ``/ready``; runs ``schemathesis run URL/openapi.json --checks CHECKS`` with a fixed seed;
stops the server and exits with schemathesis's status. The checks: no 5xx, every status, content type,
header and body as the document declares (so every 4xx in its route's error shape), and nothing the
document forbids accepted. The run's figures (operations, test cases, failures) are schemathesis's
summary and its JSON report (``--report-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..conftest import free_port
from .tiny_models import classifier_dir, reranker_dir, splade_dir

SEED = 20250115
# What the fuzzer holds the server to. Left out: positive_data_acceptance (a request the document
# allows may still be refused for what no schema states, such as a model name this server does not
# serve or an id outside the vocabulary, and is answered with a documented 4xx, which the other
# checks hold to its shape) and the checks about resources and authorization this API does not have
# (use_after_free, ensure_resource_availability, object_level_authorization).
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
    "response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method,"
    "allow_header_conformance"
)
FUZZ_KEY = "fuzz-key"  # the one API key of a --api-keys run
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


def _bin(name: str) -> str:
    """An executable of the running interpreter's environment (the project's .venv)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


# Each model route → the served model of its task (the packaged model under its own name).
EMBEDDER = "all-MiniLM-L6-v2"
ROUTE_MODELS = {
    **dict.fromkeys(("/v1/embeddings", "/embeddings", "/embed", "/embed_all", "/similarity", "/v2/embed",
                     "/tokenize", "/decode", "/", "/classify", "/v1/classify"), EMBEDDER),
    "/predict": "clf",
    **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), "rr"),
    "/embed_sparse": "splade",
}
HOOKS = Path(__file__).with_name("fuzz_hooks.py")


def serve_command(port: int, keys_file: Path | None = None) -> list[str]:
    """``coalesce serve`` on 127.0.0.1:``port`` with a model for every route's task (and API keys)."""
    models = ["default", f"clf={classifier_dir()}", f"rr={reranker_dir()}", f"splade={splade_dir()}"]
    keys = ["--api-keys-file", str(keys_file)] if keys_file else []
    return [_bin("coalesce"), "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            *(arg for m in models for arg in ("--model", m)), *keys]


@contextlib.contextmanager
def running_server(keys_file: Path | None = None) -> Iterator[str]:
    """A ``coalesce serve`` process, ready, for the length of the block; stopped (SIGTERM, then
    SIGKILL after STOP_TIMEOUT_S) however the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(serve_command(port, keys_file), env=env)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"coalesce serve exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError(f"coalesce serve was not ready within {READY_TIMEOUT_S:.0f} s")
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


def schemathesis_command(url: str, max_examples: int, seed: int, extra: Sequence[str] = (),
                         checks: str = CHECKS) -> list[str]:
    """The schemathesis run against ``url``'s document: one worker, and no example database, so a
    seed replays the same run whatever ran before."""
    return [_bin("schemathesis"), "run", f"{url}/openapi.json", "--checks", checks,
            "--max-examples", str(max_examples), "--seed", str(seed), "--workers", "1",
            "--request-timeout", "30", "--generation-database", "none", *extra]


def schemathesis_env() -> dict[str, str]:
    """The hooks that point most bodies at a served model (``fuzz_hooks``)."""
    return {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "COALESCE_FUZZ_MODELS": json.dumps(ROUTE_MODELS)}


def fuzz(max_examples: int, seed: int = SEED, extra: Sequence[str] = (), timeout_s: float | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """Start the server, fuzz it, stop it; schemathesis's exit status and output (stdout and stderr)."""
    with running_server() as url:
        return subprocess.run(schemathesis_command(url, max_examples, seed, extra), capture_output=True,
                              text=True, timeout=timeout_s, check=False, env=schemathesis_env())


def bench_block(report: dict[str, Any], tally: dict[str, int], max_examples: int, api_keys: bool) -> str:
    """BENCHMARKS.md's fuzz table from schemathesis's JSON run report and the hooks' deadline tally."""
    ops = report.get("operations") or {}
    cases = report.get("test_cases") or {}
    failures = report.get("failures") or []
    server = sum(f["count"] for f in failures if f["code"] == "ST101")
    other = [f for f in failures if f["code"] != "ST101"]
    errors = sum(e["count"] for e in report.get("errors") or [])
    skipped = ", ".join(f"{k}: {v}" for k, v in (ops.get("skip_reasons") or {}).items())
    covered = ops.get("tested", 0) + ops.get("skipped", 0) == ops.get("total", -1) and not ops.get("errored")
    deadlines = ", ".join(f"{n} × {kind}" for kind, n in sorted(tally.items())) or "none"

    def met(ok: bool) -> str:
        return "met" if ok else "**missed**"

    rows = [
        ("operations (route × method) tested", "every one in /openapi.json",
         f"{ops.get('tested', 0)} of {ops.get('total', 0)}" + (f" (skipped: {skipped})" if skipped else ""),
         met(covered)),
        ("test cases generated", f"≤ {max_examples} per operation and phase",
         f"{cases.get('generated', 0):,}", ""),
        ("5xx answers", "0", f"{server}", met(server == 0)),
        ("other contract failures (status, headers, body shape, accepted invalid input)", "0",
         "; ".join(f"{f['title']} × {f['count']} ({', '.join(f['operations'][:3])})" for f in other) or "0",
         met(not other)),
        ("test cases the fuzzer could not run (errors)", "0", f"{errors}", met(errors == 0)),
        ("documented 503/504 deadline answers to its own `X-Request-Timeout` (not failures)", "—",
         deadlines, ""),
    ]
    table = "| figure | target | measured | |\n|---|---|---|---|\n" + "".join(
        f"| {' | '.join(r)} |\n" for r in rows)
    keys = " with `--api-keys-file` (and schemathesis's `ignored_auth` check)" if api_keys else ""
    return (
        f"schemathesis {report.get('schemathesis_version', '?')} against `coalesce serve`{keys} on loopback "
        f"(the packaged MiniLM, a tiny classifier, reranker and SPLADE model), seed {report.get('seed')}, "
        f"checks `{CHECKS}`{', ignored_auth' if api_keys else ''}; {report.get('running_time', 0):.0f} s, "
        f"stopped: {report.get('stop_reason')}, exit code {report.get('exit_code')}.\n\n" + table
    )


def write_bench(path: Path, block_body: str, api_keys: bool, argv: Sequence[str]) -> None:
    """Replace the ``fuzz`` (or ``fuzz-keys``) section of ``path`` (a BENCHMARKS.md) with this run."""
    from coalesce.loadtests.bench import heading, write_section

    title = "Fuzzing: schemathesis, every route" + (" (API keys on)" if api_keys else "")
    block = heading(title, f"make fuzz ARGS=\"{' '.join(argv)}\"") + f"\n{block_body}\n"
    write_section(path, "fuzz-keys" if api_keys else "fuzz", block)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=500, help="test cases per operation and phase")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--api-keys", action="store_true",
                        help="serve with --api-keys-file: fuzz with a key, and check that routes refuse "
                        "requests without one (schemathesis's ignored_auth)")
    parser.add_argument("--bench-file", type=Path, default=None,
                        help="write the run's figures to this markdown file's fuzz section (BENCHMARKS.md)")
    parser.add_argument("extra", nargs="*", help="more schemathesis options (after --)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="coalesce-fuzz-") as tmp, contextlib.ExitStack() as stack:
        keys_file, extra, checks = None, list(args.extra), CHECKS
        if args.api_keys:
            keys_file = Path(tmp) / "keys"
            keys_file.write_text(f"{FUZZ_KEY} fuzz\n")
            extra += ["-H", f"Authorization: Bearer {FUZZ_KEY}"]
            checks += ",ignored_auth"
        env = schemathesis_env()
        if args.bench_file:
            extra += ["--report", "json", "--report-json-path", f"{tmp}/report.json"]
            env["COALESCE_FUZZ_TALLY"] = f"{tmp}/tally.json"
        url = stack.enter_context(running_server(keys_file))
        command = schemathesis_command(url, args.max_examples, args.seed, extra, checks)
        print("$", " ".join(command), flush=True)
        code = subprocess.run(command, check=False, env=env).returncode
        if args.bench_file:
            report = json.loads(Path(f"{tmp}/report.json").read_text(encoding="utf-8"))
            tally_file = Path(f"{tmp}/tally.json")
            tally = json.loads(tally_file.read_text(encoding="utf-8")) if tally_file.exists() else {}
            write_bench(args.bench_file, bench_block(report, tally, args.max_examples, args.api_keys),
                        args.api_keys, argv)
            print(f"Updated {args.bench_file}", flush=True)
        return code


if __name__ == "__main__":
    raise SystemExit(main())
