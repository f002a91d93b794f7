"""The ``onnx`` bench section: torch, ONNX Runtime and OpenVINO side by side in one run (CPU).

The packaged MiniLM is exported twice (``coalesce export``, fp32 and ``--quantize int8``) into the
bench output folder, then, one server at a time on loopback:

* cold start: process start → ``/ready`` → first embedding, torch, onnx and openvino alternated,
  median of 5 (OpenVINO's compiled-model cache starts empty, so its slowest start is a cold compile);
* latency and throughput: closed loop with 1 client (p50) and 32 clients (throughput), short texts,
  torch, onnx fp32, onnx int8, openvino (``--dtype auto``: bf16 where the CPU has it) and openvino
  float32 (when OpenVINO is installed);
* whether each server process (and its children) mapped libtorch;
* idle: CPU seconds a ready server spends in 10 s with no traffic, torch, onnx and openvino;
* pooling: the exported graph (pooling and normalisation inside) against the same graph cut before
  pooling with mean pooling and normalisation in numpy, in this process, rounds alternated.

Exports and servers run in child processes; this process imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
from coalesce.kernels.onnx_runner import openvino_installed
from coalesce.loadtests import coldstart, servers
from coalesce.loadtests.procs import cpu_seconds, tree
from coalesce.loadtests.report import fmt, markdown_table
from coalesce.loadtests.scenario import Mode, Scenario
from coalesce.loadtests.workload import Mix
from msgspec.structs import replace

CLIENTS = 32
COLD_RUNS = 5
IDLE_S = 10.0
POOLING_CASES = ((1, 16), (32, 32), (32, 128))


def onnx(args: argparse.Namespace) -> tuple[str, str]:
    from coalesce.loadtests.bench_sections import _met, _run

    out = args.out / "onnx"
    exports = {q: out / f"minilm-{q}" for q in ("fp32", "int8")}
    for quantize, target in exports.items():
        _export(target, quantize)
    flags = {
        "torch": ["--backend", "torch"],
        "onnx": ["--backend", "onnx", "--model", str(exports["fp32"])],
        "onnx int8": ["--backend", "onnx", "--model", str(exports["int8"])],
    }
    cache = out / "openvino-cache"
    if openvino_installed():
        shutil.rmtree(cache, ignore_errors=True)  # the first cold start compiles; the rest read the cache
        ov = ["--backend", "openvino", "--openvino-cache-dir", str(cache), "--model", str(exports["fp32"])]
        flags |= {"openvino": ov, "openvino f32": [*ov, "--dtype", "float32"],
                  "openvino int8": [*ov[:-1], str(exports["int8"]), "--dtype", "float32"]}
    cold = _cold_starts(flags, args.ready_timeout)
    closed = Scenario(
        mode=Mode.CLOSED, concurrency=CLIENTS, duration=args.duration, warmup=3.0, mix=Mix.SHORT
    )
    steps: dict[str, tuple[Any, Any]] = {}
    idle: dict[str, float] = {}
    libtorch: dict[str, bool] = {}
    for name, fl in flags.items():
        spec = servers.coalesce_spec(name.replace(" ", "-"), fl)
        with servers.running(spec, out / "logs", args.ready_timeout) as srv:
            libtorch[name] = _maps_libtorch(srv.proc.pid)
            if name in ("torch", "onnx", "openvino"):
                time.sleep(2.0)  # let start-up settle
                before = cpu_seconds(srv.proc.pid)
                time.sleep(IDLE_S)
                idle[name] = cpu_seconds(srv.proc.pid) - before
            label = name.replace(" ", "-")
            steps[name] = (
                _run(srv.url, replace(closed, concurrency=1), f"{label} c1", out),
                _run(srv.url, closed, f"{label} c{CLIENTS}", out),
            )
    pooling = _pooling(exports["fp32"])

    def p50(name: str) -> float:
        lat = steps[name][0].latency
        return float(lat.p50_ms) if lat else float("nan")

    def rps(name: str) -> float:
        return float(steps[name][1].achieved_rps)

    rows = []
    for name in flags:
        c = cold.get(name)
        rows.append([
            f"`{' '.join(flags[name][:2])}`" + (" (int8 export)" if "int8" in name else "")
            + (" `--dtype float32`" if name.startswith("openvino") and name != "openvino" else ""),
            f"{c['ready_s']:.2f}" if c else "-",
            f"{c['first_embedding_s']:.2f} ({c['first_min_s']:.2f}–{c['first_max_s']:.2f})" if c else "-",
            f"{c['cpu_s']:.2f}" if c else "-",
            fmt(p50(name)), fmt(steps[name][0].latency.p99_ms if steps[name][0].latency else None),
            fmt(rps(name)), f"{idle[name]:.3f}" if name in idle else "-",
            "yes" if libtorch[name] else "no",
        ])
    first = cold["onnx"]["first_embedding_s"]
    figures = [
        ["onnx: process start → first embedding", "≤ 1.0 s", f"{first:.2f} s", _met(first <= 1.0)],
        ["p50 at 1 client, onnx ÷ torch", "≤ 0.6×", f"{p50('onnx') / p50('torch'):.2f}×",
         _met(p50("onnx") <= 0.6 * p50("torch"))],
        [f"throughput at {CLIENTS} clients, onnx ÷ torch", "≥ 1.0×", f"{rps('onnx') / rps('torch'):.2f}×",
         _met(rps("onnx") >= rps("torch"))],
        [f"throughput at {CLIENTS} clients, onnx int8 ÷ torch", "-",
         f"{rps('onnx int8') / rps('torch'):.2f}×", ""],
        [f"idle CPU of a ready onnx server ({IDLE_S:g} s)", "0", f"{idle['onnx']:.3f} CPU-s",
         _met(idle["onnx"] < 0.05 * IDLE_S)],
    ]
    if "openvino" in flags:
        ov_first = cold["openvino"]["first_embedding_s"]
        figures += [
            [f"throughput at {CLIENTS} clients, openvino (--dtype auto) ÷ onnx fp32", "≥ 1.5×",
             f"{rps('openvino') / rps('onnx'):.2f}×", _met(rps("openvino") >= 1.5 * rps("onnx"))],
            [f"throughput at {CLIENTS} clients, openvino float32 ÷ onnx fp32", "-",
             f"{rps('openvino f32') / rps('onnx'):.2f}×", ""],
            [f"throughput at {CLIENTS} clients, openvino int8 export ÷ onnx int8 export", "-",
             f"{rps('openvino int8') / rps('onnx int8'):.2f}×", ""],
            ["openvino: process start → first embedding (cache warm, median)", "≤ 1.0 s", f"{ov_first:.2f} s",
             _met(ov_first <= 1.0)],
            ["openvino: libtorch mapped", "no", "yes" if libtorch["openvino"] else "no",
             _met(not libtorch["openvino"])],
            [f"idle CPU of a ready openvino server ({IDLE_S:g} s)", "0", f"{idle['openvino']:.3f} CPU-s",
             _met(idle["openvino"] < 0.05 * IDLE_S)],
        ]
    pool_rows = [
        [f"{n} × {length}", f"{g:.2f}", f"{m:.2f}", f"{m / g:.2f}×"]
        for (n, length), (g, m) in pooling.items()
    ]
    body = (
        "The packaged all-MiniLM-L6-v2, exported in this run (`coalesce export`, fp32 and "
        f"`--quantize int8`), served by each backend in turn (openvino: `--dtype auto`, bf16 where the "
        f"CPU has it, unless the row says float32). Cold start: median of {COLD_RUNS} starts, "
        "torch, onnx and openvino alternated (OpenVINO's compiled-model cache empty before the first: the "
        "slowest start is its compile), seconds from process start, and the CPU-seconds the server spent to "
        "get there (which other load on the machine hardly changes); the project's modules compiled to "
        "bytecode first, as the images' `pip install` does. Load: short single-sentence requests, "
        f"closed loop, {args.duration:g} s after 3 s warm-up, 1 client then {CLIENTS}. Idle: CPU-seconds "
        f"of a ready server in {IDLE_S:g} s without traffic.\n\n"
        + markdown_table(["server", "/ready s", "first embedding s (fastest–slowest)", "CPU-s to it",
                          "p50 ms (1 client)", "p99 ms (1 client)", f"req/s ({CLIENTS} clients)",
                          f"idle CPU-s / {IDLE_S:g} s", "libtorch mapped"],
                         rows)
        + "\n\n"
        + markdown_table(["figure", "target", "measured", ""], figures)
        + "\n\nWhere pooling runs (fp32, in one process, median ms per forward, rounds alternated): the "
        "exported graph with mean pooling and normalisation inside, against the same graph cut at the last "
        "hidden state with pooling and normalisation in numpy.\n\n"
        + markdown_table(["batch × tokens", "in the graph ms", "numpy ms", "numpy ÷ graph"], pool_rows)
        + "\n"
    )
    return "ONNX Runtime and OpenVINO against torch on CPU: cold start, latency, throughput, idle", body


def _export(target: Path, quantize: str) -> None:
    argv = [*servers.coalesce_command(), "export", "--model", "default", "--out", str(target)]
    argv += ["--quantize", "int8"] if quantize == "int8" else []
    subprocess.run(argv, check=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                   stdout=subprocess.DEVNULL)


def _cold_starts(flags: dict[str, list[str]], timeout_s: float) -> dict[str, dict[str, float]]:
    """Median /ready and first-embedding seconds of torch, onnx fp32 and openvino (when installed),
    starts alternated."""
    port = servers.free_port()
    names = [name for name in ("torch", "onnx", "openvino") if name in flags]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(COLD_RUNS):
        for name in runs:
            argv = [*servers.coalesce_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
            argv += flags[name]
            runs[name].append(coldstart.measure_server(argv, port, timeout_s))
    return {
        name: {
            **{k: statistics.median(r[k] for r in rs) for k in ("ready_s", "first_embedding_s", "cpu_s")},
            "first_min_s": min(r["first_embedding_s"] for r in rs),
            "first_max_s": max(r["first_embedding_s"] for r in rs),
        }
        for name, rs in runs.items()
    }


def _maps_libtorch(pid: int) -> bool:
    """Whether ``pid`` or one of its children has libtorch mapped."""
    for p in tree(pid):
        try:
            if "libtorch" in Path(f"/proc/{p}/maps").read_text():
                return True
        except OSError:
            continue
    return False


def _pooling(export: Path, seconds: float = 4.0) -> dict[tuple[int, int], tuple[float, float]]:
    """Median ms per forward of (graph with pooling, graph cut before pooling + numpy pooling)."""
    import onnx as onnx_lib
    import onnxruntime as ort

    graph = onnx_lib.load(str(export / "model.onnx"))
    hidden = [n for n in graph.graph.node if n.op_type == "LayerNormalization"][-1].output[0]
    cut = export.parent / "minilm-fp32-hidden.onnx"
    onnx_lib.utils.extract_model(str(export / "model.onnx"), str(cut),
                                 [i.name for i in graph.graph.input], [hidden])
    options = ort.SessionOptions()
    options.intra_op_num_threads = len(os.sched_getaffinity(0))
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    pooled = ort.InferenceSession(str(export / "model.onnx"), options, providers=["CPUExecutionProvider"])
    tokens = ort.InferenceSession(str(cut), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    result = {}
    for n, length in POOLING_CASES:
        ids = rng.integers(1000, 30000, size=(n, length), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[n // 2 :, length // 2 :] = 0  # half the rows padded to half length
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}

        def in_graph(feed: dict[str, np.ndarray] = feed) -> np.ndarray:
            out: np.ndarray = pooled.run(None, feed)[0]
            return out

        def in_numpy(feed: dict[str, np.ndarray] = feed) -> np.ndarray:
            hidden_states = tokens.run(None, feed)[0]
            m = feed["attention_mask"][..., None].astype(np.float32)
            mean = (hidden_states * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
            out: np.ndarray = mean / np.linalg.norm(mean, axis=1, keepdims=True)
            return out

        a, b = in_graph(), in_numpy()
        assert float(((a * b).sum(1)).min()) > 0.99999, "the two poolings disagree"
        times: dict[str, list[float]] = {"graph": [], "numpy": []}
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for key, fn in (("graph", in_graph), ("numpy", in_numpy)):
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
        result[n, length] = (statistics.median(times["graph"]) * 1e3, statistics.median(times["numpy"]) * 1e3)
    return result

