"""``coalesce export``: a model directory → a self-contained ONNX directory that ``--backend onnx`` serves.

    coalesce export --model PATH_OR_NAME --out DIR [--quantize int8] [--task embed|classify|rerank]

The graph comes from torch's own exporter (``torch.onnx.export``, the ``torch.export``-based path):
the maintained exporter that ships with the torch already installed. ``optimum-onnx`` would have
been the library of choice, but its current release requires transformers < 4.58 and would downgrade
the transformers 5 this project runs on.

What is exported is what the torch backend serves, measured on it (``export_sources``): for
embedding models the whole sentence-transformers pipeline, so pooling and normalisation run inside
the graph (``sentence_embedding`` out; measured no slower than pooling in numpy, see the ``onnx``
bench section); for classifiers and cross-encoders the sequence classifier, logits out, with
``token_type_ids`` when the model uses segments.

``tokenizer.json`` is the tokenizer the torch runner tokenises with (its normalisation settings
and sentence-transformers' ``do_lower_case`` applied), so the serving side reads one file and cannot
drift; the source's tokenizer and sentence-transformers configuration files are copied beside it
(``config_sentence_transformers.json`` whole, prompts included). Before anything is written to
``--out``, the export is served from a staging folder by the real ONNX runner and compared with the
torch model on mixed-length, padded and truncated inputs; a graph that does not reproduce it is an
error. ``--quantize int8`` quantises statically (ONNX Runtime's ``quantize_static``, QDQ, calibrated on
the built-in calibration corpus; :func:`_quantize`), so a text's vector does not depend on its batch,
records how in the manifest's ``quantization`` and reports its cosine to the float model. Export imports
torch; serving the result does not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from . import calibration
from .export_sources import (
    PROBE_PAIRS,
    PROBE_TEXTS,
    ExportSource,
    classifier_source,
    embedding_source,
    st_modules,
)
from .onnx_runner import GRAPH_FILE, ExportManifest, load_onnx_runner, segment_ids
from .protocol import PairIds, Task

log = logging.getLogger("coalesce.kernels")

# Files copied from the source next to the graph (when present): tokenizer side and model facts.
_TOKENIZER_FILES = (
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json",
    "merges.txt", "sentencepiece.bpe.model", "spiece.model",
)
_ST_FILES = ("modules.json", "config_sentence_transformers.json")
# fp32 must reproduce torch; int8 must stay recognisably the same model (it reports its cosine).
FP32_MIN_COSINE = 0.9999
INT8_MIN_COSINE = 0.9
LOGITS_TOLERANCE = 1e-3  # classifiers: fp32 logits within this fraction of the largest logit
class ExportError(Exception):
    """The model cannot be exported; the message names it and says why (no traceback for users)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="coalesce export",
        description="Write a model as a self-contained ONNX directory that `coalesce serve --backend onnx` "
        "serves without torch (see coalesce.kernels.export).",
    )
    parser.add_argument("--model", required=True,
                        help="model directory, 'default' (the packaged all-MiniLM-L6-v2) or a hub name")
    parser.add_argument("--out", required=True, type=Path, help="directory to write (created if missing)")
    parser.add_argument("--quantize", choices=("none", "int8"), default="none",
                        help="int8: static int8 (weights per channel, activation scales calibrated on "
                        "a built-in corpus, so a vector does not depend on its batch); faster at large "
                        "batches, cosine to float ~0.998")
    parser.add_argument("--task", choices=("embed", "classify", "rerank"), default=None,
                        help="what the model does (default: detected from the directory, as serve does)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let a sentence-transformers model run its own module code (code you trust)")
    parser.add_argument("--verbose", action="store_true", help="show the exporter's own output and traceback")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    t0 = time.perf_counter()
    try:
        manifest = export_model(args.model, args.out, quantize=args.quantize, task=args.task,
                                trust_remote_code=args.trust_remote_code, verbose=args.verbose)
    except ExportError as exc:
        if args.verbose:
            raise
        print(f"coalesce export: {exc}", file=sys.stderr)
        return 1
    precision = "int8" if manifest.quantize == "int8" else "fp32"
    print(f"exported {manifest.name} ({manifest.task}, {precision}) to {args.out} in "
          f"{time.perf_counter() - t0:.1f} s; against torch: {_describe(manifest.checks)}")
    print(f"serve it with: coalesce serve --backend onnx --model {args.out}")
    return 0


def export_model(
    model: str,
    out: Path,
    *,
    quantize: str = "none",
    task: str | None = None,
    trust_remote_code: bool = False,
    verbose: bool = False,
) -> ExportManifest:
    """Export ``model`` into ``out``; returns the manifest written. Raises :class:`ExportError`."""
    path, name, aliases = _resolve(model)
    out = Path(out)
    if out.resolve() == Path(path).resolve():
        raise ExportError(f"model {model!r}: --out is the model's own directory; export it elsewhere")
    from .hf_runners import detect_task
    from .st_config import read_prompt_config

    chosen = Task(task) if task else detect_task(path)
    if chosen is Task.SPARSE:
        raise ExportError(f"model {model!r}: a sparse (SPLADE) model; ONNX export covers embedding, "
                          "classification and reranking models: serve it with --backend torch")
    if chosen is Task.EMBED and not read_prompt_config(path).include_prompt:
        raise ExportError(f"model {model!r}: its pooling leaves the prompt out (include_prompt: false), "
                          "which the exported graph cannot do per input; serve it with --backend torch")
    with _quiet(verbose):
        try:
            if chosen is Task.EMBED:
                source = embedding_source(path, name, aliases, trust_remote_code)
            else:
                source = classifier_source(path, name, aliases, chosen)
        except ExportError:
            raise
        except Exception as exc:
            raise ExportError(f"model {model!r}: cannot load it with torch: {_reason(exc)}") from exc
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".coalesce-export-", dir=out.parent) as tmp:
            staging = Path(tmp)
            try:
                _export_graph(source, staging / GRAPH_FILE)
            except Exception as exc:
                reason = _reason(exc)
                raise ExportError(f"model {model!r}: the ONNX exporter cannot handle it: {reason}") from exc
            _write_support_files(source, path, staging)
            source.manifest.write(staging)
            checks = {"fp32_" + k: v for k, v in _check(source, staging, model).items()}
            if checks.get("fp32_cosine_min", 1.0) < FP32_MIN_COSINE or checks.get("fp32_logit_error", 0.0) > (
                LOGITS_TOLERANCE
            ):
                raise ExportError(f"model {model!r}: the exported graph does not reproduce the torch model "
                                  f"({_describe(checks)})")
            quantization: dict[str, str] = {}
            if quantize == "int8":
                feeds = _calibration_feeds(staging)
                fp32 = staging / "model.fp32.onnx"
                (staging / GRAPH_FILE).rename(fp32)
                try:
                    quantization = _quantize(fp32, staging / GRAPH_FILE, feeds)
                except Exception as exc:
                    raise ExportError(f"model {model!r}: int8 quantisation failed: {_reason(exc)}") from exc
                fp32.unlink()
                checks.update({"int8_" + k: v for k, v in _check(source, staging, model).items()})
                if checks.get("int8_cosine_min", 1.0) < INT8_MIN_COSINE:
                    raise ExportError(
                        f"model {model!r}: int8 quantisation loses too much (cosine to torch "
                        f"{checks['int8_cosine_min']:.4f} < {INT8_MIN_COSINE}); export it in fp32"
                    )
            stored = _calibrate(staging) if chosen is Task.EMBED else ""
            manifest = replace(source.manifest, quantize=quantize, quantization=quantization, checks=checks,
                               calibration=stored, int8_scale=calibration.stored_int8_scale(staging))
            manifest.write(staging)
            _move_into(staging, out)
    return manifest


# -- sources -------------------------------------------------------------------------------------------
def _resolve(model: str) -> tuple[str, str, tuple[str, ...]]:
    """(directory, default served name, aliases) for a directory, 'default' or a hub name."""
    from .st_runner import default_model_path, model_name_from_path

    packaged = default_model_path()
    if model in ("", "default") or Path(model).resolve() == Path(packaged).resolve():
        return packaged, "all-MiniLM-L6-v2", ("sentence-transformers/all-MiniLM-L6-v2",)
    if Path(model).is_dir():
        return model, model_name_from_path(model), ()
    if Path(model).exists() or model.startswith((".", "/")) or model.count("/") > 1:
        raise ExportError(f"model {model!r}: not a model directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model), model.rsplit("/", 1)[-1], ()
    except Exception as exc:
        raise ExportError(f"model {model!r}: not a directory, and not found on the hub or in its cache: "
                          f"{_reason(exc)}") from exc


# -- the graph -----------------------------------------------------------------------------------------
def _export_graph(source: ExportSource, target: Path) -> None:
    """Trace ``source.module`` on a padded two-row batch, batch and sequence axes dynamic."""
    import torch

    seqs: list[Sequence[int]] = [
        source.tokens.with_special_tokens(ids) for ids in source.tokens.tokenize(PROBE_TEXTS[:2])
    ]
    if "token_type_ids" in source.inputs and source.manifest.task != Task.EMBED:
        a, b = source.tokens.tokenize(list(PROBE_PAIRS[0]))
        seqs[1] = PairIds(*source.tokens.pair_with_special_tokens(a, b))
    example = _features(seqs, source.tokens.pad_id, source.inputs)
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=max(source.manifest.max_tokens, 2))
    params = sum(p.numel() * p.element_size() for p in source.module.parameters())
    torch.onnx.export(
        source.module, (), str(target), kwargs=example, input_names=list(source.inputs),
        output_names=[source.output], dynamo=True, dynamic_shapes={k: {0: batch, 1: seq} for k in example},
        external_data=params > 1_500_000_000, verbose=False,
    )


def _features(seqs: Sequence[Sequence[int]], pad_id: int, names: Sequence[str]) -> dict[str, Any]:
    import torch

    from .tokens import pad_batch

    ids, mask = pad_batch(seqs, max(len(s) for s in seqs), pad_id)
    arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": segment_ids(seqs, ids.shape)}
    return {k: torch.from_numpy(arrays[k]) for k in names}


# Activation functions: the feed-forward block's MatMuls (into one and out of one) stay float.
_ACTIVATIONS = {"Gelu", "FastGelu", "BiasGelu", "Relu", "Erf", "Tanh", "Sigmoid", "QuickGelu"}


def _quantize(fp32: Path, target: Path, feeds: list[dict[str, np.ndarray]]) -> dict[str, str]:
    """Static int8 (QDQ): int8 weights per output channel and uint8 activations with one scale per tensor,
    both fixed here from the calibration corpus (MinMax), so at serving time a row is computed from its
    own values alone and does not depend on its batch mates. (Dynamic quantisation, which this replaced,
    computes the activations' scale per batch at run time: the same text alone and in a batch differed
    by up to 3e-2.) How it quantised, for the manifest.

    Quantised: the attention's projections (the MatMuls with a weight outside the feed-forward block).
    The feed-forward block's two MatMuls stay float: one fixed scale serves badly GELU's long tail (into
    the down projection) and the outlier channels of the normalised input (into the up projection). On
    600 paragraphs of this project's documentation with the packaged MiniLM, against float: all weight
    MatMuls 0.94 mean cosine; all but the down projections 0.991 and recall@10 0.89 (the dynamic
    scheme: 0.993, 0.91); the attention's alone 0.998 and 0.95, for about half the speed-up.
    MatMuls of two activations (attention scores) and embedding tables stay float.
    """
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    graph = onnx.load(str(fp32), load_external_data=False).graph
    weights = {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    producer = {o: n.op_type for n in graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def feeds_activation(output: str) -> bool:  # directly, or through a bias Add
        nodes = consumers.get(output, [])
        return any(n.op_type in _ACTIVATIONS or (n.op_type == "Add" and feeds_activation(n.output[0]))
                   for n in nodes)

    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    chosen = [n.name for n in matmuls if n.input[1] in weights
              and producer.get(n.input[0]) not in _ACTIVATIONS and not feeds_activation(n.output[0])]
    if not chosen:
        raise ValueError("no MatMul outside the feed-forward blocks has a weight to quantise")

    class Corpus(CalibrationDataReader):  # the calibration corpus, batch by batch
        def __init__(self) -> None:
            self._feeds = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._feeds, None)

    quantize_static(
        str(fp32), str(target), Corpus(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
        nodes_to_quantize=chosen, per_channel=True, weight_type=QuantType.QInt8,
        activation_type=QuantType.QUInt8,
    )
    return {
        "method": "static",
        "format": "QDQ",
        "weights": "int8, symmetric, one scale per output channel",
        "activations": "uint8, one scale and zero point per tensor, fixed at export (MinMax)",
        "calibration": f"the calibration corpus ({len(calibration.CORPUS)} sentences, "
                       f"{calibration.BATCH} per batch), digest {calibration.digest()}",
        "quantized": f"{len(chosen)} of {len(matmuls)} MatMuls: the attention's projections",
        "float": "embeddings, attention scores, feed-forward blocks, normalisation, pooling",
    }


def _calibration_feeds(staging: Path) -> list[dict[str, np.ndarray]]:
    """The calibration corpus as the float graph's input arrays, batch by batch."""
    runner = load_onnx_runner(str(staging), name=None, environ={})
    return [runner.prepare(batch).feed for batch in calibration.corpus_batches(runner.tokens)]


# -- checks --------------------------------------------------------------------------------------------
def _check(source: ExportSource, staging: Path, model: str) -> dict[str, float]:
    """The staged export, served by the ONNX runner, against the torch model on the probes."""
    try:
        runner = load_onnx_runner(str(staging), name=None, task=source.manifest.task, environ={})
        ours = source.probe(runner)
    except Exception as exc:
        reason = _reason(exc)
        raise ExportError(f"model {model!r}: ONNX Runtime cannot run the exported graph: {reason}") from exc
    ref = source.reference()
    if ours.shape != ref.shape:
        raise ExportError(f"model {model!r}: the graph gives {ours.shape}, torch {ref.shape}")
    if not np.isfinite(ours).all():
        raise ExportError(f"model {model!r}: the exported graph gives non-finite values")
    if source.manifest.task == Task.EMBED:
        cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
        return {"cosine_min": float(cos.min())}
    # Logits: the largest difference, relative to the largest logit (at least 1).
    return {"logit_error": float(np.abs(ours - ref).max()) / max(1.0, float(np.abs(ref).max()))}


def _calibrate(staging: Path) -> str:
    """Embed the calibration corpus with the final graph, as the engine's warm-up would, and store the
    rows beside it (a server of the export then starts without embedding them); their digest."""
    runner = load_onnx_runner(str(staging), name=None, environ={})
    prepared = [runner.prepare(batch) for batch in calibration.corpus_batches(runner.tokens)]
    rows = np.concatenate([runner.finish(runner.forward(p), p) for p in prepared])
    np.save(staging / calibration.FILE, np.ascontiguousarray(rows, dtype=np.float32), allow_pickle=False)
    return calibration.digest()


# -- files ---------------------------------------------------------------------------------------------
def _write_support_files(source: ExportSource, path: str, staging: Path) -> None:
    """tokenizer.json (the serving tokenizer), the tokenizer and model configs, the sentence-transformers
    configuration (modules, pooling, prompts) as the source has them."""
    (staging / "tokenizer.json").write_text(source.tokens.spec().json, encoding="utf-8")
    for f in (*_TOKENIZER_FILES, "config.json", "sentence_bert_config.json"):
        if (source.transformer_dir / f).is_file():
            shutil.copy(source.transformer_dir / f, staging / f)
    root = Path(path)
    for f in _ST_FILES:
        if (root / f).is_file():
            shutil.copy(root / f, staging / f)
    if (root / "modules.json").is_file():
        for module in st_modules(root)[1:]:
            sub = str(module.get("path") or "")
            if sub and (root / sub / "config.json").is_file():
                (staging / sub).mkdir(parents=True, exist_ok=True)
                shutil.copy(root / sub / "config.json", staging / sub / "config.json")


def _move_into(staging: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for item in staging.iterdir():
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        shutil.move(str(item), str(target))


def _describe(checks: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.6f}" for k, v in checks.items())


# -- messages ------------------------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _reason(exc: BaseException, limit: int = 500) -> str:
    """The cause in one line: for torch.onnx errors the first paragraph of its "Exception summary" and
    the model code that raised it; else the exception's first line."""
    text = _ANSI.sub("", str(exc))
    summary = text.split("## Exception summary", 1)
    where = ""
    if len(summary) == 2:
        body = summary[1].strip()
        call = re.search(r'raised this error:\s*File "([^"]+)", line (\d+), in \w+\s*\n\s*(.+)', body)
        if call:
            where = f" (at {call.group(1)}:{call.group(2)}: {call.group(3).strip()})"
        text = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", body.split("\n\n", 1)[0])
    else:
        text = next((line for line in text.splitlines() if line.strip()), "")
        if type(exc).__name__ not in text:
            text = f"{type(exc).__name__}: {text}"
    text = " ".join(text.split()) + where
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """Keep the exporter's progress lines, warnings and progress bars off the terminal (unless verbose)."""
    if verbose:
        yield
        return
    sink = io.StringIO()
    quiet = ("torch", "transformers", "sentence_transformers", "onnxscript", "onnx_ir", "onnxruntime")
    levels = {n: logging.getLogger(n).level for n in (*quiet, "")}
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization advises on the root logger
    for n in quiet:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
