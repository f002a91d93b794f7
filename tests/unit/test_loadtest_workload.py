"""Arrival schedules, input mixes and traces of the load generator (no network, no clock)."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import msgspec
import pytest
from coalesce.loadtests import schedule
from coalesce.loadtests.workload import (
    WORDS,
    Mix,
    PayloadFactory,
    TextSource,
    TraceEntry,
    read_trace,
    sample_length,
    write_trace,
)


def test_poisson_arrivals_have_the_asked_count_and_exponential_gaps() -> None:
    arrivals = schedule.poisson_arrivals(200.0, 50.0, random.Random(1))
    assert len(arrivals) == 10_000
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0.0 and arrivals[-1] < 50.0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 200, rel=0.03)
    # Exponential gaps: standard deviation equals the mean (a fixed-interval schedule would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.05)


def test_poisson_start_offsets_the_window() -> None:
    arrivals = schedule.poisson_arrivals(10.0, 2.0, random.Random(0), start=5.0)
    assert len(arrivals) == 20 and all(5.0 <= t < 7.0 for t in arrivals)


def test_bursts_put_the_load_in_the_on_phases() -> None:
    arrivals = schedule.burst_arrivals(100.0, 1.0, 2.0, 9.0, random.Random(2), rate_off=5.0)
    on = [t for t in arrivals if t % 3.0 < 1.0]
    off = [t for t in arrivals if t % 3.0 >= 1.0]
    assert len(on) == 300 and len(off) == 30


def test_alternating_phases_cycle_the_rates_and_cut_the_last_one_short() -> None:
    assert schedule.alternating_windows([10, 40], 2.0, 7.0) == [
        (0.0, 2.0, 10), (2.0, 4.0, 40), (4.0, 6.0, 10), (6.0, 7.0, 40)
    ]
    with pytest.raises(ValueError):
        schedule.alternating_windows([], 1.0, 5.0)


def test_alternating_arrivals_hold_each_phases_rate_without_gaps() -> None:
    arrivals = schedule.alternating_arrivals([50, 200], 3.0, 12.0, random.Random(3), start=1.0)
    assert arrivals == sorted(arrivals)
    counts = [sum(1 for t in arrivals if a + 1.0 <= t < b + 1.0)
              for a, b, _ in schedule.alternating_windows([50, 200], 3.0, 12.0)]
    assert counts == [150, 600, 150, 600]


def test_ramp_rates_step_up_to_the_maximum() -> None:
    assert schedule.ramp_rates(10, 10, 50) == [10, 20, 30, 40, 50]
    assert schedule.ramp_rates(0.2 * 55, 0.1 * 55, 1.3 * 55)[-1] == pytest.approx(71.5)
    with pytest.raises(ValueError):
        schedule.ramp_rates(10, 0, 50)


def test_trace_round_trip_and_replay_offsets(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"t": 2.5, "inputs": 2, "lengths": [3, 40]}\n\n{"t": 1.5, "inputs": 1}\n')
    entries = read_trace(path)
    assert entries == [TraceEntry(1.5, 1, [16]), TraceEntry(2.5, 2, [3, 40])]
    assert schedule.trace_arrivals(entries, speed=2.0) == [0.0, 0.5]
    write_trace(tmp_path / "copy.jsonl", entries)
    assert read_trace(tmp_path / "copy.jsonl") == entries


def test_bad_trace_lines_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "inputs": 2, "lengths": [1]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_trace(path)


def test_mixes_have_their_lengths_and_input_counts() -> None:
    rng = random.Random(3)
    factory = PayloadFactory(TextSource(rng), "m", "float")
    short = factory.pool(Mix.SHORT, rng, 200)
    assert all(p.n_inputs == 1 and 6 <= p.lengths[0] <= 16 for p in short)
    long = factory.pool(Mix.LONG, rng, 50)
    assert all(150 <= p.lengths[0] <= 250 for p in long)
    multi = factory.pool(Mix.MULTI, rng, 20)
    assert all(p.n_inputs == 16 for p in multi)
    mixed = [sample_length(Mix.MIXED, rng) for _ in range(2000)]
    assert min(mixed) >= 3 and max(mixed) <= 250
    assert 18 <= statistics.median(mixed) <= 30


def test_bodies_are_openai_requests_with_words_of_the_vocabulary() -> None:
    rng = random.Random(4)
    factory = PayloadFactory(TextSource(rng), "all-MiniLM-L6-v2", "base64")
    one = msgspec.json.decode(factory.for_lengths([5]).body)
    assert one["model"] == "all-MiniLM-L6-v2" and one["encoding_format"] == "base64"
    assert isinstance(one["input"], str) and len(one["input"].split()) == 5
    assert set(one["input"].split()) <= set(WORDS)
    two = msgspec.json.decode(factory.for_lengths([2, 7]).body)
    assert [len(t.split()) for t in two["input"]] == [2, 7]


def test_a_corpus_file_supplies_the_inputs(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("alpha beta gamma\n\ndelta epsilon\n")
    rng = random.Random(5)
    factory = PayloadFactory(TextSource.from_file(rng, corpus), "m")
    texts = {msgspec.json.decode(p.body)["input"] for p in factory.pool(Mix.SHORT, rng, 50)}
    assert texts == {"alpha beta gamma", "delta epsilon"}
    replayed = msgspec.json.decode(factory.for_lengths([4]).body)["input"].split()
    assert len(replayed) == 4 and set(replayed) <= {"alpha", "beta", "gamma", "delta", "epsilon"}


def test_a_stream_sends_fresh_payloads_unless_asked_to_repeat() -> None:
    from coalesce.loadtests.workload import PayloadStream

    def bodies(repeat: float) -> list[bytes]:
        stream = PayloadStream(PayloadFactory(TextSource(random.Random(1)), "m"), Mix.SHORT,
                               random.Random(2), repeat=repeat, keep=100)
        return [stream(i).body for i in range(2000)]

    fresh = bodies(0.0)
    assert len(set(fresh)) == len(fresh), "a cache on the server must have nothing to answer"
    mixed = bodies(0.3)
    repeats = len(mixed) - len(set(mixed))
    assert 0.25 * len(mixed) < repeats < 0.35 * len(mixed)
    assert mixed == bodies(0.3), "deterministic for a seed"
    with pytest.raises(ValueError):
        factory = PayloadFactory(TextSource(random.Random(1)), "m")
        PayloadStream(factory, Mix.SHORT, random.Random(2), repeat=1.0)
