"""``--workers N``: one engine process and N gateway processes on one port, under a supervisor.

One asyncio process spends a few hundred microseconds of CPU on every small request (HTTP, JSON,
tokenising, admission), so it tops out near a thousand requests per second per core whatever the model
costs; a GPU that embeds a short batch in a millisecond needs several. But coalescing needs one queue
per model. So the replica splits in two (the design of vLLM's API servers in front of one engine core):

* **gateways** (``coalesce serve --role gateway --reuse-port``): HTTP, validation, tokenising,
  admission headers, responses; no torch, no weights. The kernel spreads connections over their
  listening sockets; a gateway listens only once the engine has welcomed it with the models;
* **the engine** (``--role engine``): the models, their schedulers and cost models, the device thread.
  Inputs from every gateway join the same queues, over Unix sockets in a private directory.

The supervisor (this process) starts them in their own sessions and owns their lifetime:

* SIGTERM/SIGINT goes once to each gateway (each drains as a single server does); once every gateway
  has exited, the engine gets it and finishes whatever is left. Exit 0 if all stopped cleanly.
* A process that exits on its own takes the replica down (exit 1), so the platform restarts it rather
  than run it short: an engine that dies leaves its gateways answering 503 until they are stopped; a
  gateway that dies has its queued work dropped by the engine at once.

Metrics: every process writes to one Prometheus multiprocess directory, so ``/metrics`` on any gateway
reports the replica: gateway series summed, the engine's queue, batch and forward series, and
``coalesce_ready`` as the minimum over the live processes.
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
from ..metrics import write_processes
from ..settings import Settings

log = get_logger("coalesce.workers")


def child_command(argv: Sequence[str], role: str, engine_dir: str, workers: int, index: int = 0) -> list[str]:
    """The command line of one child: the supervisor's own ``serve`` arguments with its role added
    (later flags win in argparse, so these override whatever ``argv`` says)."""
    extra = ["--role", role, "--engine-dir", engine_dir, "--workers", str(workers), "--worker-id", str(index)]
    if role == "gateway":
        extra.append("--reuse-port")
    return [sys.executable, "-m", "coalesce.service.cli", "serve", *argv, *extra]


def _die_with_parent() -> None:
    """In a child, before exec: SIGKILL when the supervisor dies, even by SIGKILL itself (Linux), so no
    engine or gateway outlives it holding the port or the GPU."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor's SIGTERM forwarding is all there is


def supervise(settings: Settings, argv: Sequence[str]) -> int:
    from prometheus_client import multiprocess

    with tempfile.TemporaryDirectory(prefix="coalesce-") as runtime:
        metrics_dir = os.path.join(runtime, "metrics")
        engine_dir = os.path.join(runtime, "engine")
        os.mkdir(metrics_dir, 0o700)
        os.mkdir(engine_dir, 0o700)
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        signalled = False
        gateways: dict[int, subprocess.Popen[bytes]] = {}

        def stop_gateways(signum: int) -> None:
            for child in gateways.values():
                if child.poll() is None:
                    child.send_signal(signum)

        def forward(signum: int, frame: FrameType | None) -> None:
            nonlocal signalled
            signalled = True
            stop_gateways(signum)  # the engine is told once they have drained

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        # Own sessions: a terminal's Ctrl-C reaches the supervisor alone, which forwards it once
        # (a second signal would make a gateway skip its grace delay).
        engine = subprocess.Popen(
            child_command(argv, "engine", engine_dir, settings.workers), env=env, start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        for i in range(settings.workers):
            child = subprocess.Popen(
                child_command(argv, "gateway", engine_dir, settings.workers, i), env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
            gateways[child.pid] = child
        names = {os.getpid(): "supervisor", engine.pid: "engine"}
        names.update((pid, f"gateway-{i}") for i, pid in enumerate(gateways))
        write_processes(metrics_dir, names)  # each process's resident memory in /metrics
        if signalled:  # a signal came while children were starting: make sure each gateway has it
            stop_gateways(signal.SIGTERM)
        log.info("workers_started", engine=engine.pid, gateways=sorted(gateways))

        failed = False
        engine_told = False
        alive = {engine.pid, *gateways}
        while alive:
            pid, status = os.wait()  # returns after a signal handler has run, too (PEP 475)
            if pid not in alive:
                continue
            alive.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            role = "engine" if pid == engine.pid else "gateway"
            multiprocess.mark_process_dead(pid, metrics_dir)
            if code != 0 or not signalled:
                failed = True
                log.error("worker_exited", role=role, pid=pid, code=code,
                          during="shutdown" if signalled else "serving")
                if not signalled:  # it died on its own: take the replica down so the platform restarts it
                    signalled = True
                    stop_gateways(signal.SIGTERM)
            if engine.pid in alive and not (alive & gateways.keys()) and not engine_told:
                engine_told = True
                engine.send_signal(signal.SIGTERM)  # every gateway is gone: the engine's turn
        log.info("workers_stopped", failed=failed)
        return 1 if failed else 0
