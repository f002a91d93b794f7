"""Benchmark comparisons run their cells in interleaved rounds, so the machine's drift falls on all."""

from __future__ import annotations

from coalesce.loadtests.bench_sections import interleaved, median_by


def test_every_cell_runs_once_a_round_in_an_order_reversed_every_other_round() -> None:
    order: list[tuple[str, int]] = []

    def run(cell: str, r: int) -> str:
        order.append((cell, r))
        return f"{cell}{r}"

    got = interleaved(["a", "b", "c"], run, rounds=3)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert got == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"], "c": ["c0", "c1", "c2"]}


def test_the_median_result_is_picked_by_its_key_not_its_round() -> None:
    assert median_by([(3, "r0"), (9, "r1"), (5, "r2")], lambda run: run[0]) == (5, "r2")
