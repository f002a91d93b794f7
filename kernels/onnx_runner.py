"""The ONNX Runtime runner: a directory written by ``coalesce export``, served with ``onnxruntime`` and
``tokenizers`` alone, so a CPU process never imports torch or transformers (about 2 s of cold start
on 2 cores) and runs a forward that is faster than torch's at small batches.

The export directory holds ``model.onnx`` (pooling and normalisation inside the graph for embedding
models; logits for classifiers and cross-encoders), ``tokenizer.json`` (the tokenizer the torch
runner tokenises with, sentence-transformers' ``do_lower_case`` already applied) and
``coalesce_export.json``, the manifest: every fact the runner needs (task, max tokens, width, labels,
activation, graph inputs), measured on the torch model at export time so both backends describe a
model alike. The runner keeps the torch runners' protocol, cost model and padding: each batch is
right-padded to its longest sequence.

Also here, torch-free and cheap: how ``--backend auto`` decides (:func:`resolve_backend`) and how
many threads the forward gets (:func:`intra_op_threads`, cgroup-aware).
Construction loads the graph; only the model thread may call ``forward``/``finish``/``warmup``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .calibration import CORPUS, digest
from .calibration import FILE as CALIBRATION_FILE
from .protocol import ModelInfo, PairIds, Task, marks
from .st_config import prompt_fields
from .tokens import TokenizerAdapter, pad_batch

log = logging.getLogger("coalesce.kernels")

GRAPH_FILE = "model.onnx"
MANIFEST_FILE = "coalesce_export.json"
MANIFEST_VERSION = 1
BACKENDS = ("auto", "torch", "onnx", "openvino")


class MissingGraph(FileNotFoundError):
    """``--backend onnx`` on a directory ``coalesce export`` did not write."""


@dataclass(frozen=True, slots=True)
class ExportManifest:
    """``coalesce_export.json``: what ``coalesce export`` measured on the torch model, for serving."""

    name: str  # default served name
    task: str  # embed, classify or rerank
    max_tokens: int
    vocab_size: int  # ids the graph's embedding table accepts
    dim: int  # embedding width, or number of logits
    pad_id: int
    inputs: tuple[str, ...]  # graph inputs, among input_ids, attention_mask, token_type_ids
    output: str  # the graph output the runner reads
    normalized: bool = False
    labels: tuple[str, ...] = ()
    activations: dict[str, str] = field(default_factory=dict)  # classify/rerank: task → activation
    aliases: tuple[str, ...] = ()
    quantize: str = "none"  # or int8
    quantization: dict[str, str] = field(default_factory=dict)  # int8: how (static QDQ, what, calibrated on)
    pooling: str = "graph"  # where pooling and normalisation run: inside the ONNX graph
    source: str = ""  # the model directory or name it was exported from
    versions: dict[str, str] = field(default_factory=dict)  # torch, transformers, onnx ... that made it
    checks: dict[str, float] = field(default_factory=dict)  # export-time cosines against torch
    calibration: str = ""  # embed: the corpus digest calibration.npy was computed on ("" for none)
    # embed: int8/uint8 output's step from those rows (x ≈ int8 × scale; calibration.int8_scale), for
    # clients that quantise elsewhere what the server quantises; the server derives the same from them
    int8_scale: float = 0.0
    version: int = MANIFEST_VERSION

    def write(self, directory: Path) -> None:
        (directory / MANIFEST_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, directory: Path) -> ExportManifest:
        raw = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
        if raw.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"{directory}: export format {raw.get('version')!r}, this server reads {MANIFEST_VERSION}; "
                "run `coalesce export` again"
            )
        known = set(cls.__dataclass_fields__)
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known
        }
        return cls(**values)


# -- backend choice ------------------------------------------------------------------------------------
def has_exported_graph(path: str | Path) -> bool:
    """Whether ``coalesce export`` wrote its graph and manifest into ``path``."""
    root = Path(path)
    return (root / GRAPH_FILE).is_file() and (root / MANIFEST_FILE).is_file()


def has_torch_weights(path: str | Path) -> bool:
    """Whether ``path`` (or a sentence-transformers module folder in it) holds torch weights."""
    root = Path(path)
    patterns = ("*.safetensors", "pytorch_model*.bin")
    return any(any(d.glob(p)) for d in (root, *(s for s in root.iterdir() if s.is_dir())) for p in patterns)


def cuda_visible(dev: Path = Path("/dev"), proc: Path = Path("/proc"),
                 environ: Mapping[str, str] | None = None, torch_dir: Path | None = None) -> bool:
    """Whether torch could run on a CUDA device here, told without importing torch: a CUDA build of
    torch installed (its ``version.py`` names a CUDA version; ``torch_dir``: its package folder, found
    when not given), an NVIDIA driver present (``/dev/nvidia*`` device nodes or ``/proc/driver/nvidia``),
    and ``CUDA_VISIBLE_DEVICES`` not hiding every device (``""`` or ``-1``): in each of those cases torch
    runs on the CPU."""
    env = os.environ if environ is None else environ
    if env.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    if not ((proc / "driver" / "nvidia").exists() or any(dev.glob("nvidia[0-9]*"))):
        return False
    if torch_dir is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return False
        torch_dir = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = (torch_dir / "version.py").read_text()
    except OSError:
        return False
    # ``cuda: Optional[str] = '13.0'`` in a CUDA build, ``= None`` in a CPU build (``cuda = '11.7'`` of old)
    found = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(\S+)", version, flags=re.M)
    return found is not None and found.group(1) != "None"


def openvino_installed() -> bool:
    """Whether OpenVINO can be imported here (the ``openvino`` extra), told without importing it."""
    return importlib.util.find_spec("openvino") is not None


def resolve_backend(requested: str, path: str, device: str) -> str:
    """``torch``, ``onnx`` or ``openvino`` for the model directory ``path``.

    ``auto`` serves an exported graph torch-free when the forward runs on the CPU (``--device cpu``, or
    ``auto`` with no CUDA device visible, see :func:`cuda_visible`), or when the directory holds nothing
    torch could load; torch otherwise (GPUs keep torch and CUDA graphs). Torch-free means the fastest
    runtime installed: OpenVINO when it is (its CPU plugin ran the same graph 1.1-1.4x faster than ONNX
    Runtime in float32, and more in bfloat16 on CPUs that have it), ONNX Runtime otherwise.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; expected one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested
    if not has_exported_graph(path):
        return "torch"
    on_cpu = device == "cpu" or (device == "auto" and not cuda_visible())
    if on_cpu or not has_torch_weights(path):
        return "openvino" if openvino_installed() else "onnx"
    return "torch"


# -- threads -------------------------------------------------------------------------------------------
def cpu_allowance(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Whole CPUs this process may use: its affinity mask, capped by a CFS quota (cgroup v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) on its cgroup or any ancestor.

    A fractional quota rounds down (at least 1): a thread more than the quota pays for gets the whole
    process throttled for the rest of each period.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(proc, cgroup)
    return max(1, min(cpus, math.floor(quota))) if quota is not None else max(1, cpus)


def intra_op_threads(environ: Mapping[str, str]) -> int:
    """Threads for one forward: ``OMP_NUM_THREADS`` when it names a positive number (the variable torch
    honours, so one setting sizes either backend), else :func:`cpu_allowance`."""
    raw = environ.get("OMP_NUM_THREADS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return cpu_allowance()


def _cgroup_quota(proc: Path, cgroup: Path) -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroups and their ancestors, or None."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    quotas: list[float] = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            quotas += [q for d in _ancestors(cgroup, rel) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            for mount in (cgroup / controllers, cgroup / "cpu", cgroup / "cpu,cpuacct"):
                quotas += [q for d in _ancestors(mount, rel) if (q := _v1_quota(d)) is not None]
    if not lines:  # no /proc: read the mount's root alone
        quotas += [q for q in (_v2_quota(cgroup), _v1_quota(cgroup / "cpu")) if q is not None]
    return min(quotas) if quotas else None


def _ancestors(mount: Path, rel: str) -> list[Path]:
    """``mount/rel`` and every folder above it up to ``mount`` (a container sees its own as ``/``)."""
    parts = [p for p in rel.strip("/").split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


# -- the runner ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class OnnxBatch:
    """A padded batch on the host: the graph's input arrays (int64), and how many rows are real."""

    feed: dict[str, np.ndarray]
    rows: int


def segment_ids(batch: Sequence[Sequence[int]], shape: tuple[int, ...]) -> np.ndarray:
    """int64 token type ids of a padded batch: 1 over segment B of each ``PairIds``, 0 elsewhere."""
    segments = np.zeros(shape, dtype=np.int64)
    for row, seq in enumerate(batch):
        b_start = marks(seq)[0]
        if b_start >= 0:
            segments[row, b_start : len(seq)] = 1
    return segments


class OnnxRunner:
    """An exported embedding model on ONNX Runtime (CPU). ``OnnxPairRunner`` adds text pairs."""

    device = "cpu"
    capture_stats = None  # CUDA-graph statistics: none here
    # Its forward runs on its runtime's own thread pool (as OpenVINO's does): torch's thread count, which
    # the engine sets for a torch CPU forward (LoopShare, engine/threads.py), means nothing to it.
    own_threads = True

    def __init__(
        self,
        root: Path,
        manifest: ExportManifest,
        info: ModelInfo,
        *,
        threads: int,
    ) -> None:
        from tokenizers import Tokenizer

        self.info = info
        self.manifest = manifest
        tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        self.tokens = TokenizerAdapter.from_tokenizer(
            tok, manifest.max_tokens, pad_id=manifest.pad_id, vocab_size=manifest.vocab_size
        )
        declared = self._open_graph(root, threads)
        if declared != set(manifest.inputs):
            raise ValueError(f"{root}: the graph takes {sorted(declared)}; the manifest, {manifest.inputs}")
        self._segments = "token_type_ids" in declared
        self._mask = "attention_mask" in declared
        self.calibration = _stored_calibration(root, manifest) if info.task is Task.EMBED else None

    def _open_graph(self, root: Path, threads: int) -> set[str]:
        """Load the graph for ``forward``; the names of the inputs it takes."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle pool threads sleep rather than spin (ONNX Runtime's default spins after each run): on a small
        # CPU allowance the tokenizer thread and the event loop need the cores between forwards, and a
        # spinning pool would bill a quota-limited container for CPU it does not use.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # errors only: ORT's warnings would go to stderr unstructured
        # No arena: every batch has a shape of its own, and ORT's CPU arena grows to hold the largest
        # batch seen (and the memory pattern planned for each new shape), rounded up to a power of two,
        # and never shrinks. Over 300 distinct shapes it took this process from 167 to 559 MiB (400
        # with memory patterns off); without it, 167 to 178 MiB, tensors coming from malloc, which on
        # jemalloc hands unused pages back (service/allocator.py). The cost measured on a busy 2-core
        # machine: none at batches of 1-4, about 5% at 16-64.
        options.enable_cpu_mem_arena = False
        self._session = ort.InferenceSession(
            str(root / GRAPH_FILE), options, providers=["CPUExecutionProvider"]
        )
        return {i.name for i in self._session.get_inputs()}

    # -- CPU side ------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokens.tokenize(texts)

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        return self.tokens.with_special_tokens(ids)

    def padded_cost(self, n: int, max_len: int) -> int:
        return n * max_len

    def prepare(self, batch: Sequence[Sequence[int]]) -> OnnxBatch:
        """Right-pad to the batch's longest sequence; segment B of ``PairIds`` gets token type 1."""
        length = max(len(s) for s in batch)
        ids, mask = pad_batch(batch, length, self.tokens.pad_id)
        feed = {"input_ids": ids}
        if self._mask:
            feed["attention_mask"] = mask
        if self._segments:
            feed["token_type_ids"] = segment_ids(batch, ids.shape)
        return OnnxBatch(feed, len(batch))

    # -- model thread --------------------------------------------------------------------------------
    def forward(self, prepared: OnnxBatch) -> np.ndarray:
        out: np.ndarray = self._session.run([self.manifest.output], prepared.feed)[0]
        return out

    def finish(self, output: np.ndarray, prepared: OnnxBatch) -> np.ndarray:
        """float32 (rows, dim) for the real rows."""
        rows = np.ascontiguousarray(output[: prepared.rows], dtype=np.float32)
        if rows.shape != (prepared.rows, self.info.dim):
            raise AssertionError(f"graph produced {rows.shape}, expected ({prepared.rows}, {self.info.dim})")
        return rows

    def warmup(self) -> None:
        """One small batch: ONNX Runtime has no per-shape first-run cost worth a second one here (measured),
        and the cost model's seeding that follows runs a larger batch anyway."""
        seq = self.with_special_tokens([min(1000, self.info.vocab_size - 1)] * min(16, self.info.max_tokens))
        prepared = self.prepare([seq])
        self.finish(self.forward(prepared), prepared)


class OnnxPairRunner(OnnxRunner):
    """An exported classifier or cross-encoder: also scores text pairs (``PairRunner``)."""

    def pair_with_special_tokens(self, a: Sequence[int], b: Sequence[int]) -> PairIds:
        ids, b_start = self.tokens.pair_with_special_tokens(a, b)
        return PairIds(ids, b_start)


def _stored_calibration(root: Path, manifest: ExportManifest) -> np.ndarray | None:
    """The calibration rows the export stored, if they were made from today's corpus by this graph;
    None (the engine embeds the corpus at warm-up) for older exports and a changed corpus."""
    path = root / CALIBRATION_FILE
    if not manifest.calibration or not path.is_file():
        return None
    if manifest.calibration != digest():
        log.info("%s: its calibration rows predate this server's corpus; they are computed at warm-up", root)
        return None
    rows = np.load(path, allow_pickle=False)
    if rows.shape != (len(CORPUS), manifest.dim) or rows.dtype != np.float32:
        raise ValueError(f"{path}: {rows.shape} {rows.dtype}, expected ({len(CORPUS)}, "
                         f"{manifest.dim}) float32; run `coalesce export` again")
    return rows


def read_export(
    path: str, *, name: str | None, task: str | None, aliases: Sequence[str], backend: str = "onnx"
) -> tuple[Path, ExportManifest, ModelInfo]:
    """The export directory ``path``: its root, manifest and the served model's facts, for whichever
    torch-free runtime serves it. ``task`` (``--task``) may switch a classifier export between classify
    and rerank. Raises :class:`MissingGraph` for a directory with no export."""
    root = Path(path)
    if not has_exported_graph(root):
        raise MissingGraph(
            f"model {path!r} has no ONNX graph ({GRAPH_FILE} and {MANIFEST_FILE}), which --backend {backend} "
            f"serves: run `coalesce export --model {path} --out DIR` and serve DIR"
        )
    manifest = ExportManifest.read(root)
    exported = Task(manifest.task)
    chosen = Task(task) if task else exported
    if chosen is not exported and Task.EMBED in (chosen, exported):
        raise ValueError(
            f"model {path!r} was exported for {exported}, not {chosen}: export it again with --task {chosen}"
        )
    if chosen is Task.RERANK and manifest.dim != 1:
        raise ValueError(
            f"{path}: reranking needs one relevance score per pair, but the model has {manifest.dim} labels; "
            "serve it with --task NAME=classify"
        )
    info = ModelInfo(
        name=name or manifest.name,
        task=chosen,
        max_tokens=manifest.max_tokens,
        vocab_size=manifest.vocab_size,
        dim=manifest.dim,
        labels=manifest.labels,
        normalized=manifest.normalized,
        aliases=tuple(aliases) or manifest.aliases,
        activation=manifest.activations.get(str(chosen), "none"),
        **(prompt_fields(root) if chosen is Task.EMBED else {}),
    )
    return root, manifest, info


def load_onnx_runner(
    path: str,
    *,
    name: str | None,
    task: str | None = None,
    aliases: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> OnnxRunner:
    """The ONNX Runtime runner for the export directory ``path`` (see :func:`read_export`)."""
    t0 = time.perf_counter()
    root, manifest, info = read_export(path, name=name, task=task, aliases=aliases)
    threads = intra_op_threads(os.environ if environ is None else environ)
    kind = OnnxRunner if info.task is Task.EMBED else OnnxPairRunner
    runner = kind(root, manifest, info, threads=threads)
    log.info("model %s runs on ONNX Runtime (cpu, %s, %d threads), loaded in %.3f s", path,
             "int8" if manifest.quantize == "int8" else "float32", threads, time.perf_counter() - t0)
    return runner


def onnx_runner_for(
    path: str,
    *,
    name: str | None,
    task: str | None,
    aliases: Sequence[str],
    backend: str,
    device: str,
    dtype: str = "auto",
    openvino_cache_dir: str | None = None,
    kernel_cache: int = 0,
) -> OnnxRunner | None:
    """The torch-free runner when ``backend`` (``--backend``) resolves to onnx or openvino for ``path``;
    None when torch serves it. Says plainly when torch cannot: an export holds no torch weights, and an
    ONNX-only install (the torch-free image) has no torch to load a model directory with."""
    chosen = resolve_backend(backend, path, device)
    if chosen == "onnx":
        return load_onnx_runner(path, name=name, task=task, aliases=aliases)
    if chosen == "openvino":
        from .openvino_runner import load_openvino_runner

        return load_openvino_runner(path, name=name, task=task, aliases=aliases, dtype=dtype,
                                    cache_dir=openvino_cache_dir, kernel_cache=kernel_cache)
    if has_exported_graph(path) and not has_torch_weights(path):
        raise ValueError(
            f"model {path!r} is an ONNX export with no torch weights: serve it with --backend onnx "
            "or openvino (or auto) on the CPU"
        )
    if importlib.util.find_spec("torch") is None:
        raise ModuleNotFoundError(
            f"model {path!r} has no ONNX graph and torch is not installed here: run "
            f"`coalesce export --model {path} --out DIR` where torch is, and serve DIR"
        )
    return None
