"""BENCHMARKS.md's hostile-clients table: each hostile-client integration test's ``outcome:`` line.

    .venv/bin/python -m tests.integration.hostile_report [--file BENCHMARKS.md]

Runs ``pytest -s`` on ``test_hostile.py`` and ``test_hostile_processes.py`` (servers on loopback,
bounded in time), collects the line each test prints about what the hostile client saw and what a
polite client saw meanwhile, and writes them, with the tests' verdict, to the ``hostile`` section.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
FILES = ("test_hostile.py", "test_hostile_processes.py")
COMMAND = ".venv/bin/python -m tests.integration.hostile_report"


def run() -> tuple[int, list[str], str]:
    """(pytest's exit status, the outcome lines, pytest's summary line)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
         *(str(HERE / f) for f in FILES)],
        capture_output=True, text=True, check=False, cwd=HERE.parents[1],
    )
    lines = proc.stdout.splitlines()
    outcomes = [ln.split("outcome:", 1)[1].strip() for ln in lines if "outcome:" in ln]
    summary = next((ln.strip("= ") for ln in reversed(lines) if " passed" in ln or " failed" in ln), "?")
    return proc.returncode, outcomes, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--file", type=Path, default=Path("BENCHMARKS.md"))
    args = parser.parse_args(argv)
    from coalesce.loadtests.bench import heading, write_section

    code, outcomes, summary = run()
    rows = "".join(f"| {o.split(':', 1)[0]} | {o.split(':', 1)[1].strip() if ':' in o else ''} |\n"
                   for o in outcomes)
    block = (
        heading("Hostile clients (CPU)", COMMAND) + "\n"
        "Each row is one integration test's outcome line: a server on loopback (the fake runner; the "
        "last one a real `coalesce serve` process), a hostile client, and a polite one beside it. "
        f"Tests: {summary}."
        "\n\n| case | outcome |\n|---|---|\n" + rows
    )
    write_section(args.file, "hostile", block)
    print(block)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
