"""The served models: each one's runner, worker threads and batcher, looked up by name.

Loading runs on a background thread so the listener is up at once: ``/health`` answers while weights
load, ``/ready`` turns 200 only after every model is loaded and warmed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coalesce.kernels.protocol import ModelInfo, Runner
from coalesce.kernels.worker import DeviceThread, ModelWorker

from ..batching.batcher import Batcher
from ..batching.cost import CostModel
from ..batching.policy import Limits
from ..batching.scheduler import Scheduler, SchedulerConfig
from ..errors import InvalidRequest, ModelNotFound
from ..logs import get_logger
from ..metrics import Metrics
from ..settings import ModelSpec, Settings

log = get_logger("coalesce.models")

RunnerFactory = Callable[[ModelSpec], Runner]


@dataclass(slots=True)
class ServedModel:
    info: ModelInfo
    runner: Runner
    worker: ModelWorker
    batcher: Batcher
    specials: int  # special tokens the runner adds to every input


class ModelRegistry:
    """Name → served model. Filled once at start-up, read-only afterwards."""

    def __init__(self) -> None:
        self._by_name: dict[str, ServedModel] = {}
        self.models: list[ServedModel] = []

    def add(self, served: ServedModel) -> None:
        for name in (served.info.name, *served.info.aliases):
            self._by_name[name] = served
        self.models.append(served)

    def get(self, name: str | None) -> ServedModel:
        if name is None:
            raise InvalidRequest(
                f"The 'model' field is required; this server serves: {', '.join(self.names())}.",
                param="model",
                code="missing_model",
            )
        served = self._by_name.get(name)
        if served is None:
            raise ModelNotFound(
                f"The model '{name}' does not exist on this server; it serves: {', '.join(self.names())}.",
                param="model",
            )
        return served

    def names(self) -> list[str]:
        return [m.info.name for m in self.models]


async def load_models(
    settings: Settings,
    registry: ModelRegistry,
    metrics: Metrics,
    device: DeviceThread,
    factory: RunnerFactory,
) -> None:
    """Load, warm and calibrate every model, then register it. Raises if any model fails to load."""
    loop = asyncio.get_running_loop()
    for spec in settings.model_specs:
        t0 = time.perf_counter()
        runner = await loop.run_in_executor(device.executor, factory, spec)
        t1 = time.perf_counter()
        worker = ModelWorker(runner, device)
        await worker.warmup()
        cost = CostModel()
        await _calibrate(worker, runner, cost)
        t2 = time.perf_counter()
        depth = settings.pipeline_depth or (
            2 if str(getattr(runner, "device", "cpu")).startswith("cuda") else 1
        )
        scheduler = Scheduler(
            scheduler_config(settings, runner.info.max_tokens, depth), cost, runner.padded_cost
        )
        batcher = Batcher(
            worker,
            model=runner.info.name,
            scheduler=scheduler,
            metrics=metrics,
        )
        batcher.start()
        registry.add(ServedModel(runner.info, runner, worker, batcher, len(runner.with_special_tokens([]))))
        metrics.startup_seconds.labels(f"load:{runner.info.name}").set(t1 - t0)
        metrics.startup_seconds.labels(f"warmup:{runner.info.name}").set(t2 - t1)
        log.info(
            "model_ready",
            model=runner.info.name,
            task=str(runner.info.task),
            dim=runner.info.dim,
            max_tokens=runner.info.max_tokens,
            load_s=round(t1 - t0, 3),
            warmup_s=round(t2 - t1, 3),
            cost_overhead_ms=round(cost.coef.overhead_s * 1e3, 3),
            cost_per_token_us=round(cost.coef.per_token_s * 1e6, 3),
        )


def scheduler_config(settings: Settings, max_tokens: int, depth: int) -> SchedulerConfig:
    """The batching knobs of ``settings`` for one model (whose longest input is ``max_tokens``)."""
    strategy = settings.batching
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
        priority_aging_s=settings.priority_aging_ms / 1e3,
        pipeline_depth=depth,
    )


async def _calibrate(worker: ModelWorker, runner: Runner, cost: CostModel) -> None:
    """Seed the cost model with a small and a larger batch, so first decisions rest on measurements."""
    filler = [min(1000, runner.info.vocab_size - 1)]
    for n, length in ((1, 16), (8, 64)):
        seq = runner.with_special_tokens(filler * length)
        out = await worker.run([seq] * n)
        cost.observe(runner.padded_cost(n, len(seq)), out.forward_s)


def check_ids(ids: Sequence[int], vocab_size: int, index: int) -> None:
    """Token ids must be in the model's own vocabulary (LangChain sends OpenAI's ids by default)."""
    for tok in ids:
        if tok < 0 or tok >= vocab_size:
            raise InvalidRequest(
                f"Token id {tok} in input {index} is outside this model's vocabulary (0..{vocab_size - 1}). "
                "Token arrays must use the served model's tokenizer; LangChain's OpenAIEmbeddings "
                "sends OpenAI's ids unless check_embedding_ctx_length=False, which makes it send text.",
                param=f"input[{index}]",
                code="invalid_token_id",
            )
