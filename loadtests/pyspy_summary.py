"""A summary of ``py-spy record --format raw`` samples (folded stacks): the functions that took the
most samples, inclusive (anywhere on the stack) and own (at its top), as shares of all samples.

    python -m coalesce.loadtests.pyspy_summary FILE [--top N]

``kernels/gpu_engine_profile.sh`` writes such files on the GPU machine (the engine process under load);
this reads them here, gzipped too (``FILE.gz``: the samples BENCHMARKS quotes are kept so, in
``loadtests/gpu/profiles``). :func:`record_gil` runs ``py-spy record --gil`` on live processes and
summarises what it took (the bench's engine section, ``engine_ceiling --profile``). Standard library only
(py-spy itself is the ``loadtest`` extra's).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

_FRAME = re.compile(r"(.*?) \((.*?)(?::\d+)?\)$")


def short_path(filename: str) -> str:
    """A source file as the summaries name it: from its package down (what follows ``site-packages/``),
    or relative to the working directory."""
    return filename.split("site-packages/")[-1].removeprefix(os.getcwd() + os.sep)


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if m is None:
        return frame
    return f"{m.group(1)} ({short_path(m.group(2))})"


def summarise(lines: Iterable[str]) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Total samples, and samples per function: inclusive, own."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        names = [_name(f) for f in stack.split(";")]
        for name in dict.fromkeys(names):  # (once per sample, in stack order: ties rank outermost first)
            inclusive[name] += n
        own[names[-1]] += n
    return total, inclusive, own


Samples = dict[str, tuple[int, collections.Counter[str], collections.Counter[str]]]  # name -> summarise's


def record_gil(pids: Mapping[str, int], seconds: int) -> Samples | str:
    """``py-spy record --gil`` of each of ``pids`` (by name) at once for ``seconds`` (whole: py-spy takes
    no fraction): the samples of the thread holding the interpreter lock, summarised; or why there are
    none (py-spy's first line on its error stream). Blocks for ``seconds``."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed: `pip install 'coalesce[loadtest]'`"
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: subprocess.Popen(
            [spy, "record", "-p", str(pid), "-r", "200", "-d", str(seconds), "--nonblocking", "--gil",
             "-f", "raw", "-o", f"{tmp}/{name}.raw"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True) for name, pid in pids.items()}
        out = {}
        for name, run in runs.items():
            _, err = run.communicate(timeout=seconds + 30)
            path = Path(tmp) / f"{name}.raw"
            if run.returncode != 0 or not path.exists():  # (it needs ptrace: root, or CAP_SYS_PTRACE)
                return f"py-spy failed on the {name}: {err.strip().splitlines()[0] if err.strip() else '?'}"
            with path.open(encoding="utf-8", errors="replace") as f:
                out[name] = summarise(f)
        return out


def shares(total: int, counts: Iterable[tuple[str, int]]) -> list[str]:
    """A line for each ``(function, samples)``: its share of ``total``, then its name."""
    return [f"  {100 * n / max(total, 1):5.1f}%  {name}" for name, n in counts]


def render(total: int, inclusive: collections.Counter[str], own: collections.Counter[str], top: int) -> str:
    out = [f"{total} samples"]
    for title, counts in (("inclusive", inclusive), ("own", own)):
        out.append(f"{title}:")
        out += shares(total, counts.most_common(top))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    opener = gzip.open if args.file.endswith(".gz") else open
    with opener(args.file, "rt", encoding="utf-8", errors="replace") as f:
        print(render(*summarise(f), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
