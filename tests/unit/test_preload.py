"""Loading the torch-free runners while the server imports itself (``engine/preload.py``): the runner is
built, warmed up and timed on the batches the engine seeds its cost model with, on a thread of its own,
handed to the engine once with those timings (which the engine then neither warms up nor runs again),
and never built there where any model needs torch; a failed load fails the engine's load. Fake runners;
no model, no runtime."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from coalesce.kernels.calibration import corpus_batches
from coalesce.kernels.protocol import ModelInfo, Task
from coalesce.service import settings
from coalesce.service.engine import preload
from coalesce.service.engine.core import Engine, default_factory
from coalesce.service.metrics import Metrics
from coalesce.service.settings import ModelSpec, Settings

from ..fakes import FakeRunner


@dataclass
class RecordingRunner(FakeRunner):
    """Says which threads warmed it up and ran its forwards."""

    warmups: list[str] = field(default_factory=list)
    forward_threads: list[str] = field(default_factory=list)

    def warmup(self) -> None:
        self.warmups.append(threading.current_thread().name)

    def forward(self, prepared: list[list[int]]) -> list[list[int]]:
        self.forward_threads.append(threading.current_thread().name)
        return super().forward(prepared)


class Loader:
    """A loader that builds a ``RecordingRunner`` per spec (or raises ``fail``) and says whom it built."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.loaded: list[ModelSpec] = []
        self.threads: list[str] = []

    def __call__(self, spec: ModelSpec) -> RecordingRunner:
        self.loaded.append(spec)
        self.threads.append(threading.current_thread().name)
        if self.fail is not None:
            raise self.fail
        return RecordingRunner()


def _settings(*argv: str) -> Settings:
    return settings.build(list(argv), environ={})


@pytest.fixture(autouse=True)
def nothing_left_over() -> Iterator[None]:
    yield
    leftover = preload._current  # a test that started a preload and did not claim it
    preload._current = None
    preload._seeded.clear()
    if leftover is not None:
        leftover._thread.join(10)


def _started(s: Settings, load: Loader, torch_free: Any = lambda spec: True) -> preload.Preload:
    early = preload.Preload(s, load, torch_free)
    early.start()
    early._thread.join(10)
    return early


def test_a_runner_is_built_warmed_and_run_on_the_seed_shapes_on_the_preload_thread() -> None:
    s = _settings("--model", "/models/a", "--backend", "openvino")
    load = Loader()
    early = _started(s, load)
    (spec,) = s.model_specs
    runner = early.take(spec)
    assert isinstance(runner, RecordingRunner)
    assert load.threads == ["coalesce-preload"] and runner.warmups == ["coalesce-preload"]
    assert runner.batches == [rows for rows, _ in preload.SEED_BATCHES]
    assert set(runner.forward_threads) == {"coalesce-preload"}
    assert early.take(spec) is None  # handed over once; a second ask loads as usual
    seeds = preload.seeded(runner)
    assert seeds is not None and preload.seeded(runner) is None  # told once
    assert [padded for padded, _ in seeds] == [len(b) * len(b[0]) for b in preload.seed_batches(runner)]
    assert all(seconds >= 0 for _, seconds in seeds)
    assert preload.seeded(RecordingRunner()) is None


def test_the_seed_batches_are_the_engines_seed_shapes() -> None:
    runner = RecordingRunner(ModelInfo(name="long", task=Task.EMBED, max_tokens=128, vocab_size=1000, dim=8))
    batches = preload.seed_batches(runner)
    assert [(len(b), len(b[0]) - 2) for b in batches] == list(preload.SEED_BATCHES)  # 2 special tokens
    assert all(len(set(map(tuple, b))) == 1 for b in batches)


def test_nothing_is_preloaded_where_any_model_needs_torch() -> None:
    s = _settings("--model", "a=/models/export", "--model", "b=/models/torch")
    load = Loader()
    early = _started(s, load, torch_free=lambda spec: spec.path != "/models/torch")
    assert [early.take(spec) for spec in s.model_specs] == [None, None]
    assert load.loaded == []


def test_a_failed_load_fails_when_the_engine_takes_the_model() -> None:
    s = _settings("--model", "/models/broken", "--backend", "onnx")
    early = _started(s, Loader(fail=FileNotFoundError("no model.onnx")))
    with pytest.raises(FileNotFoundError, match=r"no model\.onnx"):
        early.take(s.model_specs[0])


@pytest.mark.parametrize("argv", [
    ["--role", "gateway"],  # a --workers gateway loads no model
    ["--workers", "2"],  # the supervisor: its engine process preloads
    ["--runner-factory", "tests.fakes:slow_minilm"],  # the factory replaces the loaders
])
def test_only_a_process_that_loads_models_with_the_loaders_preloads(argv: list[str]) -> None:
    assert preload.start(_settings("--model", "/models/a", *argv)) is None
    assert preload._current is None


def test_the_engine_takes_the_preloaded_runner_once_and_neither_warms_nor_seeds_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load = Loader()
    monkeypatch.setattr(preload, "model_loader", lambda s: load)
    monkeypatch.setattr(preload, "torch_free", lambda s: lambda spec: True)
    s = _settings("--model", "/models/a", "--role", "engine")
    early = preload.start(s)
    assert early is not None
    assert preload.claim(_settings("--model", "/models/a", "--role", "engine")) is None  # other settings
    factory = default_factory(s)  # claims it
    assert preload.claim(s) is None  # once
    early._thread.join(10)

    async def load_engine() -> RecordingRunner:
        engine = Engine(s, Metrics(), factory)
        try:
            await engine.load()
            runner = engine.models[0].runner
            assert isinstance(runner, RecordingRunner)
            return runner
        finally:
            await engine.close()

    runner = asyncio.run(load_engine())
    assert load.loaded == list(s.model_specs)  # built once, by the preload
    assert runner.warmups == ["coalesce-preload"]  # not again on the device thread
    seeds = [rows for rows, _ in preload.SEED_BATCHES]
    corpus = [len(batch) for batch in corpus_batches(runner.tokens)]  # a fake stores no calibration rows
    assert runner.batches == seeds + corpus  # the seed batches ran once, on the preload thread
    assert set(runner.forward_threads[: len(seeds)]) == {"coalesce-preload"}
    assert "coalesce-preload" not in runner.forward_threads[len(seeds):]
    assert factory(s.model_specs[0]) is not runner  # a later load builds anew
    assert load.loaded == [*s.model_specs, *s.model_specs]


@pytest.mark.parametrize(("argv", "tuned", "traced"), [
    ([], True, True), (["--no-cpu-fast-forward"], False, True), (["--no-cpu-traced-forward"], True, False),
])
def test_the_cpu_forward_flags_reach_the_loader(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], tuned: bool, traced: bool
) -> None:
    from coalesce.kernels import loader

    seen: list[Any] = []
    monkeypatch.setattr(loader, "load_runner", lambda path, name, options, **kw: seen.append(options))
    preload.model_loader(settings.build(argv, environ={}))(ModelSpec(None, None))
    assert [(o.cpu_fast_forward, o.cpu_traced_forward) for o in seen] == [(tuned, traced)]
