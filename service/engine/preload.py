"""Loading the torch-free runners early: ``coalesce serve`` starts building each model's ONNX Runtime or
OpenVINO runner on a thread of its own as soon as its settings and logging are settled, while the main
thread is still importing the rest of the server (aiohttp, numpy, the gateway: most of a cold start);
the engine then takes each runner from here instead of building it on its device thread.

Why: those runtimes read or compile their graphs, and run their first inferences, in native code that
releases the GIL, so on a second core that time overlaps the imports' instead of following it.

What is preloaded: every model of a process that loads models (one process, or the ``--workers``
engine), when each of them resolves to a torch-free backend (``--backend onnx``/``openvino``, or
``auto`` over an export on the CPU) and no ``--runner-factory`` replaces the loaders. Torch runners
(and so CUDA) are never built here: where any model needs torch, the engine loads them all as before.

The thread then does what the engine would do next, so that it overlaps the imports too: the runner's
``warmup``, and the batches the engine seeds its cost model with (:data:`SEED_BATCHES`), timed as the
engine's worker times a batch (forward and finish); the engine takes those timings (:func:`seeded`)
instead of warming up and running the batches again. Until it hands a runner over, the thread is its only
holder, so it is the runner's model thread; after, it never touches it again. A load that fails here
fails the engine's load, with the same exception, when the engine takes that model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coalesce.kernels.protocol import Runner

    from ..settings import ModelSpec, Settings

# The batches each model's cost model is seeded with (``core._seed_cost``, or here for a preloaded runner):
# (rows, tokens between the special ones). A larger one separates the per-token cost from the overhead.
SEED_BATCHES = ((1, 16), (4, 64))

_lock = threading.Lock()
_current: Preload | None = None
# The runners warmed up and seeded here, with their seed timings, until the engine asks (seeded).
_seeded: list[tuple[Any, list[tuple[int, float]]]] = []


class Preload:
    """The runners of ``settings.model_specs``, built on a thread of its own once started (:meth:`start`), for
    :meth:`take`; ``torch_free`` says which specs a torch-free runtime serves (all must, or none is built)."""

    def __init__(self, settings: Settings, load: Callable[[ModelSpec], Runner],
                 torch_free: Callable[[ModelSpec], bool]) -> None:
        self.settings = settings
        self._load = load
        self._torch_free = torch_free
        self._futures: dict[ModelSpec, Future[Runner | None]] = {
            spec: Future() for spec in settings.model_specs
        }
        # Not a daemon: a process stopped while loading waits for the load to end, as it waits for the device
        # thread, rather than finalise beside a runtime still compiling.
        self._thread = threading.Thread(target=self._run, name="coalesce-preload")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        futures = list(self._futures.items())
        try:
            declined = not all(self._torch_free(spec) for spec, _ in futures)
        except Exception:  # the engine's own load will say what is wrong with the specs
            declined = True
        for spec, future in futures:
            if not future.set_running_or_notify_cancel():
                continue
            if declined:
                future.set_result(None)
                continue
            try:
                runner = self._load(spec)
                runner.warmup()
                seeds = []
                for batch in seed_batches(runner):
                    prepared = runner.prepare(batch)
                    t0 = time.perf_counter()
                    runner.finish(runner.forward(prepared), prepared)
                    seeds.append((runner.padded_cost(len(batch), len(batch[0])), time.perf_counter() - t0))
                with _lock:
                    _seeded.append((runner, seeds))
            except BaseException as exc:  # handed to the engine, which raises it as its own load would
                future.set_exception(exc)
            else:
                future.set_result(runner)

    def take(self, spec: ModelSpec) -> Runner | None:
        """The runner built here for ``spec`` (waiting for it), raising what its loading raised; None when
        it was not preloaded (declined, or taken already). Called from the engine's device thread."""
        with _lock:
            future = self._futures.pop(spec, None)
        return None if future is None else future.result()


def seed_batches(runner: Runner) -> list[list[list[int]]]:
    """The batches of :data:`SEED_BATCHES` for ``runner``: one filler token repeated, with the model's
    special tokens."""
    filler = [min(1000, runner.info.vocab_size - 1)]
    batches = []
    for rows, length in SEED_BATCHES:
        seq = runner.tokens.with_special_tokens(filler * length)
        batches.append([seq] * rows)
    return batches


def torch_free(settings: Settings) -> Callable[[ModelSpec], bool]:
    """Whether a model of ``settings`` will be served by a torch-free runtime (see
    ``onnx_runner.resolve_backend``). Imports the kernels' light modules (no torch, no runtime) when it
    first decides, not here."""

    def decide(spec: ModelSpec) -> bool:
        from coalesce.kernels.onnx_runner import resolve_backend
        from coalesce.kernels.st_runner import default_model_path

        path = spec.path if spec.path is not None else default_model_path()
        return resolve_backend(settings.backend, path, settings.device) != "torch"

    return decide


def model_loader(settings: Settings) -> Callable[[ModelSpec], Runner]:
    """The loaders (``kernels/loader.py``) with the execution knobs of ``settings``: what builds a
    runner where no ``--runner-factory`` replaces it. Imports the kernels when it first loads, not here."""

    def load(spec: ModelSpec) -> Runner:
        from coalesce.kernels.buckets import GraphOptions
        from coalesce.kernels.loader import RunnerOptions, load_runner

        graphs = GraphOptions(
            enabled=settings.cuda_graphs,
            batch_sizes=settings.graph_batch_sizes,
            seq_lens=settings.graph_seq_lens,
            budget_s=settings.graph_capture_budget_s,
            budget_bytes=settings.graph_memory_budget_mb << 20,
        )
        options = RunnerOptions(
            device=settings.device, dtype=settings.dtype, graphs=graphs, backend=settings.backend,
            openvino_cache_dir=settings.openvino_cache_dir, cpu_fast_forward=settings.cpu_fast_forward,
            cpu_traced_forward=settings.cpu_traced_forward,
            cpu_kernel_cache=settings.cpu_kernel_cache,
        )
        return load_runner(spec.path, spec.name, options, task=spec.task,
                           rerank_template=spec.rerank_template)

    return load


def start(settings: Settings) -> Preload | None:
    """Start preloading the models of ``settings`` (with :func:`model_loader`, the engine's own) where
    this process loads models and no runner factory replaces the loaders; None where it does not apply."""
    global _current
    loads_models = settings.role == "engine" or (settings.role == "all" and settings.workers <= 1)
    if not loads_models or settings.runner_factory:
        return None
    preload = Preload(settings, model_loader(settings), torch_free(settings))
    with _lock:
        _current = preload
    preload.start()
    return preload


def claim(settings: Settings) -> Preload | None:
    """The preload started for this very ``settings`` object (so a test's engine, built from settings
    of its own, never takes a runner started for another), once; None otherwise."""
    global _current
    with _lock:
        if _current is None or _current.settings is not settings:
            return None
        preload, _current = _current, None
    return preload


def seeded(runner: Any) -> list[tuple[int, float]] | None:
    """For a runner warmed up and seeded here: the seed batches' (padded cost, seconds), for the engine's
    cost model, once (forgotten as they are given); None for any other runner (the engine warms it up
    and seeds its cost model itself)."""
    with _lock:
        for i, (done, seeds) in enumerate(_seeded):
            if done is runner:
                del _seeded[i]
                return seeds
    return None
