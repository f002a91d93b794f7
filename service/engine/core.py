"""The engine: every served model's runner, worker threads and batcher, on one device thread.

In one process (``--workers 1``) the gateway calls the engine's batchers directly; under ``--workers
N`` the engine runs in a process of its own (``engine/server.py``) and gateways reach it over Unix sockets.
Either way this is the one place models are loaded, warmed and calibrated, and the one owner of their
queues. Loading runs on the device thread, so the event loop keeps answering while weights load; a
torch-free runner that ``coalesce serve`` started loading while it imported itself (``preload.py``) is
taken from there, warmed up and with its cost-model seeds measured, instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from coalesce.kernels.calibration import corpus_batches
from coalesce.kernels.protocol import CalibratedRunner, ModelInfo, Runner, Task
from coalesce.kernels.worker import (
    BatchOutput,
    DeviceThread,
    LoopShare,
    ModelWorker,
    cpu_forwards,
    loop_share,
    side_by_side,
    torch_device,
)

from ..allocator import Trimmer
from ..batching.batcher import Batcher
from ..batching.cache import ResultCache
from ..batching.cost import CostModel
from ..batching.policy import Limits
from ..batching.scheduler import Scheduler, SchedulerConfig
from ..logs import get_logger
from ..metrics import Metrics
from ..settings import ModelSpec, Settings
from . import preload
from .threads import ThreadChooser, chooser

log = get_logger("coalesce.engine")

RunnerFactory = Callable[[ModelSpec], Runner]


@dataclass(slots=True)
class EngineModel:
    """One loaded model: its runner, the worker that drives it, and the batcher that owns its queue."""

    runner: Runner
    worker: ModelWorker
    batcher: Batcher
    calibration: np.ndarray | None = None  # the built-in corpus's embeddings (int8/uint8 scale)

    @property
    def info(self) -> ModelInfo:
        return self.runner.info


class Engine:
    """Loads the models of ``settings`` and owns their batchers; event loop only (threads inside)."""

    def __init__(self, settings: Settings, metrics: Metrics, factory: RunnerFactory) -> None:
        self._settings = settings
        self._metrics = metrics
        self._factory = factory
        # On glibc without jemalloc, freed memory is handed back after batches (allocator.py).
        self._trimmer = Trimmer.for_process(settings.allocator)
        self.device = DeviceThread(after_batch=self._trimmer.batch_done if self._trimmer else None)
        self.cache = ResultCache(settings.cache_mb << 20)  # shared by every model's batcher
        self.models: list[EngineModel] = []
        # The forward's CPU threads against the event loop's busy share: one for the device thread, which
        # every model's forwards share (made with the first torch CPU model).
        self.share: LoopShare | None = None
        # And what caps that count while a forward on every core runs slower than on one fewer (a core
        # busy with something else: threads.py), with the cost models of the forwards it counts.
        self.chooser: ThreadChooser | None = None
        self._costs: list[CostModel] = []
        self._closed = False

    async def load(self) -> None:
        """Load, warm and calibrate every model, then start its batcher. Raises if any model fails."""
        loop = asyncio.get_running_loop()
        settings, metrics = self._settings, self._metrics
        beside_gateways = settings.role == "engine"  # the engine of --workers: gateways share its cores
        for spec in settings.model_specs:
            t0 = time.perf_counter()
            runner = await loop.run_in_executor(self.device.executor, self._factory, spec)
            t1 = time.perf_counter()
            depth = settings.pipeline_depth or (2 if str(runner.device).startswith("cuda") else 1)
            on = torch_device(runner)  # (None: a runtime's own thread pool, which nothing here counts)
            wanted = cpu_forwards(on, settings.cpu_forwards, runner, beside_gateways=beside_gateways)
            side = side_by_side(on, wanted)
            if side is not None and len(self.device.lanes) == 1:
                self.device.side_by_side(wanted, side)
                metrics.forward_threads.set(1)
            forwards = len(self.device.lanes) if side is not None else 1
            if forwards > 1:
                depth = forwards  # (each forward on its own thread: none to prepare beside, none to spare)
            elif self.share is None:
                self.share = loop_share(on, settings.loop_core_share, judge_forward=beside_gateways)
                if self.share is not None:
                    self.share.on_change = self._forward_threads
                    metrics.forward_threads.set(self.share.threads)
                    self.chooser = chooser(self.share)
            share = self.share if str(on) == "cpu" else None
            counts = self.chooser if share is not None else None  # (made with the share it counts for)
            worker = ModelWorker(runner, self.device, overlap=depth > 1 and forwards == 1, share=share)
            cost = CostModel()
            if share is not None:
                cost.use(share.threads)  # (a fit per thread count: the count can change under it)
                self._costs.append(cost)
            # A runner preloaded while the server imported itself comes warmed up, with the seed batches'
            # timings (preload.py): load_s and warmup_s below are then only what the engine waited for
            # and ran after those imports.
            seeds = preload.seeded(runner)
            preloaded = seeds is not None
            if seeds is None:
                await worker.warmup()
                seeded = await _seed_cost(worker, runner, cost)
                if share is not None and counts is not None:
                    await _seed_fewer(worker, runner, cost, share, counts, seeded)
            else:
                for padded, seconds in seeds:
                    cost.observe(padded, seconds)
            calibration = stored = runner.calibration if isinstance(runner, CalibratedRunner) else None
            if calibration is None and runner.info.task is Task.EMBED:
                calibration = await _embed_corpus(worker, runner)
            t2 = time.perf_counter()
            scheduler = Scheduler(
                scheduler_config(settings, runner.info.max_tokens, depth, forwards), cost, runner.padded_cost
            )
            batcher = Batcher(
                worker, model=runner.info.name, scheduler=scheduler, metrics=metrics, cache=self.cache,
                device=str(runner.device), shape=getattr(runner, "padded_shape", None),
                on_forward=counts.forwarded if counts is not None else None,
            )
            batcher.start()
            self.models.append(EngineModel(runner, worker, batcher, calibration))
            metrics.startup_seconds.labels(f"load:{runner.info.name}").set(t1 - t0)
            metrics.startup_seconds.labels(f"warmup:{runner.info.name}").set(t2 - t1)
            log.info(
                "model_ready",
                model=runner.info.name,
                task=str(runner.info.task),
                device=str(runner.device),
                dtype=runner.info.dtype,
                dim=runner.info.dim,
                max_tokens=runner.info.max_tokens,
                load_s=round(t1 - t0, 3),
                warmup_s=round(t2 - t1, 3),
                cost_overhead_ms=round(cost.coef.overhead_s * 1e3, 3),
                cost_per_token_us=round(cost.coef.per_token_s * 1e6, 3),
                calibration="none" if calibration is None else "stored" if stored is not None else "computed",
                preloaded=preloaded,
                forwards=forwards,  # side by side (--cpu-forwards, resolved)
            )
        self.record_capture()

    def _forward_threads(self, threads: int) -> None:
        # (The loop's busy share crossed --loop-core-share, at most once a second, or the thread chooser
        # capped or freed the count.) Logged in a context of its own: the batch that noticed may start in
        # a request's, whose id is no part of this.
        assert self.share is not None
        for cost in self._costs:
            # (A count not seen yet is guessed from this one's fit, as if the forward scaled with threads.)
            cost.use(threads, scale=cost.setting / threads if isinstance(cost.setting, int) else 1.0)
        self._metrics.forward_threads.set(threads)
        contextvars.Context().run(log.info, "forward_threads", threads=threads, of=self.share.cores,
                                  loop_busy=round(self.share.busy, 2), cap=self.share.cap)

    def record_capture(self) -> None:
        """Graph runners' capture statistics into the gauges (after loading, and then periodically)."""
        for model in self.models:
            stats = model.runner.capture_stats
            if stats is not None:
                self._metrics.record_capture(model.info.name, stats)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; let admitted work finish within ``timeout`` s. True if it all did."""
        results = await asyncio.gather(*(m.batcher.drain(timeout) for m in self.models))
        return all(results)

    async def close(self) -> None:
        """Answer whatever is still queued (503), stop the batchers and the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for model in self.models:
            await model.batcher.close()
            model.worker.close()
        await asyncio.get_running_loop().run_in_executor(None, self.device.close)
        if self._trimmer is not None:
            self._trimmer.close()


def default_factory(settings: Settings) -> RunnerFactory:
    """Runners as ``coalesce serve`` loads them: ``--runner-factory`` when given, else the loaders,
    taking first the runners ``coalesce serve`` started loading for these settings (``preload.py``)."""
    if settings.runner_factory:
        import importlib

        module, _, name = settings.runner_factory.partition(":")
        factory: RunnerFactory = getattr(importlib.import_module(module), name)
        return factory
    load = preload.model_loader(settings)
    early = preload.claim(settings)
    if early is None:
        return load

    def take_or_load(spec: ModelSpec) -> Runner:
        runner = early.take(spec)
        return load(spec) if runner is None else runner

    return take_or_load


def scheduler_config(settings: Settings, max_tokens: int, depth: int, forwards: int = 1) -> SchedulerConfig:
    """The batching knobs of ``settings`` for one model (whose longest input is ``max_tokens``)."""
    strategy = settings.batching
    queue_wait_ms = settings.max_queue_wait_ms
    if queue_wait_ms is None:
        queue_wait_ms = settings.target_latency_ms
    wait_ms = (
        settings.max_wait_ms if settings.max_wait_ms is not None else (5.0 if strategy == "fixed" else 0.0)
    )
    return SchedulerConfig(
        strategy=strategy,  # type: ignore[arg-type]
        limits=Limits(settings.max_batch_size, max(settings.max_batch_tokens, max_tokens)),
        target_latency_s=settings.target_latency_ms / 1e3,
        max_wait_s=wait_ms / 1e3,
        max_queued_tokens=settings.max_queued_tokens,
        tenant_max_queued_tokens=settings.tenant_max_queued_tokens or settings.max_queued_tokens // 2,
        priority_ratio=settings.priority_ratio,
        interactive_batch_s=settings.interactive_batch_ms / 1e3,
        pipeline_depth=depth,
        forwards=forwards,
        max_queue_wait_s=queue_wait_ms / 1e3,
        burst_wait_s=settings.burst_wait_ms / 1e3,
        queue_target_s=(settings.queue_target_ms if settings.queue_target_ms is not None
                        else settings.target_latency_ms / 4) / 1e3,
        queue_interval_s=settings.queue_interval_ms / 1e3,
    )


async def _seed_cost(worker: ModelWorker, runner: Runner, cost: CostModel) -> list[tuple[int, BatchOutput]]:
    """Seed the cost model with a small and a larger batch (``preload.SEED_BATCHES``), so first
    decisions rest on measurements. The larger is 4 × 64 (15× the padded tokens of the small one, enough
    to separate overhead from per-token cost): 8 × 64 made every CPU cold start tens of milliseconds
    longer, and real batches refit the model anyway. Each seed's padded tokens and output."""
    seeds = []
    for batch in preload.seed_batches(runner):
        out = await worker.run(batch)
        seeds.append((runner.padded_cost(len(batch), len(batch[0])), out))
        cost.observe(seeds[-1][0], out.forward_s, out.threads or None)
    return seeds


async def _seed_fewer(worker: ModelWorker, runner: Runner, cost: CostModel, share: LoopShare,
                      chooser: ThreadChooser, seeds: list[tuple[int, BatchOutput]]) -> None:
    """Seed the cost model's fit on one thread fewer too (each seed a probe at that count: two small
    forwards more at start), then judge ``seeds``, run before on every core, against it as the chooser
    judges batches (``threads.py``): a forward that starts beside a busy core starts on fewer threads,
    and its first burst is admitted on the fit of the count it runs at."""
    for batch in preload.seed_batches(runner):
        share.probe(chooser.fewer)
        out = await worker.run(batch)
        cost.observe(runner.padded_cost(len(batch), len(batch[0])), out.forward_s, out.threads or None)
    for padded, out in seeds:
        if out.threads == chooser.all:
            chooser.forwarded(cost, out.threads, padded, out.forward_s)


async def _embed_corpus(worker: ModelWorker, runner: Runner) -> np.ndarray:
    """The built-in calibration corpus's embeddings (float32, corpus × width), once, at warm-up, for
    a runner that does not bring them stored (only an export does)."""
    rows = [(await worker.run(batch)).rows for batch in corpus_batches(runner.tokens)]
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.float32)
