"""The gateway's bytecode count: the null-model service in one process counted from a signal to a signal,
every request of the counted run answered, and the count placed where the request's path runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from coalesce.loadtests.gateway_ops import package


def test_frames_are_counted_under_their_package_or_the_service_module() -> None:
    assert package("/v/lib/python3.11/site-packages/aiohttp/web_protocol.py") == "aiohttp"
    assert package("/v/lib/python3.11/site-packages/coalesce/service/gateway/facade.py") == \
        "service/gateway/facade.py"
    here = f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}/_weakrefset.py"
    assert package(here) == "stdlib _weakrefset.py"


def test_a_short_counted_run_answers_its_requests_and_counts_the_http_and_batching_path() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.gateway_ops", "--clients", "2", "--seconds", "1",
         "--json"],
        capture_output=True, text=True, timeout=240, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["requests"] > 0 and figures["ok"] == figures["requests"]
    assert figures["bytecodes"] > 1000 and figures["calls"] > 10
    packages = figures["packages"]
    # The request's whole path on the loop: aiohttp's handling, the route, admission and the batcher.
    assert packages["aiohttp"] > 0
    assert any(p.endswith("service/gateway/embeddings.py") for p in packages)
    assert any(p.endswith("service/batching/batcher.py") for p in packages)
    assert abs(sum(packages.values()) - figures["bytecodes"]) < 1e-6 * figures["bytecodes"]
    assert any("create_embeddings" in where for where, _ in figures["functions"])


def test_the_ab_script_counts_this_checkout_beside_a_commits_service() -> None:
    # loadtests/gateway_ops_ab.sh: the baseline's server runs REV's wheel, first on its PYTHONPATH, under
    # this checkout's counting driver; HEAD as the baseline here (any commit will do), one short round.
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["bash", "loadtests/gateway_ops_ab.sh", "HEAD", "1", "--clients", "2", "--seconds", "1"],
        cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    _, *lines = out.stdout.splitlines()
    rows = [line.split() for line in lines]
    assert [row[:2] for row in rows] == [["1", "current"], ["1", "baseline"]], out.stdout
    assert all(int(row[2]) > 0 and float(row[3]) > 1000 and float(row[4]) > 10 for row in rows), out.stdout
    # Each side's packages named alike (the baseline's from its wheel's directory, cut to the service's).
    assert all("service/" in line and "/site/" not in line for line in lines), out.stdout
