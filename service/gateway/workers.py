"""``--workers N``: N server processes on one port, under a supervisor that owns their lifetime.

One asyncio process spends a few hundred microseconds of CPU on every small request (HTTP, JSON,
admission, futures), so it tops out at a few thousand requests per second whatever the model costs; a
GPU that embeds a short batch in a millisecond needs several. Each worker is a complete ``coalesce
serve`` (its own models, batcher and device thread) started with ``--workers 1 --reuse-port``: the
kernel spreads connections over the workers' listening sockets, and a worker listens only once its
models are ready.

The supervisor (this process) starts the workers in their own sessions, forwards SIGTERM/SIGINT to each
exactly once (each then drains as a single server does), and exits when all have exited: 0 if every
worker stopped cleanly after a signal, else 1. A worker that exits on its own stops the others, so the
platform sees the failure and restarts the replica rather than run it short of a worker.

Metrics: the workers share a Prometheus multiprocess directory, so ``/metrics`` on any worker reports
the sum over all of them (queue depths and in-flight requests add up, ``coalesce_ready`` is 1 only when
every live worker is ready); the per-tenant gauge is not exported (a series named by a client could
never be removed from the shared files). Torch's CPU threads are split between workers unless
``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from types import FrameType

from ..logs import get_logger
from ..settings import Settings

log = get_logger("coalesce.workers")


def worker_command(argv: Sequence[str]) -> list[str]:
    """The command line of one worker: the supervisor's own ``serve`` arguments, made single-process
    (later flags win in argparse, so these override whatever ``argv`` says)."""
    return [sys.executable, "-m", "coalesce.service.cli", "serve", *argv, "--workers", "1", "--reuse-port"]


def supervise(settings: Settings, argv: Sequence[str]) -> int:
    from prometheus_client import multiprocess

    with tempfile.TemporaryDirectory(prefix="coalesce-metrics-") as metrics_dir:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // settings.workers)))
        children: dict[int, subprocess.Popen[bytes]] = {}
        signalled = False

        def forward(signum: int, frame: FrameType | None) -> None:
            nonlocal signalled
            signalled = True
            for child in children.values():
                if child.poll() is None:
                    child.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        for i in range(settings.workers):
            # Own session: a terminal's Ctrl-C reaches the supervisor alone, which forwards it once
            # (a second signal would make a worker skip its grace delay).
            child = subprocess.Popen(
                worker_command(argv), env={**env, "COALESCE_WORKER_ID": str(i)}, start_new_session=True
            )
            children[child.pid] = child
        if signalled:  # a signal came while workers were starting: make sure each has it
            forward(signal.SIGTERM, None)
        log.info("workers_started", workers=settings.workers, pids=sorted(children))

        failed = False
        alive = set(children)
        while alive:
            pid, status = os.wait()  # returns after a signal handler has run, too (PEP 475)
            if pid not in alive:
                continue
            alive.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            children[pid].returncode = code
            multiprocess.mark_process_dead(pid, metrics_dir)
            if code != 0 or not signalled:
                failed = True
                log.error("worker_exited", pid=pid, code=code, during="shutdown" if signalled else "serving")
                if not signalled:  # it died on its own: take the replica down so the platform restarts it
                    signalled = True
                    for other in alive:
                        children[other].send_signal(signal.SIGTERM)
        log.info("workers_stopped", failed=failed)
        return 1 if failed else 0
