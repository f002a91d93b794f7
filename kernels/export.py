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
                        help="int8: static int8 of the later half of the layers' attention (weights per "
                        "channel, activation scales calibrated on a built-in corpus, so a vector does not "
                        "depend on its batch); recall@10 against float ~0.975, cosine ~0.9995")
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
        if not any((Path(model) / f).is_file() for f in ("config.json", "modules.json")):
            # Said before torch and transformers are imported (seconds), not after they fail to load it.
            raise ExportError(f"model {model!r}: not a model directory (it has no config.json or "
                              "modules.json)")
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

    Quantised: the attention's projections (the MatMuls with a weight outside the feed-forward block),
    but for the first :data:`FLOAT_SHARE` of the layers, with SmoothQuant (:func:`_smooth`) on the
    normalised input of query, key and value. The feed-forward block's two MatMuls stay float: one fixed
    scale serves badly GELU's long tail (into the down projection) and the outlier channels of the
    normalised input (into the up projection). MatMuls of two activations (attention scores) and
    embedding tables stay float.

    Chosen over the alternatives tried while building it, in uncommitted trials on the quality bench's
    corpus (so no figure of theirs is quoted): every attention projection with MinMax alone (the
    previous scheme: recall@10 0.950 in the committed `bench --only quality`), calibration on longer
    sequences, other SmoothQuant strengths, smoothing the output projection too, fewer or other layers
    left float, the feed-forward up projections quantised too, and ONNX Runtime's weight-only
    MatMulNBits (better recall, but slower than float32 at batch 32 and, with wide blocks, rows that
    moved with their batch). What limits this scheme is the activations' one scale per tensor. This one
    scores recall@10 0.975 in the committed quality section (2026-12-02 04:26).
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
    attention = [n for n in matmuls if n.input[1] in weights
                 and producer.get(n.input[0]) not in _ACTIVATIONS and not feeds_activation(n.output[0])]
    if not attention:
        raise ValueError("no MatMul outside the feed-forward blocks has a weight to quantise")
    blocks = _blocks(attention, {o for n in graph.node if n.op_type in _NORMS for o in n.output})
    kept = set(range(int(len(blocks) * FLOAT_SHARE)))
    chosen = [name for i, block in enumerate(blocks) if i not in kept for name in block]

    class Corpus(CalibrationDataReader):  # the calibration corpus, batch by batch
        def __init__(self) -> None:
            self._feeds = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._feeds, None)

    smoothed = target.with_name("model.smoothed.onnx")
    smoothed_inputs = _smooth(fp32, smoothed, set(chosen), feeds)
    try:
        quantize_static(
            str(smoothed), str(target), Corpus(), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["MatMul"], nodes_to_quantize=chosen, per_channel=True,
            weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
        )
    finally:
        for f in target.parent.glob(smoothed.name + "*"):
            f.unlink()
    return {
        "method": "static",
        "format": "QDQ",
        "weights": "int8, symmetric, one scale per output channel",
        "activations": "uint8, one scale and zero point per tensor, fixed at export (MinMax)",
        "calibration": f"the calibration corpus ({len(calibration.CORPUS)} sentences, "
                       f"{calibration.BATCH} per batch), digest {calibration.digest()}",
        "quantized": f"{len(chosen)} of {len(matmuls)} MatMuls: the attention's projections in "
                     f"{len(blocks) - len(kept)} of {len(blocks)} layers",
        "smoothing": f"SmoothQuant (alpha {SMOOTH_ALPHA}) on the {smoothed_inputs} normalised inputs of "
                     "query, key and value: channel scales from the calibration corpus",
        "float": "embeddings, attention scores, feed-forward blocks, normalisation, pooling, and the "
                 f"attention of layers {', '.join(str(i) for i in sorted(kept)) or 'none'}",
    }


def _blocks(attention: list[Any], normalised: set[str]) -> list[list[str]]:
    """The attention MatMuls (graph order) by layer: a layer starts at each normalised hidden state its
    projections read (query, key and value read the same one; the output projection follows them)."""
    blocks: list[list[str]] = []
    seen: set[str] = set()
    for node in attention:
        if not blocks or (node.input[0] in normalised and node.input[0] not in seen):
            seen.add(node.input[0])
            blocks.append([])
        blocks[-1].append(node.name)
    return blocks


# Normalisations whose output carries the outlier channels SmoothQuant moves into the weights.
_NORMS = {"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
          "SkipSimplifiedLayerNormalization", "RMSNormalization"}
SMOOTH_ALPHA = 0.5  # how much of an input channel's range moves into the weights (SmoothQuant's α)
# The share of layers, the first ones, whose attention stays float (MiniLM: the first three of six).
FLOAT_SHARE = 0.5


def _smooth(fp32: Path, target: Path, chosen: set[str], feeds: list[dict[str, np.ndarray]],
            alpha: float = SMOOTH_ALPHA) -> int:
    """Write ``fp32`` to ``target`` with SmoothQuant (Xiao et al., 2023) applied to the chosen MatMuls that
    read a normalisation's output; the number of such inputs smoothed.

    A normalised hidden state has a few channels tens of times larger than the rest, so one activation
    scale per tensor leaves the others a handful of int8 steps. For each such input ``x`` and the weights
    ``W`` that read it (query, key and value), channel ``j`` is divided by ``s_j = max|x_j|^α /
    max|W_j|^(1-α)`` (a ``Mul`` inserted before them: the same hidden state also feeds the residual, so
    the normalisation itself cannot absorb it) and row ``j`` of each ``W`` multiplied by it: the float
    graph computes the same (to rounding), while the range moves from the activation, quantised per
    tensor, to the weights, quantised per channel. ``max|x_j|`` comes from the calibration corpus (real
    tokens only), so the scales are fixed here and a row still does not depend on its batch."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(fp32))
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    groups: dict[str, list[Any]] = {}
    for node in graph.node:
        source = producer.get(node.input[0]) if node.op_type == "MatMul" else None
        if node.name in chosen and node.input[1] in weights and getattr(source, "op_type", "") in _NORMS:
            groups.setdefault(node.input[0], []).append(node)
    inserted: dict[str, Any] = {}
    for name, peak in _channel_peaks(model, list(groups), feeds).items():
        rows = [numpy_helper.to_array(weights[n.input[1]]) for n in groups[name]]
        wpeak = np.max([np.abs(w).max(axis=1) for w in rows], axis=0)
        scale = np.ones_like(peak)
        ok = (peak > 0) & (wpeak > 0)
        scale[ok] = peak[ok] ** alpha / wpeak[ok] ** (1 - alpha)
        scale = scale.astype(np.float32)
        for node, w in zip(groups[name], rows, strict=True):
            weights[node.input[1]].CopyFrom(numpy_helper.from_array(w * scale[:, None], node.input[1]))
            node.input[0] = name + "_smoothed"
        graph.initializer.append(numpy_helper.from_array(1 / scale, name + "_smoothing"))
        inserted[name] = helper.make_node("Mul", [name, name + "_smoothing"], [name + "_smoothed"],
                                          name=name + "_smooth")
    nodes = []
    for node in graph.node:  # each Mul right after the normalisation it divides: still in graph order
        nodes.append(node)
        nodes += [inserted[o] for o in node.output if o in inserted]
    graph.ClearField("node")
    graph.node.extend(nodes)
    _save(model, target)
    return len(inserted)


def _channel_peaks(model: Any, names: list[str], feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The largest absolute value of each channel (last axis) of the tensors ``names`` of the float graph
    ``model`` over ``feeds``, real tokens only (padding is masked out downstream)."""
    import onnx
    import onnxruntime as ort

    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names
    )
    with tempfile.TemporaryDirectory() as tmp:
        _save(probe, Path(tmp) / "probe.onnx")
        session = ort.InferenceSession(str(Path(tmp) / "probe.onnx"), providers=["CPUExecutionProvider"])
    peaks: dict[str, np.ndarray] = {}
    for feed in feeds:
        mask = feed.get("attention_mask")
        for name, value in zip(names, session.run(names, feed), strict=True):
            real = value[mask.astype(bool)] if mask is not None and value.shape[:2] == mask.shape else value
            peak = np.abs(real.reshape(-1, value.shape[-1])).max(axis=0)
            peaks[name] = np.maximum(peaks[name], peak) if name in peaks else peak
    return peaks


def _save(model: Any, path: Path) -> None:
    """Save ``model``, its weights in a file beside it when they pass what one protobuf may hold."""
    import onnx

    size = sum(len(i.raw_data) for i in model.graph.initializer)
    onnx.save(model, str(path), save_as_external_data=size > 1_500_000_000,
              location=path.name + ".data" if size > 1_500_000_000 else None)


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
