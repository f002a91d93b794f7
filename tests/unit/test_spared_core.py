"""Which runners the engine spares the event loop a core for (``Engine._spared_core``): torch forwards on
the CPU on two threads or more, unless ``--no-cpu-spare-core``; one :class:`SparedCore` for the device
thread that every model shares. The thread count is mocked: the test must not depend on this machine's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from coalesce.service.engine.core import Engine
from coalesce.service.metrics import Metrics
from coalesce.service.settings import Settings

from ..fakes import FakeRunner


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls to torch.set_num_threads; the forward has two threads."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def _engine(**settings: object) -> Iterator[Engine]:
    engine = Engine(Settings(cache_mb=0, **settings), Metrics(), lambda spec: FakeRunner())  # type: ignore[arg-type]
    try:
        yield engine
    finally:
        engine.device.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    yield from _engine()


def test_a_torch_forward_on_the_cpu_gets_one_spared_core_shared_by_every_model(
    engine: Engine, threads: list[int],
) -> None:
    first = engine._spared_core(FakeRunner(device=torch.device("cpu")))  # type: ignore[arg-type]
    second = engine._spared_core(FakeRunner(device=torch.device("cpu")))  # type: ignore[arg-type]
    assert first is not None and first is second is engine.device.threads
    assert first.full == 2
    first.spare(0, True)
    first.apply()
    first.spare(0, False)
    first.apply()
    assert threads == [1, 2]  # torch's own setter, one fewer then all again


@pytest.mark.parametrize("device", ["cpu", torch.device("cuda", 0)])
def test_no_core_is_spared_for_a_forward_off_these_cores_or_outside_torch(
    engine: Engine, threads: list[int], device: object,
) -> None:
    # A GPU's forward does not run on the CPU's cores; a runner whose device is no torch device (ONNX
    # Runtime, OpenVINO: they size their own pools) is not torch's to set.
    assert engine._spared_core(FakeRunner(device=device)) is None  # type: ignore[arg-type]
    assert engine.device.threads is None


def test_no_core_is_spared_on_one_thread_or_when_turned_off(
    monkeypatch: pytest.MonkeyPatch, threads: list[int],
) -> None:
    for off in _engine(cpu_spare_core=False):
        assert off._spared_core(FakeRunner(device=torch.device("cpu"))) is None  # type: ignore[arg-type]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for one in _engine():
        assert one._spared_core(FakeRunner(device=torch.device("cpu"))) is None  # type: ignore[arg-type]
        assert one.device.threads is None


async def test_a_loaded_models_scheduler_asks_for_the_core_under_a_confirmed_overload(
    threads: list[int],
) -> None:
    factory = lambda spec: FakeRunner(device=torch.device("cpu"))  # noqa: E731
    engine = Engine(Settings(cache_mb=0), Metrics(), factory)  # type: ignore[arg-type]
    await engine.load()
    try:
        scheduler = engine.models[0].batcher.scheduler
        spared = engine.device.threads
        assert spared is not None and scheduler.on_overload is not None
        scheduler.on_overload(True)
        assert spared.wanted == 1
        scheduler.on_overload(False)
        assert spared.wanted == 2
    finally:
        await engine.close()
