"""The ``quality`` bench section: what each precision and backend keeps of float32 retrieval, beside its
throughput, in one table (CPU).

Corpus: the paragraphs of Python's own reference documentation (``pydoc_data.topics``, shipped with
every CPython: real prose, 1,258 paragraphs of at least 12 words), at most ``--quality-texts`` of them.
Each backend of :func:`backend_specs` serves the packaged all-MiniLM-L6-v2, every server up at once on
loopback; the corpus goes through ``/v2/embed`` as ``float``, ``int8``, ``uint8`` and
``ubinary``, and each paragraph's ten nearest neighbours by each representation (dot product; Hamming
distance for binary) are compared with its ten nearest by cosine on torch float32's ``float``:
recall@10, and the mean cosine of each row to its float32 row (one server at a time, the others idle).
Then the servers take turns at a closed loop of short requests from 32 clients, in interleaved rounds:
their throughput, the median round of each.

Rows whose backend this build does not have (OpenVINO, until ``--backend openvino`` exists) are listed
as not run, with the reason; :func:`backend_specs` is the one list to extend.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from coalesce.loadtests import servers
from coalesce.loadtests.bench_features import recall_at_k
from coalesce.loadtests.bench_sections import CLIENTS, ROUNDS, _met, _run, _spec, interleaved
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix

NEIGHBOURS = 10
CHUNK = 16  # paragraphs per /v2/embed request (long ones: a request stays well inside its deadline)
ATTEMPTS = 8  # per request, on 429/503 (a busy machine), after Retry-After
MIN_WORDS = 12  # shorter paragraphs are headings and code fragments
OUTPUTS = ("float", "int8", "uint8", "binary")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One row group of the table: a server configuration of the packaged model.

    ``export``: None serves the model directory; ``"fp32"``/``"int8"`` first export it with
    ``coalesce export`` (``--quantize int8`` for int8) and serve the export. ``missing()`` says why this
    build cannot run the row (None: it can)."""

    label: str
    flags: tuple[str, ...]
    export: str | None = None
    missing: Callable[[], str | None] = field(default=lambda: None)


def backend_supported(name: str) -> Callable[[], str | None]:
    """``missing`` for a row on ``--backend name``: None where this build's ``serve`` accepts it."""

    def missing() -> str | None:
        from coalesce.service.settings import build

        try:
            build(["--backend", name], environ={})
        except SystemExit:
            return f"`--backend {name}` is not in this build"
        return None

    return missing


PLAIN_FP32 = "torch float32 --no-cpu-fast-forward"
PLAIN_AUTO = "torch --dtype auto --no-cpu-fast-forward"


def backend_specs() -> list[BackendSpec]:
    """Every precision and backend the section measures, the float32 reference first."""
    return [
        BackendSpec("torch float32", ("--backend", "torch", "--dtype", "float32")),
        BackendSpec("torch bfloat16", ("--backend", "torch", "--dtype", "bfloat16")),
        BackendSpec("torch --dtype auto", ("--backend", "torch", "--dtype", "auto")),
        # The same two without the tuned CPU forward (kernels/cpu_forward.py): what it gains, same run.
        BackendSpec(PLAIN_FP32, ("--backend", "torch", "--dtype", "float32", "--no-cpu-fast-forward")),
        BackendSpec(PLAIN_AUTO, ("--backend", "torch", "--dtype", "auto", "--no-cpu-fast-forward")),
        BackendSpec("ONNX Runtime fp32 export", ("--backend", "onnx"), export="fp32"),
        BackendSpec("ONNX Runtime int8 export", ("--backend", "onnx"), export="int8"),
        BackendSpec("OpenVINO f32", ("--backend", "openvino", "--dtype", "float32"), export="fp32",
                    missing=backend_supported("openvino")),
        BackendSpec("OpenVINO bf16", ("--backend", "openvino", "--dtype", "bfloat16"), export="fp32",
                    missing=backend_supported("openvino")),
    ]


def corpus(limit: int | None = None) -> list[str]:
    """Paragraphs of Python's reference documentation (``pydoc_data.topics``), whitespace folded,
    those of at least :data:`MIN_WORDS` words, in a fixed order; the first ``limit`` of them."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(block.split())
            if len(text.split()) >= MIN_WORDS:
                paragraphs.append(text)
    unique = list(dict.fromkeys(paragraphs))
    return unique[:limit] if limit else unique


@dataclass(frozen=True, slots=True)
class Vectors:
    """One server's vectors of the corpus, by output type (float64 for the arithmetic)."""

    float_: np.ndarray
    int8: np.ndarray
    uint8: np.ndarray
    ubinary: np.ndarray

    def rows(self, output: str) -> np.ndarray:
        """The vectors an index of ``output`` compares: raw values; binary as ±1 per bit."""
        if output == "binary":
            bits = np.unpackbits(self.ubinary.astype(np.uint8), axis=1).astype(np.float64)
            return 2 * bits - 1  # dot product of ±1 vectors = dimensions − 2 × Hamming distance
        return {"float": self.float_, "int8": self.int8, "uint8": self.uint8}[output]


def embed(base_url: str, texts: Sequence[str]) -> Vectors:
    """``texts`` through ``/v2/embed`` as float, int8, uint8 and ubinary, :data:`CHUNK` at a time."""
    parts: dict[str, list[list[float]]] = {"float": [], "int8": [], "uint8": [], "ubinary": []}
    for start in range(0, len(texts), CHUNK):
        body = json.dumps({"texts": list(texts[start : start + CHUNK]), "input_type": "search_document",
                           "embedding_types": list(parts)}).encode()
        got = _post(base_url + "/v2/embed", body)["embeddings"]
        for kind in parts:
            parts[kind].extend(got[kind])
    a = {kind: np.asarray(rows, dtype=np.float64) for kind, rows in parts.items()}
    return Vectors(a["float"], a["int8"], a["uint8"], a["ubinary"])


def _post(url: str, body: bytes) -> dict[str, Any]:
    """POST ``body``; a 429 or 503 is retried after its Retry-After, at most :data:`ATTEMPTS` times."""
    for attempt in range(ATTEMPTS):
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                got: dict[str, Any] = json.load(resp)
                return got
        except urllib.error.HTTPError as e:
            if e.code not in (429, 503) or attempt == ATTEMPTS - 1:
                raise
            time.sleep(float(e.headers.get("Retry-After") or 1))
    raise AssertionError("unreachable")


def mean_cosine(rows: np.ndarray, reference: np.ndarray) -> float:
    norms = np.linalg.norm(rows, axis=1) * np.linalg.norm(reference, axis=1)
    return float(np.mean((rows * reference).sum(1) / np.where(norms > 0, norms, 1.0)))


def compare(vectors: Vectors, reference: np.ndarray) -> dict[str, tuple[float, float]]:
    """Per output type: (recall@10 against ``reference``'s cosine neighbours, mean cosine to it)."""
    truth = reference @ reference.T
    result = {}
    for output in OUTPUTS:
        rows = vectors.rows(output)
        result[output] = (recall_at_k(truth, rows @ rows.T, NEIGHBOURS), mean_cosine(rows, reference))
    return result


def _bytes(output: str, dim: int) -> int:
    return {"float": 4 * dim, "int8": dim, "uint8": dim, "binary": dim // 8}[output]


def quality(args: argparse.Namespace) -> tuple[str, str]:
    from coalesce.loadtests.bench_onnx import _export

    out = args.out / "quality"
    texts = corpus(getattr(args, "quality_texts", None))
    # The raw client (``--client raw``): the load generator shares the server's two cores, and aiohttp's
    # client took CPU the faster precisions need most, so their ratios measured the generator too.
    # Every server stays up for the whole section and the throughput runs interleave: ROUNDS rounds, each
    # giving every server a turn (the order reversed every other round), the median per server. On a
    # shared VM the same configuration measured once ran up to a fifth apart from run to run, and one
    # server after another put that drift between the rows being compared.
    closed = Scenario(
        mode=Mode.CLOSED, concurrency=CLIENTS, duration=max(args.duration / ROUNDS, 3.0), warmup=2.0,
        mix=Mix.SHORT, client="raw",
    )
    exports: dict[str, Path] = {}
    measured: dict[str, tuple[dict[str, tuple[float, float]], float, str]] = {}
    skipped: dict[str, str] = {}
    reference: np.ndarray | None = None
    kept: dict[str, tuple[dict[str, tuple[float, float]], str]] = {}
    with contextlib.ExitStack() as stack:
        running: dict[str, tuple[str, servers.RunningServer]] = {}
        for spec in backend_specs():
            reason = spec.missing()
            if reason is not None:
                skipped[spec.label] = reason
                continue
            flags = list(spec.flags)
            if spec.export is not None:
                if spec.export not in exports:
                    exports[spec.export] = out / f"minilm-{spec.export}"
                    _export(exports[spec.export], spec.export)
                flags += ["--model", str(exports[spec.export])]
            name = re.sub(r"[^A-Za-z0-9]+", "-", spec.label).strip("-").lower()
            srv = stack.enter_context(servers.running(
                _spec(args, name, [*flags, "--log-level", "warning"]), out / "logs", args.ready_timeout))
            running[spec.label] = (name, srv)
        for label, (_, srv) in running.items():  # one at a time: the others sit idle
            vectors = embed(srv.base_url, texts)
            np.testing.assert_array_equal(vectors.uint8 - 128, vectors.int8)  # the README's promise
            if reference is None:
                reference = vectors.float_
            kept[label] = (compare(vectors, reference), str(_info(srv.base_url).get("model_dtype", "?")))
        def rate(label: str, r: int) -> float:
            name, srv = running[label]
            return float(_run(srv.url, closed, f"{name} c{CLIENTS} round{r + 1}", out).achieved_rps)

        rates = interleaved(list(running), rate)
    for label, (score, dtype) in kept.items():
        measured[label] = (score, statistics.median(rates[label]), dtype)
    if reference is None:
        raise RuntimeError("no backend of the quality section could run")
    dim = reference.shape[1]
    base_rps = next(iter(measured.values()))[1]
    rows = []
    for label, (scores, rps, dtype) in measured.items():
        for i, output in enumerate(OUTPUTS):
            recall, cosine = scores[output]
            rows.append([
                label if i == 0 else "", dtype if i == 0 else "", output, str(_bytes(output, dim)),
                f"{recall:.3f}", f"{cosine:.4f}",
                fmt(rps) if i == 0 else "", f"{rps / base_rps:.2f}×" if i == 0 and base_rps else "",
            ])
    for label, reason in skipped.items():
        rows.append([label, "-", "-", "-", "-", "-", "not run", reason])
    body = (
        f"The packaged all-MiniLM-L6-v2 on {len(texts)} paragraphs of Python's reference documentation "
        "(`pydoc_data.topics`, shipped with CPython), each backend on a server of its own. Recall@"
        f"{NEIGHBOURS}: each paragraph's {NEIGHBOURS} nearest by the row's vectors (dot product; binary: "
        f"Hamming distance) against its {NEIGHBOURS} nearest by cosine on torch float32's `float`; mean "
        "cosine: each vector against its float32 one. uint8 is compared raw (as a store that forgets to "
        "subtract 128 would); uint8 − 128 equals int8 exactly (checked). Throughput: short "
        f"single-sentence requests, closed loop, {CLIENTS} clients (the raw client, `coalesce loadtest "
        f"--client raw`): every server up at once, {ROUNDS} interleaved rounds of {closed.duration:.3g} s "
        "after 2 s warm-up each (the order reversed every other round), the median round per row; the "
        "last column divides by the first row's.\n\n"
        + markdown_table(["backend", "model_dtype", "output", "bytes", f"recall@{NEIGHBOURS}",
                          "mean cosine", f"req/s ({CLIENTS} clients)", "÷ torch float32"], rows)
        + "\n\n" + markdown_table(["figure", "target", "measured", ""], _figures(measured)) + "\n"
    )
    return "Retrieval quality of every precision and backend, beside its throughput (CPU)", body


def _figures(measured: dict[str, tuple[dict[str, tuple[float, float]], float, str]]) -> list[list[str]]:
    figures = []
    fp32, auto, int8_export = (measured.get(k) for k in (
        "torch float32", "torch --dtype auto", "ONNX Runtime int8 export"))
    if fp32 and auto:
        ratio, recall = auto[1] / fp32[1] if fp32[1] else 0.0, auto[0]["float"][0]
        figures.append([f"`--dtype auto` ({auto[2]}) throughput ÷ float32, {CLIENTS} clients", "≥ 2×",
                        f"{ratio:.2f}×", _met(ratio >= 2)])
        figures.append(["`--dtype auto` float recall@10", "≥ 0.99", f"{recall:.3f}", _met(recall >= 0.99)])
    for tuned, plain, label in ((fp32, measured.get(PLAIN_FP32), "float32"),
                                (auto, measured.get(PLAIN_AUTO), "`--dtype auto`")):
        if tuned and plain and plain[1]:
            figures.append([f"{label}: tuned CPU forward ÷ `--no-cpu-fast-forward`, {CLIENTS} clients",
                            "(no target)", f"{tuned[1] / plain[1]:.2f}×", ""])
    plain_fp32, plain_auto = measured.get(PLAIN_FP32), measured.get(PLAIN_AUTO)
    if plain_fp32 and plain_auto and plain_fp32[1]:
        figures.append([f"`--dtype auto` ÷ float32, both `--no-cpu-fast-forward`, {CLIENTS} clients",
                        "(no target)", f"{plain_auto[1] / plain_fp32[1]:.2f}×", ""])
    if fp32:
        recall = fp32[0]["int8"][0]
        figures.append(["int8 output recall@10 (torch float32)", "≥ 0.98", f"{recall:.3f}",
                        _met(recall >= 0.98)])
    if int8_export:
        recall = int8_export[0]["float"][0]
        figures.append(["int8 export float recall@10", "≥ 0.97", f"{recall:.3f}", _met(recall >= 0.97)])
    return figures


def _info(base_url: str) -> dict[str, object]:
    with urllib.request.urlopen(base_url + "/info", timeout=30) as resp:
        info: dict[str, object] = json.load(resp)
    return info
