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
