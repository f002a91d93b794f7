"""A summary of ``py-spy record --format raw`` samples (folded stacks): the functions that took the
most samples, inclusive (anywhere on the stack) and own (at its top), as shares of all samples.

    python -m coalesce.loadtests.pyspy_summary FILE [--top N]

``kernels/gpu_engine_profile.sh`` writes such files on the GPU machine (the engine process under load);
this reads them here, gzipped too (``FILE.gz``: the samples BENCHMARKS quotes are kept so, in
``loadtests/gpu/profiles``). Standard library only.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import re
from collections.abc import Iterable, Sequence

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


def render(total: int, inclusive: collections.Counter[str], own: collections.Counter[str], top: int) -> str:
    out = [f"{total} samples"]
    for title, counts in (("inclusive", inclusive), ("own", own)):
        out.append(f"{title}:")
        out += [f"  {100 * n / max(total, 1):5.1f}%  {name}" for name, n in counts.most_common(top)]
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
