"""How long the forward takes while the event loop's thread runs Python: by Python's switch interval,
and for the forward run from Python against the same forward traced (``kernels/traced_forward``).

    python -m coalesce.loadtests.lock_contention [--rows 64] [--tokens 14] [--busy 0,0.5,0.9,1]
                                                 [--intervals-ms 5,0.5] [--forward python,traced]
                                                 [--dtype auto] [--rounds 3] [--forwards 6]

The server runs each forward on a thread of its own (the device thread) beside the event loop's. Run
from Python, the forward releases the interpreter lock inside each operator and takes it back between
them; while the other thread runs Python, taking it back waits until that thread is asked to drop it,
which Python does only after its *switch interval* (``sys.setswitchinterval``, 5 ms by default). Under
a flood that the event loop refuses, or an engine's loop busy with many gateways' messages, that thread
runs Python almost without pause. The traced forward runs in TorchScript's interpreter and takes the
lock back once per forward.

This runs the packaged model's forward (the tuned CPU forward in ``--dtype``, ``auto`` being what the
server picks on this CPU; a batch of ``--rows`` rows of at most ``--tokens`` tokens, as the soak's
batches are) on a thread, while the main thread runs Python for ``busy`` of every 2 ms and sleeps the
rest, and prints the median forward per forward kind and switch interval, for each busy share, and its
ratio to the first column's (the Python forward at the first interval: Python's default unless told
otherwise). Every column takes its turn in each of ``--rounds`` rounds, the order reversed every other
round (a shared VM drifts). The busy thread also takes CPU, which neither a switch interval nor a
trace gives back: on a machine of two cores a fully busy thread leaves the forward's two threads one
core.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

PERIOD_S = 0.002  # the busy thread's cycle: Python for a share of it, asleep for the rest


def prepared_batch(rows: int, tokens: int, runner: Any = None, dtype: str = "float32") -> tuple[Any, Any]:
    """The packaged model's tuned runner in ``dtype`` (``runner`` when given; its forward traced, as the
    server's is) and a ragged batch of ``rows`` rows of at most ``tokens`` tokens prepared for it,
    warmed up."""
    import torch
    from coalesce.loadtests.forward_ops import build_runner, ragged_ids, ragged_lengths

    if runner is None:
        runner = build_runner(dtype, eager=False, tuned=True)
    g = torch.Generator().manual_seed(0)
    ids = ragged_ids(ragged_lengths(rows, tokens, g), g)
    prepared = runner.prepare([runner.with_special_tokens(row) for row in ids])
    for _ in range(3):
        runner.forward(prepared)
    return runner, prepared


def from_python(runner: Any) -> Any:
    """``runner`` (an ``EncoderRunner``) with its forward run from Python, not traced: a shallow copy
    sharing the model."""
    python = copy.copy(runner)
    python.cpu_pool = None
    return python


def busy_period(share: float) -> None:
    """One :data:`PERIOD_S`: Python bytecode (the interpreter lock held) for ``share`` of it, asleep for
    the rest."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < share * PERIOD_S:
        sum(range(50))
    if share < 1:
        time.sleep((1 - share) * PERIOD_S)


def busy_until(share: float, stop: Any) -> None:
    """Run Python for ``share`` of every :data:`PERIOD_S` until ``stop`` (an Event) is set: another
    process's load beside a forward."""
    while not stop.is_set():
        busy_period(share)


def forwards_beside(forward: Callable[[], object], busy: float, interval_s: float, n: int) -> list[float]:
    """Seconds of ``n`` forwards run on a thread while this thread runs Python for ``busy`` of every
    :data:`PERIOD_S`, under switch interval ``interval_s`` (restored after)."""
    was = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    times: list[float] = []

    def run() -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            forward()
            times.append(time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="forward")
    try:
        thread.start()
        while thread.is_alive():
            busy_period(busy)
        thread.join()
    finally:
        sys.setswitchinterval(was)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.lock_contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=14, help="longest row, special tokens included")
    p.add_argument("--busy", default="0,0.5,0.9,1", help="the other thread's busy shares, comma-separated")
    p.add_argument("--intervals-ms", default="5,0.5", help="switch intervals, comma-separated")
    p.add_argument("--forward", default="python,traced", help="forward kinds, comma-separated: python "
                   "(run from Python, as before traced_forward), traced (as the server runs it)")
    p.add_argument("--dtype", default="auto", help="the forward's precision (auto: the server's on this CPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forwards", type=int, default=6, help="forwards per column per round")
    args = p.parse_args(argv)
    busy_shares = [float(b) for b in args.busy.split(",")]
    intervals = [float(i) / 1e3 for i in args.intervals_ms.split(",")]
    kinds = args.forward.split(",")
    import torch

    runner, prepared = prepared_batch(args.rows, args.tokens, dtype=args.dtype)
    if runner.cpu_pool is None and "traced" in kinds:
        raise SystemExit("the runner's forward is not traced here (see the log): nothing to compare")
    runners = {"python": from_python(runner), "traced": runner}
    columns = [(kind, i) for kind in kinds for i in intervals]
    print(f"{args.rows} rows x <= {args.tokens} tokens, {runner.model.word.weight.dtype}, "
          f"{torch.get_num_threads()} threads; median forward ms over {args.rounds} interleaved rounds of "
          f"{args.forwards}, the other thread busy for a share of every {PERIOD_S * 1e3:g} ms")
    heads = [f"{kind} {i * 1e3:g} ms" for kind, i in columns]
    print(f"{'busy':>5} " + " ".join(f"{h:>16}" for h in heads) + "   " +
          " ".join(f"{h + ' ÷ first':>22}" for h in heads[1:]))
    for busy in busy_shares:
        times: dict[tuple[str, float], list[float]] = {c: [] for c in columns}
        for r in range(args.rounds):
            for kind, interval in columns if r % 2 == 0 else reversed(columns):
                one = runners[kind]
                times[kind, interval] += forwards_beside(lambda one=one: one.forward(prepared), busy,  # type: ignore[misc]
                                                         interval, args.forwards)
        med = [statistics.median(times[c]) * 1e3 for c in columns]
        print(f"{busy:5.2f} " + " ".join(f"{m:16.1f}" for m in med) + "   " +
              " ".join(f"{m / med[0]:21.2f}×" for m in med[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
