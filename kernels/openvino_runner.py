"""The OpenVINO runner: a directory written by ``coalesce export`` served by OpenVINO's CPU plugin, torch-free
like the ONNX Runtime runner it extends (same tokenizer, padding, cost model and protocol; only the graph
runs elsewhere).

Why a second torch-free runtime: on the same exported graph OpenVINO's CPU plugin measured 1.1-1.4x ONNX
Runtime's throughput in float32, and 2.2-2.5x in bfloat16 on a CPU with native bf16 (AVX512-BF16 or AMX),
at a cosine to float32 of 0.99995 and above.

Precision (:func:`choose_precision`): ``--dtype auto`` asks for bfloat16 where the CPU has native bf16
(OpenVINO lists ``BF16`` among the CPU's optimisation capabilities) and float32 elsewhere; ``--dtype
float32`` or ``bfloat16`` force it (bfloat16 on a CPU without it runs float32, logged). A reduced
precision must earn its place at warm-up: the first batch of the calibration corpus is embedded in it
and compared with float32 rows (the export's stored ones, or a float32 compile of the same graph); a
model whose rows drift past :data:`.precision.BF16_MIN_COSINE` (the torch runners' bound; logits past
:data:`MAX_LOGIT_ERROR`) is recompiled in float32 and says so in the log. ``/info``'s ``model_dtype``
names the precision that serves.

Compiled models are cached (OpenVINO's ``CACHE_DIR``; :func:`default_cache_dir`), so a restart reads the
compiled blob instead of compiling again; the guard's measurement is kept in the same folder
(:class:`GuardRecord`), so a restart on the same export, OpenVINO and CPU decides the precision from it
instead of embedding and comparing again. Construction compiles; only the model thread may call
``forward``/``finish``/``warmup``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import calibration, precision
from .onnx_runner import (
    GRAPH_FILE,
    MANIFEST_FILE,
    ExportManifest,
    OnnxBatch,
    OnnxPairRunner,
    OnnxRunner,
    intra_op_threads,
    read_export,
)
from .protocol import ModelInfo, Task

log = logging.getLogger("coalesce.kernels")

CACHE_FOLDER = "openvino_cache"  # in the export directory, when it is writable
MAX_LOGIT_ERROR = 0.01  # classifiers: the largest logit difference, relative to the largest logit
GUARD_ROWS = calibration.BATCH  # the first batch of the calibration corpus
GUARD_PREFIX = "coalesce-guard-"  # in the compiled-model cache: one JSON file per guard key

# OpenVINO's inference precision names ↔ how /info names a forward's precision.
_DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
_ASKED = {
    "float32": "f32", "fp32": "f32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "f16", "fp16": "f16", "half": "f16",
}
_CAPABILITY = {"bf16": "BF16", "f16": "FP16"}


def new_core() -> Any:
    """An ``openvino.Core``, safe in a process whose malloc is replaced (jemalloc, as ``coalesce serve``
    and the images run: ``service/allocator.py``).

    oneTBB, which OpenVINO's CPU plugin runs on, loads its hwloc binding with ``RTLD_DEEPBIND``: hwloc then
    frees with glibc's ``free`` what glibc's functions allocated with the preloaded malloc, and the process
    aborts (``free(): invalid pointer``) as the Core starts (oneTBB issue 1636). ``TBB_ENABLE_SANITIZERS``
    makes oneTBB load it without ``RTLD_DEEPBIND``; oneTBB reads it when the Core starts its first arena,
    so it is set here (unless the caller set it), not at import. The one other environment write of the
    server, beside the allocator's own.
    """
    ov = _import_openvino()
    os.environ.setdefault("TBB_ENABLE_SANITIZERS", "1")
    return ov.Core()


def _import_openvino() -> Any:
    """``import openvino`` without its model conversion tools (``openvino.tools.ovc``: ``convert_model``
    and its telemetry set-up), which the package imports eagerly if it can and a server never calls: they
    were most of the import's time (an uncommitted timing, so no figure), paid before every first
    embedding. A ``None`` in ``sys.modules`` makes that optional import fail the way OpenVINO
    expects (it catches ImportError); the entry is removed again, so a later explicit import of the tools
    in this process still works."""
    if "openvino" in sys.modules:
        import openvino as ov

        return ov
    tools = "openvino.tools.ovc"
    blocked = tools not in sys.modules
    if blocked:
        sys.modules[tools] = None  # type: ignore[assignment]
    try:
        import openvino as ov
    finally:
        if blocked and sys.modules.get(tools, False) is None:
            del sys.modules[tools]
    return ov


class OpenVinoMissing(ModuleNotFoundError):
    """``--backend openvino`` where OpenVINO is not installed."""


def choose_precision(dtype: str, capabilities: Collection[str]) -> tuple[str, str]:
    """(OpenVINO inference precision, why) for ``--dtype`` on a CPU with these optimisation capabilities.

    ``auto``: bf16 where the CPU computes it natively (``BF16`` listed), f32 elsewhere. A forced half
    precision the CPU lacks runs f32: OpenVINO would emulate it slower than f32.
    """
    if dtype == "auto":
        if "BF16" in capabilities:
            return "bf16", "auto: this CPU has native bfloat16"
        return "f32", "auto: this CPU has no native bfloat16"
    if dtype not in _ASKED:
        raise ValueError(f"unknown dtype {dtype!r}")
    asked = _ASKED[dtype]
    if asked == "f32":
        return "f32", f"--dtype {dtype}"
    if _CAPABILITY[asked] not in capabilities:
        return "f32", f"--dtype {dtype}, which this CPU does not compute natively"
    return asked, f"--dtype {dtype}"


def cpu_capabilities(core: Any) -> frozenset[str]:
    """OpenVINO's ``OPTIMIZATION_CAPABILITIES`` of the CPU (``BF16``, ``FP16``, ``INT8`` ...)."""
    return frozenset(str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def default_cache_dir(root: Path, home: Path | None = None) -> Path | None:
    """Where compiled models go by default: ``openvino_cache`` in the export directory when this process
    may write there, else ``~/.cache/coalesce/openvino`` (OpenVINO names each blob by the graph and the
    compile options, so one folder serves many exports); None when neither is writable."""
    if os.access(root, os.W_OK):
        return root / CACHE_FOLDER
    home = Path.home() if home is None else home
    shared = home / ".cache" / "coalesce" / "openvino"
    try:
        shared.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return shared if os.access(shared, os.W_OK) else None


@dataclass(frozen=True, slots=True)
class GuardRecord:
    """Where the precision guard's measurement for one start's circumstances is kept: a small JSON file in
    the compiled-model cache folder, named by :func:`guard_key`. What is kept is the drift the guard
    measured, not its verdict, so a changed bound decides again without measuring again."""

    folder: Path
    key: str

    @property
    def path(self) -> Path:
        return self.folder / f"{GUARD_PREFIX}{self.key}.json"

    def read(self) -> float | None:
        """The drift measured at an earlier start with this key, or None (never measured, unreadable)."""
        try:
            drift = json.loads(self.path.read_text(encoding="utf-8"))["drift"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return float(drift) if isinstance(drift, (int, float)) and np.isfinite(drift) else None

    def write(self, drift: float, **facts: str) -> None:
        """Keep ``drift`` (and ``facts`` for a reader of the file); written whole or not at all."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False,
                                             encoding="utf-8") as f:
                json.dump({"drift": drift, **facts}, f)
            os.replace(f.name, self.path)
        except OSError as exc:  # a read-only cache: the guard measures again at the next start
            log.info("cannot keep the precision guard's measurement in %s: %s", self.folder, exc)


def guard_key(root: Path, task: Task, precision: str, openvino_version: str, cpu: str,
              capabilities: Collection[str]) -> str:
    """Names everything the guard's measurement depends on: the export (its graph files' and calibration
    rows' sizes and modification times, and its manifest: a re-export changes them), the rows the guard
    embeds (the calibration corpus's digest and :data:`GUARD_ROWS`), the task, the precision, OpenVINO's
    version and the CPU (its name and optimisation capabilities). Cheap: nothing is hashed but a few
    stats and the manifest, not the graph's hundreds of megabytes."""
    parts = [f"{task}", precision, openvino_version, cpu, ",".join(sorted(capabilities)),
             calibration.digest(), str(GUARD_ROWS)]
    for f in sorted([*root.glob(GRAPH_FILE + "*"), root / calibration.FILE]):
        try:
            st = f.stat()
        except OSError:
            parts.append(f"{f.name}:-")
            continue
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    try:
        parts.append((root / MANIFEST_FILE).read_text(encoding="utf-8"))
    except OSError:
        parts.append("-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


class OpenVinoRunner(OnnxRunner):
    """An exported embedding model on OpenVINO's CPU plugin. ``OpenVinoPairRunner`` adds text pairs."""

    def __init__(
        self,
        root: Path,
        manifest: ExportManifest,
        info: ModelInfo,
        *,
        threads: int,
        precision: str,
        cache_dir: Path | None,
        core: Any = None,
        guard: GuardRecord | None = None,
        kernel_cache: int = 0,
    ) -> None:
        self._core = new_core() if core is None else core
        self._kernel_cache = kernel_cache
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            self._core.set_property({"CACHE_DIR": str(cache_dir)})
        self.cache_dir = cache_dir
        self.precision = precision
        self.loaded_from_cache = False
        self._root = root
        self._guard_record = guard
        # The drift an earlier start measured in this precision (None: the guard measures at warm-up).
        self.guard_drift = guard.read() if guard is not None and precision != "f32" else None
        if self.guard_drift is not None and self.guard_drift > _limit(info.task)[0]:
            self._fall_back_message(self.guard_drift, info, "measured at an earlier start")
            self.precision = "f32"  # compile float32 straight away: the reduced precision would not serve
        super().__init__(root, manifest, info, threads=threads)
        self.info = replace(info, dtype=_DTYPE_NAMES[self.precision])

    def _compile(self, precision: str) -> Any:
        """The graph compiled for the CPU in ``precision``; read from the cache when it holds it."""
        config = {
            "INFERENCE_PRECISION_HINT": precision,
            "PERFORMANCE_HINT": "LATENCY",  # one stream: the worker runs one batch at a time
            "NUM_STREAMS": "1",
            "INFERENCE_NUM_THREADS": str(self._threads),
            # No run-time activation quantisation: it would make a row depend on its batch mates.
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
        }
        if self._kernel_cache > 0:
            # The CPU plugin keeps what it prepares per input shape (5,000 shapes by default): a server
            # under ever-changing batch shapes grew by most of a GiB in three minutes (BENCHMARKS.md,
            # memory). --cpu-kernel-cache bounds it.
            config["CPU_RUNTIME_CACHE_CAPACITY"] = str(self._kernel_cache)
        return self._core.compile_model(str(self._root / GRAPH_FILE), "CPU", config)

    def _open_graph(self, root: Path, threads: int) -> set[str]:
        self._threads = threads
        self._use(self._compile(self.precision))
        return {name for port in self._compiled.inputs for name in port.get_names()}

    def _use(self, compiled: Any) -> None:
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        self._output = compiled.output(self.manifest.output)
        try:
            self.loaded_from_cache = bool(compiled.get_property("LOADED_FROM_CACHE"))
        except RuntimeError:  # older OpenVINO releases do not say
            self.loaded_from_cache = False

    # -- model thread --------------------------------------------------------------------------------
    def forward(self, prepared: OnnxBatch) -> np.ndarray:
        # share_outputs=False: the result is a copy, not the request's buffer that the next batch overwrites
        result = self._request.infer(prepared.feed, share_inputs=True, share_outputs=False)
        out: np.ndarray = result[self._output]
        return out

    def warmup(self) -> None:
        """The precision guard (a reduced precision against float32 on the calibration corpus's first
        batch, float32 if it drifts; decided from the kept measurement where an earlier start made it),
        then one small batch as the ONNX runner does."""
        if self.precision != "f32":
            if self.guard_drift is None:
                self._guard()
            else:
                limit, what = _limit(self.info.task)
                log.info("model %s: %s on OpenVINO keeps %s %.6f (limit %g) against float32, measured at "
                         "an earlier start (%s)", self.info.name, _DTYPE_NAMES[self.precision], what,
                         _report(self.guard_drift, what), _report(limit, what),
                         self._guard_record.path if self._guard_record else "")
        super().warmup()

    def _fall_back_message(self, drift: float, info: ModelInfo, when: str) -> None:
        limit, what = _limit(info.task)
        log.warning("model %s: %s on OpenVINO drifts from float32 (%s %.6f, limit %g; %s): serving float32",
                    info.name, _DTYPE_NAMES[self.precision], what, _report(drift, what),
                    _report(limit, what), when)

    def _guard(self) -> None:
        batch = calibration.corpus_batches(self.tokens)[0][:GUARD_ROWS]
        prepared = self.prepare(batch)
        ours = self.finish(self.forward(prepared), prepared)
        stored = self.calibration if self.manifest.quantize == "none" else None
        f32 = None
        if stored is not None:
            reference = stored[: len(batch)]
        else:  # an int8 export (its stored rows are ONNX Runtime's int8) or scores: float32 right here
            f32 = self._compile("f32")
            out = f32.create_infer_request().infer(prepared.feed, share_outputs=False)
            reference = np.asarray(out[f32.output(self.manifest.output)][: len(batch)], dtype=np.float32)
        drift, limit, what = _drift(ours, reference, self.info.task)
        if self._guard_record is not None and np.isfinite(drift):
            self._guard_record.write(float(drift), what=what, precision=self.precision,
                                     model=self.info.name, measured=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                  time.gmtime()))
        if drift <= limit:
            log.info("model %s: %s on OpenVINO keeps %s %.6f (limit %g) against float32", self.info.name,
                     _DTYPE_NAMES[self.precision], what, _report(drift, what), _report(limit, what))
            return
        self._fall_back_message(drift, self.info, "measured now")
        self.precision = "f32"
        self._use(f32 if f32 is not None else self._compile("f32"))
        self.info = replace(self.info, dtype="float32")


class OpenVinoPairRunner(OpenVinoRunner, OnnxPairRunner):
    """An exported classifier or cross-encoder on OpenVINO: also scores text pairs (``PairRunner``)."""


def _drift(ours: np.ndarray, reference: np.ndarray, task: Task) -> tuple[float, float, str]:
    """How far ``ours`` is from float32 ``reference``, as a number that must stay at most its limit:
    1 - the smallest row cosine for embeddings, the largest relative logit error for scores."""
    limit, what = _limit(task)
    if task is Task.EMBED:
        return 1.0 - precision.min_cosine(ours, reference), limit, what
    error = float(np.abs(ours - reference).max()) / max(1.0, float(np.abs(reference).max()))
    return error, limit, what


def _limit(task: Task) -> tuple[float, str]:
    """The most drift :func:`_drift` may measure for ``task``, and what it measures."""
    if task is Task.EMBED:  # the torch runners' guard: one bound for a reduced precision on the CPU
        return 1.0 - precision.BF16_MIN_COSINE, "cosine"
    return MAX_LOGIT_ERROR, "logit error"


def _report(value: float, what: str) -> float:
    return 1.0 - value if what == "cosine" else value


def load_openvino_runner(
    path: str,
    *,
    name: str | None,
    task: str | None = None,
    aliases: Sequence[str] = (),
    dtype: str = "auto",
    cache_dir: str | None = None,
    environ: Mapping[str, str] | None = None,
    core: Any = None,
    kernel_cache: int = 0,
) -> OpenVinoRunner:
    """The OpenVINO runner for the export directory ``path``. ``dtype``: ``--dtype`` (see
    :func:`choose_precision`); ``cache_dir``: ``--openvino-cache-dir`` (None: :func:`default_cache_dir`);
    ``core``: an ``openvino.Core`` (tests pass one whose capabilities they chose); ``kernel_cache``:
    ``--cpu-kernel-cache``, the input shapes the CPU plugin keeps prepared (0: its default)."""
    t0 = time.perf_counter()
    root, manifest, info = read_export(path, name=name, task=task, aliases=aliases, backend="openvino")
    if core is None:
        try:
            core = new_core()
        except ImportError as exc:
            raise OpenVinoMissing(
                "--backend openvino needs OpenVINO: pip install 'coalesce[openvino]' (or serve with "
                "--backend onnx)"
            ) from exc
    capabilities = cpu_capabilities(core)
    precision, why = choose_precision(dtype, capabilities)
    cache = Path(cache_dir) if cache_dir else default_cache_dir(root)
    guard = None
    if cache is not None and precision != "f32":
        cpu = str(core.get_property("CPU", "FULL_DEVICE_NAME"))
        key = guard_key(root, info.task, precision, str(_import_openvino().get_version()), cpu, capabilities)
        guard = GuardRecord(cache, key)
    threads = intra_op_threads(os.environ if environ is None else environ)
    kind = OpenVinoRunner if info.task is Task.EMBED else OpenVinoPairRunner
    runner = kind(root, manifest, info, threads=threads, precision=precision, cache_dir=cache, core=core,
                  guard=guard, kernel_cache=kernel_cache)
    int8 = " over an int8 export" if manifest.quantize == "int8" else ""
    cached = "no compiled-model cache" if cache is None else (
        f"compiled model {'read from' if runner.loaded_from_cache else 'written to'} {cache}")
    log.info("model %s runs on OpenVINO (cpu, %s%s, %s; %d threads; %s), loaded in %.3f s", path,
             _DTYPE_NAMES[runner.precision], int8, why, threads, cached, time.perf_counter() - t0)
    return runner


def openvino_runner(export_dir: str | Path, precision: str = "float32", *, cache_dir: str | None = None,
                    ) -> OpenVinoRunner:
    """An OpenVINO runner of the export ``export_dir`` in ``precision`` (float32 or bfloat16), warmed
    up (so the bf16 guard has run), for benches and quality tables that compare backends."""
    runner = load_openvino_runner(str(export_dir), name=None, dtype=precision, cache_dir=cache_dir)
    runner.warmup()
    return runner
