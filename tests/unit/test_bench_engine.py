"""The engine bench section's live profile: which samples count as waking another process or thread,
and the table it prints (or why there is none)."""

from __future__ import annotations

from coalesce.loadtests.bench_engine import WAKE_CALLS, _profile, wake_share
from coalesce.loadtests.pyspy_summary import summarise

PKG = "/x/site-packages/coalesce/service"  # (a frame's file as py-spy names it; the summary cuts it short)
ENGINE = [
    f"run (asyncio/runners.py:118);Link.send ({PKG}/engine/channel.py:160) 5\n",
    "run (asyncio/runners.py:118);Lane.call (worker.py:97) 3\n",
    f"run (asyncio/runners.py:118);Batcher._join ({PKG}/batching/batcher.py:510) 2\n",
]
GATEWAY = [
    "run (asyncio/runners.py:118);StreamWriter._writelines (aiohttp/http_writer.py:120) 1\n",
    "run (asyncio/runners.py:118);TokenizerAdapter.tokenize (tokens.py:80) 3\n",
]


def test_wake_share_counts_only_the_named_calls_at_the_top_of_a_sample() -> None:
    total, _, own = summarise(ENGINE)
    assert total == 10
    assert wake_share(own, total) == 0.8  # Link.send and Lane.call; Batcher._join is Python
    assert wake_share(own, total, calls=("Batcher._join",)) == 0.2
    total, _, own = summarise(GATEWAY)
    assert wake_share(own, total) == 0.25
    assert "Link.send" in WAKE_CALLS and "Lane.call" in WAKE_CALLS


def test_the_profile_lists_each_process_side_by_side_with_its_wake_share() -> None:
    text = _profile({"engine": summarise(ENGINE), "gateway": summarise(GATEWAY)}, top=3)
    assert "the engine's 80% (10 samples), the gateway's 25% (4 samples)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| engine: function | own | gateway: function | own |"  # (then the data rows)
    assert rows[1].startswith("| Link.send (coalesce/service/engine/channel.py) | 50.0% | "
                              "TokenizerAdapter.tokenize (tokens.py) | 75.0% |")
    assert rows[3].endswith("|  |  |")  # the gateway has only two functions


def test_without_py_spy_the_section_says_so() -> None:
    assert "not sampled (py-spy is not installed" in _profile("py-spy is not installed: pip install")


def test_cpu_per_request_reads_the_cpu_of_the_measured_window_only(monkeypatch, tmp_path) -> None:
    """The load runner counts the requests of a run's measured window, not its warm-up's: the warm-up
    runs first, on its own, and the CPU read around the measured run alone is divided by its requests.
    (Read across the warm-up as well, every figure came out a warm-up ÷ duration too high.)"""
    from types import SimpleNamespace

    from coalesce.loadtests import bench_engine
    from coalesce.loadtests.scenario import Mode, Scenario

    cpu = [0.0]  # the server's CPU seconds so far: 1 ms a request
    runs: list[tuple[float, float]] = []

    def run(url: str, scenario: Scenario, label: str, out: object) -> SimpleNamespace:
        runs.append((scenario.warmup, scenario.duration))
        answered = round(1000 * (scenario.warmup + scenario.duration))  # 1,000 requests a second
        cpu[0] += answered * 1e-3
        return SimpleNamespace(ok=round(1000 * scenario.duration))  # (the measured window's)

    monkeypatch.setattr(bench_engine, "_run", run)
    monkeypatch.setattr(bench_engine, "_cpu_by_role", lambda pid: {"all": cpu[0]})
    srv = SimpleNamespace(proc=SimpleNamespace(pid=1), url="http://127.0.0.1:1/v1/embeddings")
    per, st = bench_engine.cpu_per_request(
        srv, Scenario(mode=Mode.CLOSED, concurrency=4, duration=8.0, warmup=1.0), "run", tmp_path)
    assert per == {"all": 1000.0}  # µs a request, not 1,125
    assert runs == [(0.0, 1.0), (0.0, 8.0)]  # the warm-up on its own, then the measured run
    assert st.ok == 8000


def test_the_ceiling_rows_run_the_tool_once_per_gateway_count_and_come_back_in_order(monkeypatch) -> None:
    """The section's engine-ceiling rows: one run of the tool per gateway count, with that count's
    in-flight values, and every row of CEILING_ROWS back in its order (the projection reads FED's)."""
    import json
    from types import SimpleNamespace

    from coalesce.loadtests import bench_engine

    calls: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> SimpleNamespace:
        calls.append(cmd)
        g = int(cmd[cmd.index("--gateways") + 1])
        each = cmd[cmd.index("--outstanding") + 1].split(",")
        rows = [{"gateways": g, "outstanding": int(k)} for k in each]
        return SimpleNamespace(stdout="table\n" + json.dumps({"rows": rows}) + "\n")

    monkeypatch.setattr(bench_engine.subprocess, "run", run)
    rows = bench_engine._engine_ceiling()
    assert [(r["gateways"], r["outstanding"]) for r in rows] == list(bench_engine.CEILING_ROWS)
    assert len(calls) == len({g for g, _ in bench_engine.CEILING_ROWS})
    assert bench_engine.FED in bench_engine.CEILING_ROWS


def test_the_busy_engines_profile_reads_engine_ceilings_row() -> None:
    """``engine_ceiling --profile``'s row (JSON: its samples and top functions) as the section's table, with
    the share of the calls that wake another thread or process; or why it was not sampled."""
    from coalesce.loadtests.bench_engine import FED, _fed_profile

    row = {"rps": 26_000.0, "profile": {"total": 10, "own": [["Link.send (channel.py)", 3],
                                                              ["FairQueue.add (fair.py)", 2]]}}
    text = _fed_profile(row)
    assert f"of the {FED[0]} × {FED[1]} row: 26,000 requests/s" in text
    assert "the engine's 30% (10 samples)" in text  # Link.send wakes; FairQueue.add does not
    assert "| Link.send (channel.py) | 30.0% |" in text and "| FairQueue.add (fair.py) | 20.0% |" in text
    assert _fed_profile({"rps": 1.0, "profile": "py-spy is not installed"}).endswith(
        ": not sampled (py-spy is not installed).\n\n")
