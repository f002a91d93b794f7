"""The traced CPU forward (``traced_forward``): the same rows as the Python forward on either side of the
attention's split, a forward that does not wait for the interpreter lock between its operators, and the
Python forward kept when tracing fails or drifts (tiny random BERT models: no model files needed)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import pytest
import torch
from coalesce.kernels import cpu_forward, traced_forward
from coalesce.kernels.buckets import GraphOptions
from coalesce.kernels.encoder_runner import EncoderEngine
from coalesce.kernels.traced_forward import TracedPool, trace_pool

from tests.unit.test_cpu_forward import BATCHES, _calibration, _ids, _model


def _rows_match(traced: TracedPool, model: Any, *, exact: bool) -> None:
    with torch.inference_mode():
        for rows, cols, lengths in BATCHES:  # below and past MATMUL_ATTENTION_MIN_ROWS, a padded row
            ids, lens = _ids(rows, cols, lengths, seed=rows)
            got, want = traced(ids, lens), model.pool(ids, lens)
            if exact:  # the same kernels in the same order
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            else:
                real = lens > 0
                cos = torch.nn.functional.cosine_similarity(got[real].float(), want[real].float(), dim=1)
                assert float(cos.min()) > 0.9999, (rows, cols)


@pytest.mark.parametrize("tuned", [False, True], ids=["plain", "tuned"])
def test_float32_traced_rows_equal_the_python_forward(tuned: bool) -> None:
    if tuned and cpu_forward.packing_unavailable() is not None:
        pytest.skip("this torch cannot pack for oneDNN")
    model = tune_cpu(_model()) if tuned else _model()
    traced = trace_pool(model, what="tiny")
    assert traced is not None
    _rows_match(traced, model, exact=True)


def tune_cpu(model: Any) -> Any:
    return cpu_forward.tune_cpu_forward(model, _calibration, what="tiny")


def test_bfloat16_rows_take_each_sides_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    # bfloat16 attends by matrix products from MATMUL_ATTENTION_MIN_ROWS rows and by the fused kernel
    # below: each side has its own trace. (Packing is mocked off: the attention alone, on any CPU.)
    monkeypatch.setattr(cpu_forward, "bf16_kernels", lambda: False)
    model = tune_cpu(_model(dtype=torch.bfloat16))
    assert model.layers[0].attend is cpu_forward.bf16_cpu_attention
    traced = trace_pool(model, what="tiny")
    assert traced is not None
    _rows_match(traced, model, exact=False)


def test_a_batch_runs_the_trace_of_its_side_of_the_split() -> None:
    calls: list[tuple[str, int]] = []

    def recording(name: str) -> Any:
        def run(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            calls.append((name, ids.shape[0]))
            return torch.zeros(ids.shape[0], 3)
        return run

    pool = TracedPool(recording("few"), recording("many"))
    split = cpu_forward.MATMUL_ATTENTION_MIN_ROWS
    for rows in (1, split - 1, split, 3 * split):
        pool(torch.zeros(rows, 5, dtype=torch.long), torch.full((rows,), 5))
    assert calls == [("few", 1), ("few", split - 1), ("many", split), ("many", 3 * split)]


def _forward_beside_a_spinning_thread(pool: Any, ids: torch.Tensor, lens: torch.Tensor,
                                      interval_s: float, limit_s: float) -> bool:
    """Whether one forward on a thread of its own finishes within ``limit_s`` while this thread runs
    Python without pause under switch interval ``interval_s``."""
    done = threading.Event()

    def run() -> None:
        with torch.inference_mode():
            pool(ids, lens)
        done.set()

    was = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    thread = threading.Thread(target=run)
    try:
        t0 = time.perf_counter()
        thread.start()
        while not done.is_set() and time.perf_counter() - t0 < limit_s:
            sum(range(50))  # Python without pause: the lock is dropped only when asked
        finished = done.is_set()
    finally:
        sys.setswitchinterval(was)
    thread.join()
    return finished


def test_the_traced_forward_does_not_wait_for_the_lock_between_operators() -> None:
    # With the lock's switch interval at 0.1 s, each take-back of the lock beside a thread that never
    # drops it on its own waits ~0.1 s. The traced forward takes it back a few times (its call and
    # return): the limit (2 s) is over ten take-backs. The control, a forward that drops and takes back
    # the lock between each of its 60 operators (as a Python forward's operators may: whether a small
    # one drops it depends on the operator and the BLAS kernel, so the tiny model's own Python forward
    # finished within the limit on one CI machine), waits 6 s and more: a lower bound no machine's speed
    # changes, so the test can fail. Its drops are 10 ms sleeps (0.6 s in all), long enough for the
    # spinning thread to be running when the lock comes free: with ``sleep(0)`` on a machine with more
    # runnable threads than cores (the suite beside other work) the control could take the lock straight
    # back before that thread got a core, and finished within the limit (1 run of 3 beside two busy loops).
    model = _model()
    traced = trace_pool(model, what="tiny")
    assert traced is not None
    ids, lens = _ids(6, 9, [9, 4, 7, 1, 9, 5])
    with torch.inference_mode():
        traced(ids, lens)  # warm: first calls build plans

    def taking_the_lock_back(ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        out = ids.float()
        for _ in range(60):
            out = out + 1.0
            time.sleep(0.01)  # drops the lock; taking it back waits for the spinning thread to be asked
        return out

    assert _forward_beside_a_spinning_thread(traced, ids, lens, 0.1, 2.0)
    assert not _forward_beside_a_spinning_thread(taking_the_lock_back, ids, lens, 0.1, 2.0)


def test_a_trace_that_fails_keeps_the_python_forward(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Unsupported value kind: Tensor")

    monkeypatch.setattr(torch.jit, "trace_module", refuses)
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        assert trace_pool(_model(), what="tiny") is None
    assert "keeps its Python CPU forward" in caplog.text and "Unsupported value kind" in caplog.text


def test_a_trace_whose_rows_drift_keeps_the_python_forward(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = TracedPool.__call__

    def scrambled(self: TracedPool, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return real(self, ids, lengths).flip(-1)  # a shape the trace baked in wrongly

    monkeypatch.setattr(TracedPool, "__call__", scrambled)
    with caplog.at_level(logging.WARNING, logger="coalesce.kernels"):
        assert trace_pool(_model(), what="tiny") is None
    assert "moved to cosine" in caplog.text


def test_the_engine_runs_its_cpu_pool_when_it_has_one() -> None:
    model = _model()
    seen: list[int] = []
    traced = trace_pool(model, what="tiny")
    assert traced is not None

    def recording(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        seen.append(ids.shape[0])
        return traced(ids, lengths)

    engine = EncoderEngine(model, device=torch.device("cpu"), max_tokens=20, pad_id=0,
                           graphs=GraphOptions(), cpu_pool=recording)
    plain = EncoderEngine(model, device=torch.device("cpu"), max_tokens=20, pad_id=0, graphs=GraphOptions())
    batch = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    got = engine.finish(engine.forward(p := engine.prepare(batch)), p)
    want = plain.finish(plain.forward(q := plain.prepare(batch)), q)
    assert seen == [3]
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=0, atol=1e-6)


def test_the_check_batches_fit_a_model_with_few_positions() -> None:
    # The tiny model holds 24 positions; the checks' longest rows are clipped to them.
    assert max(longest for _, longest in traced_forward.CHECK_SHAPES) > _model().max_positions
    assert trace_pool(_model(), what="tiny") is not None
