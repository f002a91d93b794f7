"""A gateway's early refusal on the engine's last queue report (``RemoteModel.check_room``, ``--workers
N``), before it reads a body or tokenises: a standing queue's reported wait is the wait now (arrivals
refill it as fast as it drains), while a burst's backlog has drained by the report's age."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from coalesce.kernels.protocol import ModelInfo, Task
from coalesce.service.batching.admit import DOOR, AdmissionConfig
from coalesce.service.engine import messages as wire
from coalesce.service.errors import Overloaded
from coalesce.service.gateway.admission import Admission
from coalesce.service.gateway.facade import RemoteModel
from coalesce.service.gateway.prompts import Prompts
from coalesce.service.metrics import Metrics

from ..fakes import FakeTokens

MAX_WAIT_S = 0.5


class Reporting:
    """The engine client as ``check_room`` reads it: one model's last queue report and its age."""

    def __init__(self) -> None:
        self.queue = wire.Queue(0, 0.0)
        self.age = 0.0

    def check_open(self) -> None:
        pass

    def report(self, model: int) -> tuple[wire.Queue, float]:
        return self.queue, self.age


@pytest.fixture
def rig() -> Iterator[tuple[Reporting, RemoteModel]]:
    client = Reporting()
    cfg = AdmissionConfig(max_batch_size=32, max_queued_tokens=100_000, tenant_max_queued_tokens=0,
                          max_queue_wait_s=MAX_WAIT_S, burst_wait_s=5.0, queue_target_s=0.05,
                          queue_interval_s=0.5)
    info = ModelInfo(name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8)
    model = RemoteModel(
        client, 0, info, FakeTokens(), device="cpu", max_queued_tokens=100_000,  # type: ignore[arg-type]
        metrics=Metrics(), prompts=Prompts(), calibration=None, admission=cfg, gateways=2)
    yield client, model
    model.close()


def head() -> Admission:
    """A request whose head has just arrived."""
    now = time.monotonic()
    return Admission("default", 1.0, 1, 30.0, now + 30.0, now)


def queue(standing: bool, wait: float) -> wire.Queue:
    return wire.Queue(tokens=2_000, drain_s=wait, standing=standing, waits=[wait] * 3,
                      overhead_s=0.002, per_token_s=0.0001, capacity=10_000.0)


def test_a_standing_queue_refuses_at_the_gateway_on_a_report_a_moment_old(
        rig: tuple[Reporting, RemoteModel]) -> None:
    client, model = rig
    # The standing queue sits at its bound: a request's first result would come just past the promise.
    client.queue, client.age = queue(True, DOOR * MAX_WAIT_S), 0.2
    with pytest.raises(Overloaded) as refused:
        model.check_room(head(), first=4, total=4)
    assert refused.value.code == "overloaded" and refused.value.retry_after > 0
    # Well under the bound it admits, however old the report.
    client.queue = queue(True, DOOR * MAX_WAIT_S / 2)
    model.check_room(head(), first=4, total=4)


def test_a_bursts_backlog_counts_as_drained_by_the_reports_age(rig: tuple[Reporting, RemoteModel]) -> None:
    client, model = rig
    client.queue, client.age = queue(False, 5.1), 0.0  # past --burst-wait-ms (5 s)
    with pytest.raises(Overloaded) as refused:
        model.check_room(head(), first=4, total=4)
    assert refused.value.code == "queue_full"
    client.age = 0.2  # 4.9 s are left of it now: within the bound
    model.check_room(head(), first=4, total=4)
