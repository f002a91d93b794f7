"""The command lines end to end against a stub: result JSON, markdown, plots, traces, plans, comparisons."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from coalesce.loadtests import bench, selftest
from coalesce.loadtests.cli import loadtest_main, plan_main
from coalesce.loadtests.report import markdown_report
from coalesce.loadtests.results import load
from coalesce.loadtests.stub import StubConfig, serve_in_thread
from coalesce.loadtests.workload import read_trace

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    with serve_in_thread(StubConfig(service_ms=5.0)) as base:
        yield base + "/v1/embeddings"


def _nonempty(path: Path) -> bytes:
    assert path.exists(), path
    data = path.read_bytes()
    assert len(data) > 100, path
    return data


def test_loadtest_writes_json_report_plots_and_a_replayable_trace(
    stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "burst"
    argv = [
        "--url",
        stub_url,
        "--mode",
        "burst",
        "--rate",
        "60",
        "--burst-on",
        "0.5",
        "--burst-off",
        "0.5",
        "--duration",
        "2",
        "--warmup",
        "0",
        "--cost-per-hour",
        "1.5",
        "--out",
        str(out),
        "--save-trace",
        str(tmp_path / "trace.jsonl"),
        "--no-progress",
    ]
    assert loadtest_main(argv) == 0
    summary = capsys.readouterr().out
    assert "p99" in summary and "per 1M embeddings" in summary and "Generator:" in summary

    result = load(out / "result.json")
    step = result.steps[0]
    assert step.requests == 60 and step.ok == 60 and step.batch is not None
    assert step.offered_rps == pytest.approx(30)  # 60/s half of the time
    assert step.timeline is not None and sum(step.timeline.sent) == 60
    report = _nonempty(out / "report.md").decode()
    assert "| step |" in report and "Server batching" in report and "![latency_over_time]" in report
    for name in ("latency_vs_load.png", "batch_sizes.png", "latency_over_time.png"):
        assert _nonempty(out / name).startswith(PNG)
    assert "selftest` measures its ceiling" in report
    result.generator.ceiling_closed_rps, result.generator.ceiling_open_rps = 4800.0, 2400.0
    assert "4,800 req/s closed loop, 2,400 req/s open loop" in markdown_report(result)

    trace = read_trace(tmp_path / "trace.jsonl")
    assert len(trace) == 60 and all(e.inputs == 1 and len(e.lengths) == 1 for e in trace)
    replay_out = tmp_path / "replay"
    argv = [
        "--url",
        stub_url,
        "--mode",
        "replay",
        "--trace",
        str(tmp_path / "trace.jsonl"),
        "--warmup",
        "0",
        "--out",
        str(replay_out),
        "--no-plots",
        "--no-progress",
    ]
    assert loadtest_main(argv) == 0
    replayed = load(replay_out / "result.json").steps[0]
    assert replayed.requests == 60 and replayed.ok == 60


def test_plan_reads_a_saved_ramp(stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--url",
        stub_url,
        "--mode",
        "ramp",
        "--rate",
        "20",
        "--ramp-step",
        "20",
        "--max-rate",
        "40",
        "--step-duration",
        "1",
        "--warmup",
        "0.2",
        "--p99-ms",
        "5000",  # (a stub answering in 5 ms: a generous target, so one stall of a busy machine fails nothing)
        "--mix",
        "multi",
        "--out",
        str(tmp_path),
        "--no-plots",
        "--no-progress",
    ]
    assert loadtest_main(argv) == 0
    capsys.readouterr()
    argv = [
        "--result",
        str(tmp_path / "result.json"),
        "--p99-ms",
        "5000",
        "--rate",
        "100",
        "--cost-per-hour",
        "2",
        "--utilization",
        "1.0",
    ]
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "One replica sustains 40.0 req/s" in text and "Replicas needed: 3" in text
    assert plan_main([*argv, "--json"]) == 0
    plan = msgspec.json.decode(capsys.readouterr().out)
    assert plan["replicas"] == 3 and plan["inputs_per_request"] == 16
    assert (
        plan_main(
            [
                "--result",
                str(tmp_path / "result.json"),
                "--p99-ms",
                "0.001",
                "--rate",
                "1",
                "--cost-per-hour",
                "1",
            ]
        )
        == 1
    )


def test_compare_runs_each_contender_and_reports_ratios(
    stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A "server" that rejects its command line stands in for a Coalesce without --batching.
    refuses = f"{sys.executable} -c 'import sys; sys.exit(2)'"
    argv = [
        "--peer",
        f"first={stub_url}",
        "--peer",
        f"second={stub_url}",
        "--config",
        "old=--batching adaptive",
        "--serve-cmd",
        refuses,
        "--mode",
        "open",
        "--rate",
        "30",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    from coalesce.loadtests.compare import compare_main

    assert compare_main(argv) == 0
    table = capsys.readouterr().out
    assert "old" in table and "not supported by this server" in table
    assert "1.00×" in table  # the first contender is the baseline
    md = _nonempty(tmp_path / "compare.md").decode()
    assert "first" in md and "second" in md
    blob = msgspec.json.decode((tmp_path / "compare.json").read_bytes())
    assert set(blob) == {"old", "first", "second"} and "note" in blob["old"]
    assert _nonempty(tmp_path / "compare_latency_vs_load.png").startswith(PNG)
    assert (tmp_path / "first" / "result.json").exists()


def test_selftest_measures_the_generator_ceiling() -> None:
    # A second's window: with 0.3 s, a clean-clone CI run once counted no answer at all in it (its answers
    # by status were not kept then; they are now, for the message below).
    duration = 1.0
    c = selftest.measure_ceiling(duration=duration, concurrency=16)
    # An instant stub on loopback: thousands a second on an idle machine, a few hundred on a loaded one.
    # Either way each client completes requests within the window; a rate per ms does not read so.
    assert c.closed_rps * duration >= c.concurrency, (c.closed_rps, c.closed_status)
    assert c.tried and c.tried[0][0] == pytest.approx(round(c.closed_rps * 0.25))
    assert "Closed loop, 16 clients" in selftest.render(c)


def test_bench_sections_replace_only_their_markers() -> None:
    text = "# B\n\nintro\n\n<!-- bench:peers:start -->\nold\n<!-- bench:peers:end -->\n\noutro\n"
    new = bench.update_section(text, "peers", "new table")
    assert (
        "old" not in new and "new table" in new and new.startswith("# B\n\nintro") and new.endswith("outro\n")
    )
    added = bench.update_section(new, "generator", "g")
    assert added.count("<!-- bench:generator:start -->") == 1 and "new table" in added
    assert bench.update_section(added, "generator", "h").count("bench:generator") == 2


def test_bench_peers_says_how_to_install_infinity_when_missing(tmp_path: Path) -> None:
    target = tmp_path / "BENCHMARKS.md"
    assert (
        bench.main(["--only", "peers", "--infinity-bin", str(tmp_path / "none"), "--file", str(target)]) == 0
    )
    text = target.read_text()
    assert text.startswith("# Benchmarks") and "<!-- bench:peers:start -->" in text
    assert "Not run" in text and "infinity-emb[server,torch]" in text
    assert "--only peers" in text and "cores" in text  # the command and the machine
