"""The ``coalesce`` command: ``serve``, ``export``, ``loadtest``, ``plan``."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = ("serve", "export", "loadtest", "plan")
    if not args or args[0] in ("-h", "--help") or args[0] not in commands:
        print(
            "usage: coalesce {serve,export,loadtest,plan} [options]\n\n"
            "  serve     run the embedding service (coalesce serve --help lists every knob)\n"
            "  export    write a model as an ONNX directory that serve --backend onnx runs without torch\n"
            "  loadtest  measure a running service: open/closed loop, bursts, ramps, replays, A/B\n"
            "  plan      capacity plan from a load-test result: replicas, cost, knob values",
            file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if args and args[0] in ("-h", "--help") else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return _serve(rest)
    if command == "export":
        from coalesce.kernels.export import main as export_main

        return export_main(rest)
    from coalesce.loadtests import cli as loadtest_cli

    return loadtest_cli.loadtest_main(rest) if command == "loadtest" else loadtest_cli.plan_main(rest)


def set_switch_interval(ms: float) -> float:
    """Set Python's switch interval to ``ms`` (0: leave Python's); returns the one in effect, in ms
    (``--switch-interval-ms``: why)."""
    if ms > 0:
        sys.setswitchinterval(ms / 1e3)
    return round(sys.getswitchinterval() * 1e3, 3)


def _serve(argv: list[str]) -> int:
    # Tokenisation has its own thread; the tokenizers library's parallel pool would spin on the cores
    # the forward and the event loop need (it cost closed-loop throughput on a 2-core machine). Set
    # TOKENIZERS_PARALLELISM to opt back in.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Where the command line says plainly that this process will re-execute itself on jemalloc, now,
    # before the settings are imported and parsed only to be thrown away with this process (reexec.py).
    from .reexec import early

    early(argv)
    import argparse

    from . import settings as settings_mod

    parser = argparse.ArgumentParser(
        prog="coalesce serve",
        description="Serve embedding models over HTTP (OpenAI-compatible), coalescing requests into "
        "micro-batches. Every flag can also be set as a COALESCE_* environment variable.",
    )
    settings_mod.add_arguments(parser)
    settings = settings_mod.from_args(parser.parse_args(argv))
    # Before torch is imported and before any thread starts: may re-execute this process on jemalloc
    # (where early did not), or tunes glibc; says what runs.
    from .allocator import bound_kernel_caches, prepare

    memory = prepare(settings.allocator, argv)
    kernel_caches = bound_kernel_caches(settings.cpu_kernel_cache)  # before torch builds a kernel
    switch_interval_ms = set_switch_interval(settings.switch_interval_ms)  # before any thread starts
    from .logs import configure, get_logger

    process = {"engine": "engine", "gateway": f"gateway-{settings.worker_id}"}.get(settings.role)
    configure(settings.log_level, settings.log_format, process)
    get_logger("coalesce.allocator").info("allocator", **memory.fields(), kernel_caches=kernel_caches,
                                          switch_interval_ms=switch_interval_ms)
    if settings.workers == settings_mod.WORKERS_AUTO:  # (the supervisor passes its children a count)
        import dataclasses

        workers, why = settings_mod.auto_workers(settings)
        settings = dataclasses.replace(settings, workers=workers)
        get_logger("coalesce.workers").info("workers_auto", workers=workers, why=why)
    # Logging is set (the loaders log), the rest of the server not yet imported: the models start loading
    # on a thread of their own while it is (engine/preload.py).
    from .engine import preload

    preload.start(settings)
    from .gateway.server import run

    return run(settings, argv)


if __name__ == "__main__":
    raise SystemExit(main())
