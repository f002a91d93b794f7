"""One frozen Settings object, built once at start-up from flags and ``COALESCE_*`` environment variables.

Nothing else in the service reads ``os.environ``. Each knob is declared once, as a dataclass field whose
metadata carries its help text (the trade-off it controls); the command line is generated from those
declarations, and every flag ``--some-knob`` may also be given as ``COALESCE_SOME_KNOB``. A flag wins
over the environment, the environment over the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
ENV_PREFIX = "COALESCE_"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model to serve: its served name (None = derive from the model) and where it lives."""

    name: str | None
    path: str | None  # None = the embedded default model
    task: str | None = None  # embed, classify or rerank; None = detect from the model directory
    rerank_template: str | None = None  # an LLM reranker's template file (--rerank-template)


def parse_model_spec(text: str) -> ModelSpec:
    """``PATH`` or ``NAME=PATH``; an empty PATH or the word ``default`` means the embedded model."""
    name, sep, path = text.partition("=")
    if not sep:
        name, path = "", text
    path = path.strip()
    return ModelSpec(name=name.strip() or None, path=None if path in ("", "default") else path)


TASKS = ("embed", "classify", "rerank", "sparse")
LONG_INPUTS = ("truncate", "chunk", "error")  # --long-input, and a request's long_input
ALLOCATORS = ("auto", "jemalloc", "glibc", "system")  # --allocator; see service/allocator.py


def parse_task_spec(text: str) -> tuple[str, str]:
    """``NAME=TASK`` for ``--task``: the served model NAME runs as TASK (embed, classify, rerank, sparse)."""
    name, sep, task = text.partition("=")
    name, task = name.strip(), task.strip().lower()
    if not sep or not name or task not in TASKS:
        raise argparse.ArgumentTypeError(f"expected NAME=embed|classify|rerank|sparse, got {text!r}")
    return name, task


def parse_named_value(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` for per-model flags (``--default-prompt-name``, ``--default-prompt``); the value
    is kept as written, spaces included (a prompt usually ends with one)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value


def _int_tuple(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers, got {text!r}"
        )
    return values


# --workers auto: its value until the server decides it (auto_workers), and the most gateways it picks
# (on a 16-core H200 host four gateways served as many requests as eight: BENCHMARKS.md, GPU section).
WORKERS_AUTO = -1
AUTO_WORKERS_MAX = 4


def parse_workers(raw: str) -> int:
    """``--workers``: a count, or ``auto`` (:data:`WORKERS_AUTO`, decided at start: :func:`auto_workers`)."""
    return WORKERS_AUTO if raw.strip().lower() == "auto" else int(raw)


def auto_workers(s: Settings) -> tuple[int, str]:
    """What ``--workers auto`` means here, and why: :data:`AUTO_WORKERS_MAX` gateways (at most half the
    CPUs this process may use, its container's quota included; 1 below 4) when the models will run on a
    CUDA device — ``--device cuda``, or ``auto`` where torch could (``kernels/onnx_runner.cuda_visible``:
    a CUDA build, a driver, devices not hidden) — else 1 (on a CPU the gateways would take cores from
    the forward). Decided without importing torch, so the supervisor starts as fast as before."""
    from coalesce.kernels.onnx_runner import cpu_allowance, cuda_visible

    if s.device == "cpu":
        return 1, "--device cpu"
    if s.backend in ("onnx", "openvino"):
        return 1, f"--backend {s.backend} runs on the CPU"
    if not s.device.startswith("cuda") and not cuda_visible():
        return 1, "no CUDA device torch could use"
    cores = cpu_allowance()
    n = min(AUTO_WORKERS_MAX, cores // 2)
    if n < 2:
        return 1, f"a CUDA device, but {cores} cores"
    return n, f"a CUDA device and {cores} cores"


def _knob(help_text: str, **kw: Any) -> Any:
    """A dataclass field that is also a command-line flag and an environment variable."""
    default = kw.pop("default")
    meta = {"help": help_text, **kw}
    if isinstance(default, list | dict | set):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Settings:
    """Every knob of ``coalesce serve``. Frozen: built once, then passed down explicitly."""

    models: tuple[ModelSpec, ...] = _knob(
        "Model to serve: a sentence-transformers directory, as PATH or NAME=PATH; repeatable. "
        "Default: the embedded all-MiniLM-L6-v2, fully offline.",
        default=(ModelSpec(None, None),),
        flag="--model",
        repeat=True,
        parse=parse_model_spec,
    )
    served_model_name: str | None = _knob(
        "Name clients put in the 'model' field (single-model form). Default: the model's own name.",
        default=None,
    )
    tasks: tuple[tuple[str, str], ...] = _knob(
        "Task of a served model, as NAME=embed|classify|rerank|sparse; repeatable. By default it is "
        "detected from the model directory (sentence-transformers layout: embed; a SparseEncoder: sparse; "
        "*ForSequenceClassification: classify, or rerank with one output; a CrossEncoder: rerank), which "
        "fits published models; "
        "override it for a model saved another way, e.g. to embed with a classifier's encoder. "
        "NAME=rerank on a *ForCausalLM serves it as an LLM reranker (Qwen3-Reranker style: pairs read "
        "through its template, scored by its 'yes'/'no' logits).",
        default=(),
        flag="--task",
        repeat=True,
        parse=parse_task_spec,
    )
    default_prompt_names: tuple[tuple[str, str], ...] = _knob(
        "The prompt a served model applies when a request names none, as NAME=PROMPT_NAME (one of the "
        "model's own prompts, from config_sentence_transformers.json); repeatable. Default: the model's "
        "default_prompt_name, if any. e5/bge-style models want 'query' for queries: set it when most "
        "traffic is queries, and let indexers send prompt_name explicitly.",
        default=(),
        flag="--default-prompt-name",
        repeat=True,
        parse=parse_named_value,
    )
    default_prompts: tuple[tuple[str, str], ...] = _knob(
        "A literal default prompt for a served model, as NAME=TEXT (e.g. 'e5=query: '); repeatable; wins "
        "over --default-prompt-name. Requests naming a prompt still get theirs.",
        default=(),
        flag="--default-prompt",
        repeat=True,
        parse=parse_named_value,
    )
    rerank_instructions: tuple[tuple[str, str], ...] = _knob(
        "The instruction an LLM reranker (Qwen3-Reranker style) reads pairs with when a request sends "
        "none, as NAME=TEXT; repeatable. Default: the model's template's (the Qwen3-Reranker card's 'Given "
        "a web search query, retrieve relevant passages that answer the query'). These models are trained "
        "with task-specific instructions: set the one your traffic is, and let other callers send "
        "'instruction'.",
        default=(),
        flag="--rerank-instruction",
        repeat=True,
        parse=parse_named_value,
    )
    rerank_templates: tuple[tuple[str, str], ...] = _knob(
        "An LLM reranker's template, as NAME=PATH to a JSON file of the fields rerank_template.json in a "
        "model directory holds (prefix, suffix, pair with {instruction}, {query} and {document}, "
        "instruction, yes, no); repeatable. Wins over the model directory's file; for families other "
        "than Qwen3-Reranker (whose card's template is the default) whose directory has none. Serves the "
        "model as an LLM reranker.",
        default=(),
        flag="--rerank-template",
        repeat=True,
        parse=parse_named_value,
    )
    max_rerank_tokens: int | None = _knob(
        "Most tokens of one rerank pair (query, document and, for an LLM reranker, its template): longer "
        "documents are cut to fit (the query and template never are), or refused by name with "
        "--no-truncate. Default: the model's own maximum (tens of thousands of tokens for a Qwen3 "
        "reranker; its model card uses 8192). Lower bounds the cost of one pair, which for an LLM "
        "reranker on CPU is large, at the price of judging only a document's beginning.",
        default=None,
    )
    host: str = _knob(
        "Address to listen on. 0.0.0.0 for containers; 127.0.0.1 to stay local.", default="0.0.0.0"
    )
    port: int = _knob("Port to listen on (the PORT variable of Cloud Run/Knative is honoured).", default=8080)
    device: str = _knob(
        "Where the model runs: auto (CUDA when present), cpu, cuda or cuda:N.", default="auto"
    )
    backend: str = _knob(
        "Inference engine: torch (any model; CUDA graphs on GPUs), onnx or openvino (a directory written "
        "by `coalesce export`, run on the CPU without importing torch: sub-second cold start and a faster "
        "forward at small batches; onnx is ONNX Runtime, openvino is OpenVINO's CPU plugin, faster again "
        "and in bfloat16 on CPUs that have it (--dtype float32 forces float32), at about 0.4 s more cold "
        "start before its compiled-model cache is warm; int8 exports trade ~0.002 of cosine for more "
        "speed). auto: for an exported graph whose forward runs on the CPU (--device cpu, or no CUDA "
        "device visible), openvino when it is installed, else onnx; torch otherwise.",
        default="auto",
    )
    openvino_cache_dir: str | None = _knob(
        "Where --backend openvino keeps compiled models, so a restart reads the compiled model instead of "
        "compiling the graph again (a re-export invalidates it), and what the bfloat16 guard measured, so a "
        "restart does not embed its sentences again. Default: openvino_cache in the export "
        "directory when it is writable, else ~/.cache/coalesce/openvino. A compiled model takes about as "
        "much disk as the graph.",
        default=None,
    )
    dtype: str = _knob(
        "Weights' precision: auto (float16 on CUDA; on the CPU bfloat16 where it computes it natively "
        "- avx512_bf16, amx_bf16, Arm bf16 - for a model whose calibration rows stay within cosine 0.999 "
        "of float32, else float32), float32, float16 (CUDA only) or bfloat16. Half precision roughly "
        "doubles GPU throughput at a cosine difference of about 1e-3; bfloat16 on such CPUs runs BERT "
        "encoders about 1.5x faster (AVX512-BF16 without AMX; AMX more) at a cosine of about 0.9999. "
        "Classifiers, cross-encoders and SPLADE stay float32 on the CPU.",
        default="auto",
    )
    cpu_fast_forward: bool = _knob(
        "On the CPU, run an embedding model's linear layers on weights reordered once at load for "
        "oneDNN instead of reordered by the library on every call (BERT-family models also get GELU "
        "fused and, in bfloat16, attention as plain matrix products): a faster forward in both "
        "precisions (BENCHMARKS.md, quality section). Kept only when its calibration rows match the "
        "plain forward's (else logged and off). --no-cpu-fast-forward turns it off.",
        default=True,
    )
    cpu_traced_forward: bool = _knob(
        "On the CPU, run the graph-safe encoder's forward (BERT-family embedding models) traced to "
        "TorchScript: the whole forward runs without Python's interpreter lock, where from Python it takes "
        "the lock back between each of its operators and, while the event loop runs Python without pause "
        "(a flood being refused), waits for it each time. Kept only when ragged batches match the Python "
        "forward's rows (else logged and off); costs a fraction of a second at start-up. "
        "--no-cpu-traced-forward turns it off.",
        default=True,
    )
    cpu_kernel_cache: int = _knob(
        "Batch shapes the CPU libraries keep compiled kernels for: each of oneDNN's two caches under "
        "torch (its primitive cache and PyTorch's computation cache; one entry per operation and shape, "
        "1,024 each by default) and OpenVINO's CPU plugin (5,000 shapes by default). At their defaults "
        "a replica under varying load grows by hundreds of MiB (OpenVINO: most of a GiB) as new batch "
        "shapes come; 64 keeps the growth to tens of MiB (BENCHMARKS.md, memory section). 0: the "
        "libraries' defaults. ONEDNN_PRIMITIVE_CACHE_CAPACITY or LRU_CACHE_CAPACITY set in the "
        "environment win for torch.",
        default=64,
    )
    loop_core_share: float = _knob(
        "On the CPU, the event loop's busy share (of its own thread, over each second) above which, two "
        "seconds in a row, a torch forward runs on one thread fewer than it may (leaving the loop a "
        "core), and at or below which on all of them. The forward's threads and a loop busy most of "
        "the time want more cores than there are: one of them keeps being taken off its core and "
        "every operator waits for it. "
        "At 4x a 2-core machine's capacity (loop busy 0.52-0.62) one thread served more admitted "
        "requests within the latency target than two; at 1x and 2x (loop 0.25-0.41) one fewer had "
        "served less in earlier tries (BENCHMARKS.md, overload section). Under --workers N the engine "
        "process judges its forward's own busy share instead: the gateways do the requests' work in "
        "their processes, and their wake-ups take the forward's threads off their cores while the "
        "replica is saturated (BENCHMARKS.md, engine section). 0 turns it off; no effect on a GPU or "
        "the torch-free backends. Whatever it says, a forward on every core that runs slower than on one "
        "fewer (a core busy with another program) is held to one fewer while it does (README: the "
        "forward's threads beside a busy neighbour).",
        default=0.5,
    )
    switch_interval_ms: float = _knob(
        "Python's switch interval in this process (sys.setswitchinterval): how long a thread that waits "
        "for the interpreter lock waits before the running one is asked to drop it. A forward run from "
        "Python (--no-cpu-traced-forward, or a model outside the graph-safe forward) drops the lock inside "
        "each operator and takes it back between them; while the event loop runs Python without pause (a "
        "flood being refused, an engine reading many gateways' messages), each take-back waited up to "
        "Python's default of 5 ms, and the forward ran slower by as much "
        "(python -m coalesce.loadtests.lock_contention; BENCHMARKS.md). 0: Python's default.",
        default=0.5,
    )
    cuda_graphs: bool = _knob(
        "Replay CUDA graphs captured per (batch, sequence) cell for BERT-family models, cutting kernel "
        "launch overhead at small batches; costs capture time at start-up and some GPU memory.",
        default=True,
    )
    graph_batch_sizes: tuple[int, ...] | None = _knob(
        "Batch sizes of the graph grid (e.g. 1,2,4,8,16,32,64,128,256). More cells pad less but take "
        "longer to capture. Default: powers of two up to 256.",
        default=None,
    )
    graph_seq_lens: tuple[int, ...] | None = _knob(
        "Sequence lengths of the graph grid (e.g. 16,32,64,128,256,512), capped at the model's maximum.",
        default=None,
    )
    graph_capture_budget_s: float = _knob(
        "Seconds of start-up spent capturing graphs (largest cell first); cells left over are captured "
        "on first use. Shorter is a faster cold start.",
        default=20.0,
    )
    graph_memory_budget_mb: int = _knob(
        "GPU memory the captured graphs may hold; cells beyond it run eagerly.", default=2048
    )
    max_batch_size: int = _knob(
        "Most inputs in one batch. Larger batches raise throughput under load but each one takes "
        "longer, which the inputs in it all wait for. 1 turns batching off (the baseline).",
        default=64,
    )
    max_batch_tokens: int = _knob(
        "Most padded tokens (longest input × inputs) in one batch: bounds the memory and time of one "
        "forward pass. Too low splits long inputs into small, inefficient batches.",
        default=16384,
    )
    max_queued_tokens: int = _knob(
        "Most tokens waiting per model. A request that would exceed it is answered 429 with "
        "Retry-After at once, so memory stays bounded and callers back off instead of timing out.",
        default=524288,
    )
    tenant_max_queued_tokens: int = _knob(
        "Most tokens one named tenant (API key or X-Tenant) may have waiting, so a flooding tenant is "
        "refused before it fills the model's queue. 0 = half of --max-queued-tokens. Requests with no "
        "tenant share the model-wide bound.",
        default=0,
    )
    batching: str = _knob(
        "Batching strategy: adaptive (dispatch when the model is free, size batches to the latency "
        "target), fixed (wait up to --max-wait-ms for --max-batch-size inputs, as the peers do), or "
        "none (one input per forward: the baseline).",
        default="adaptive",
    )
    target_latency_ms: float = _knob(
        "The p99 latency to keep: adaptive batching caps each batch so the oldest waiting input still "
        "finishes within it. Lower favours latency over throughput; once it is lost anyway (overload), "
        "batches go back to the size that clears the queue fastest.",
        default=500.0,
    )
    max_wait_ms: float | None = _knob(
        "fixed: the window to wait for a full batch (default 5). adaptive: hold a batch that is not full "
        "this long when more is due soon and the target allows (default 0, off): fewer, fuller batches "
        "cost less at the price of some latency.",
        default=None,
    )
    max_queue_wait_ms: float | None = _knob(
        "Sustained overload: while the queue stands (see --queue-target-ms), a request is admitted only "
        "if it is predicted to have its first result within nine tenths of this many ms of its head "
        "arriving (an admitted one is dropped 429 late only once it cannot make the whole) — the "
        "time it already waited (event loop, body), the queue ahead of it in fair order (a query behind "
        "a bulk request waits one share, not the whole bulk), and its own forward. The rest is answered "
        "429 overloaded with Retry-After at once, before tokenising where it can, so admitted requests "
        "keep their latency and a refusal costs little. Lower refuses more and keeps admitted latency "
        "lower (half the target kept the admitted p99 well within it at twice capacity in "
        "BENCHMARKS.md's overload runs, but a burst's callers, paced back by Retry-After into a queue "
        "that stood, then met a bound with little slack and some failed after their retries). "
        "Default: --target-latency-ms. 0 = off: no wait bound in either regime (then only "
        "--max-queued-tokens and deadlines refuse).",
        default=None,
    )
    burst_wait_ms: float = _knob(
        "Bursts: while the queue keeps emptying, a request is admitted as long as its first input is "
        "predicted to wait at most this many ms in the queue (429 queue_full beyond), so a "
        "one-off burst — a RAG ingestion's thousand chunks at once — is queued and served whole rather "
        "than refused. Longer absorbs bigger bursts, at the price of that much latency for the burst's "
        "tail (a sustained overload's start is admitted so too, until the queue stands: see "
        "--queue-interval-ms). Keep it under "
        "--request-timeout-ms (a request that cannot finish by its deadline is refused anyway). 20 s: "
        "a thousand one-chunk calls are about 5 s of work on an idle 2-core machine and took 10.8 s on "
        "a slow one (BENCHMARKS.md, overload), and a burst refused at the bound comes back paced by "
        "Retry-After, which takes longer than queueing it would have.",
        default=20000.0,
    )
    queue_target_ms: float | None = _knob(
        "When a queue stands (CoDel's target): once the oldest waiting input has waited longer than "
        "this for a whole --queue-interval-ms, the queue is not draining and admission switches from "
        "--burst-wait-ms to --max-queue-wait-ms; it switches back once nothing waits or arrivals fall a "
        "tenth below the model's rate. Lower detects overload sooner and treats more bursts as "
        "overload. Default: a quarter of --target-latency-ms.",
        default=None,
    )
    queue_interval_ms: float = _knob(
        "How long the queue must stand before admission tightens (CoDel's interval). Longer absorbs "
        "bursts that arrive over a longer time; shorter bounds how much of a sustained overload is "
        "admitted as a burst before its requests are refused. Once the queue stands, the requests it "
        "admits go before that backlog, so they keep the bound; once it has stood one interval more (an "
        "overload, not a burst's moment), what was admitted as a burst and can no longer start within "
        "the bound is answered 429 late, and a burst that stops arriving has its backlog served in "
        "order. Within eight intervals of standing, a queue that grows old again stands at once (the "
        "overload goes on). Measured "
        "(BENCHMARKS.md, 2026-12-05): 250 brought the soak's worst 2x phase from 725 to 582 ms and the "
        "2x step's p99 lower, but cost the 4x step goodput in every run.",
        default=500.0,
    )
    request_timeout_ms: float = _knob(
        "Default and cap of a request's deadline (X-Request-Timeout, ms). Requests past it, or that the "
        "cost model says cannot make it, are answered 504/503 and never computed.",
        default=30000.0,
    )
    interactive_batch_ms: float = _knob(
        "Bulk beside queries: a batch of a large request (over 4 inputs) is kept to about this many "
        "milliseconds of predicted compute, because a forward cannot be interrupted and a small request "
        "(a query) that arrives mid-batch waits for the rest of it; a query that fair order puts just "
        "behind a bulk input goes first (for up to this much compute between bulk batches). Shorter keeps "
        "queries quick beside ingestion and costs bulk throughput where a forward's fixed cost is large "
        "(on CPU little: a batch of 50 ms already amortises it; on a GPU the batch-size limit binds "
        "first); 0 = off (bulk batches as large as the other limits allow, fair order unchanged).",
        default=50.0,
    )
    priority_ratio: float = _knob(
        "X-Priority under load: while requests of different priorities wait together, each class gets "
        "this many times the tokens of the class below it (high:normal:low = R²:R:1; 4 gives 16:4:1), "
        "and a fresh high request goes ahead of normal and low ones however long they have waited. "
        "Larger makes priorities stricter under sustained load; smaller leaves more to the lower "
        "classes, which never get less than 1/(R²+R+1) (low) and R/(R²+R+1) (normal) of the model, so "
        "none starves. 1 = the classes share equally.",
        default=4.0,
    )
    api_keys_file: str | None = _knob(
        "File of API keys, one per line: KEY TENANT [WEIGHT]. With it, model routes need "
        "'Authorization: Bearer KEY'; the tenant shares the model by WEIGHT (default 1). /health, "
        "/ready and /metrics stay open.",
        default=None,
    )
    cache_mb: int = _knob(
        "MiB of results kept in an exact-match cache in front of the queue (least recently used out): a "
        "repeated input (same model, prompt, truncation and tokens) is answered without queueing. 0 "
        "turns it off. Identical inputs in flight at the same moment are computed once either way.",
        default=64,
    )
    max_inputs: int = _knob("Most inputs in one request (OpenAI allows 2048).", default=2048)
    max_body_bytes: int = _knob(
        "Largest request body accepted (413 beyond). The default fits 2048 long inputs.",
        default=16 * 1024 * 1024,
    )
    max_connections: int = _knob(
        "Most open client connections per process (each of --workers counts its own). A connection past "
        "it is answered at once, 503 with Retry-After and closed (GET /health, the liveness probe, gets "
        "200: a full process is busy, not dead), so clients and load balancers go elsewhere instead of "
        "waiting in the kernel's queue. Higher admits more idle keep-alive clients at a few KiB of memory "
        "and one file descriptor each; lowered at start-up to fit the file-descriptor limit.",
        default=10000,
    )
    keepalive_timeout_s: float = _knob(
        "Seconds an idle connection is kept open waiting for its next request (also the most a new "
        "connection may wait before sending a whole request head). Keep it above your load balancer's "
        "idle timeout (60 s on common ones) so the balancer closes first and never reuses a connection "
        "we are closing; lower frees idle clients' descriptors and memory sooner.",
        default=75.0,
    )
    header_timeout_s: float = _knob(
        "Seconds a request head (request line and headers) may take from its first byte; a client "
        "that trickles it (slowloris) is answered 408 and closed. Longer tolerates very slow links; "
        "shorter frees connections held by slow or stalled clients sooner.",
        default=10.0,
    )
    body_timeout_s: float = _knob(
        "Seconds the whole request body may take to arrive once the head is in; a slower or stalled "
        "sender is answered 408 and closed. The default lets a full --max-body-bytes body through at "
        "~0.6 MB/s; longer tolerates slower links, shorter frees connections held by slow senders sooner.",
        default=30.0,
    )
    max_header_bytes: int = _knob(
        "Longest request line, and longest header field (name and value), in bytes; longer is answered "
        "431. The default (aiohttp's, as most servers') fits bearer tokens and cookies; raise it for very "
        "large tokens, at the cost of memory a connection can hold before it is refused.",
        default=8190,
    )
    max_headers: int = _knob(
        "Most header fields in one request; more is answered 431. Bounds, with --max-header-bytes, what "
        "one request head can hold in memory.",
        default=128,
    )
    truncate: bool = _knob(
        "Truncate inputs longer than the model's maximum (the default, like OpenAI clients expect). "
        "--no-truncate answers 400 naming the input instead (the same as --long-input error).",
        default=True,
    )
    long_input: str | None = _knob(
        "What an embedding route does with an input longer than the model, unless the request says "
        "(long_input; or TEI's and Cohere's own truncate field): truncate (embed its beginning only: "
        "cheap, but the rest of the text is silently left out), chunk (split it into windows that fill "
        "the model, prompt and special tokens included, embed each as one more input of the request, "
        "and answer the token-weighted mean of the windows' pooled vectors, normalised if the model "
        "normalises: the whole text counts, at the cost of one forward row per window; for CLS or "
        "last-token pooling the same weighted mean of window vectors), or error (400 naming the "
        "input). Default: truncate, or error with --no-truncate.",
        default=None,
    )
    chunk_overlap: int = _knob(
        "Tokens each window of a chunked input repeats from the end of the one before (a request's "
        "chunk_overlap wins), so a sentence cut at a window's edge is read whole in one of them; costs "
        "that many more tokens per window. Must leave each window room for new text.",
        default=0,
    )
    max_input_tokens: int = _knob(
        "Most tokens of one chunked input (the text's own, prompt and special tokens not counted); a "
        "longer one is refused (400; TEI's routes 413) rather than queued. Bounds the work one input can "
        "ask for: 32,768 tokens of a 256-token model are 129 windows.",
        default=32768,
    )
    pipeline_depth: int = _knob(
        "Batches handed to the model thread at once: 2 prepares the next batch while one runs (worth "
        "it on a GPU, where a forward is short); 1 lets the next batch keep growing until the model is "
        "free (better latency on CPU). 0 = 2 on CUDA, 1 on CPU.",
        default=0,
    )
    cpu_forwards: int = _knob(
        "On the CPU (torch), batches run side by side, each its own forward on one core, instead of "
        "one forward at a time on every core. A small batch's operators split poorly over cores and "
        "each waits for its slowest part, which a busy event loop holds back; forwards side by side wait "
        "for nothing (python -m coalesce.loadtests.forward_lanes measures both; BENCHMARKS.md). A large "
        "batch alone runs longer on one core (a lone short request hardly); a queue drains faster. At "
        "most the cores. 0 = auto: 2 where torch's forward has exactly 2 cores and runs traced "
        "(--cpu-traced-forward: no interpreter lock between the forwards), else 1 (measured on 2 cores "
        "only: BENCHMARKS.md, overload section). 1 = one at a time (--loop-core-share then applies); no "
        "effect on a GPU or the torch-free backends.",
        default=0,
    )
    shutdown_grace_s: float = _knob(
        "After SIGTERM, seconds to keep accepting new connections while the platform removes this "
        "replica from its endpoints (readiness is already 503). Longer loses fewer racing requests; "
        "shorter stops sooner.",
        default=5.0,
    )
    drain_timeout_s: float = _knob(
        "After the grace delay, seconds to let queued and running requests finish; whatever is left "
        "then is answered 503 so no caller hangs. Keep grace + drain under the platform's kill delay.",
        default=20.0,
    )
    workers: int = _knob(
        "HTTP gateway processes. 1 (the default) serves everything in one process. N >= 2 starts N "
        "gateways sharing the port (HTTP, JSON, tokenising) in front of one engine process that holds "
        "the models and their queues, so inputs from every gateway still coalesce into the same "
        "batches. One event loop tops out near a thousand small requests per second per core, so a fast "
        "GPU needs several gateways; on a small CPU keep 1 (the processes take cores from the model). "
        f"auto: {AUTO_WORKERS_MAX} (at most half the cores) when a CUDA device will run the models, else "
        "1; decided without importing torch, and logged (workers_auto). "
        "One scrape of any gateway reports the whole replica.",
        default=1,
        parse=parse_workers,
    )
    runner_factory: str | None = _knob(
        "MODULE:CALLABLE that builds each model's runner from its spec, instead of loading it (tests "
        "and benchmarks: e.g. coalesce.loadtests.nullmodel:factory serves a forward that costs nothing).",
        default=None,
    )
    role: str = _knob(
        "all (one process), or, set by the --workers supervisor for its children: engine or gateway. "
        "Not for direct use.",
        default="all",
    )
    engine_dir: str | None = _knob(
        "Private directory of the engine's sockets (set by the --workers supervisor).", default=None
    )
    worker_id: int = _knob(
        "Which gateway this process is, 0..N-1 (set by the --workers supervisor; logged on every line).",
        default=0,
    )
    reuse_port: bool = _knob(
        "Listen with SO_REUSEPORT and only once the models are ready, so that several processes share "
        "the port and none is handed a connection before it can serve (set for each of --workers).",
        default=False,
    )
    allocator: str = _knob(
        "Memory allocator. auto: run on jemalloc when it is installed (Debian/Ubuntu libjemalloc2; the "
        "images preload it), by re-executing the server once at start-up with it in LD_PRELOAD: its "
        "background purge keeps resident memory level under load of ever-changing shapes, where glibc's "
        "malloc creeps up for hours; the engine keeps its forwards' freed pages between batches and "
        "purges every 10 s under load instead (with our MALLOC_CONF). Without it: glibc with 2 arenas, "
        "and freed memory "
        "handed back after batches (malloc_trim, a few ms at most every 10 s under load). jemalloc: the "
        "same, but exit if it cannot be loaded. glibc: no re-exec, glibc so tuned. system: malloc as the "
        "process started (your own LD_PRELOAD, or to measure glibc untouched). The start-up log's "
        "'allocator' line says which ran.",
        default="auto",
    )
    otlp_endpoint: str | None = _knob(
        "OpenTelemetry collector to send traces to, over OTLP/HTTP protobuf (e.g. http://collector:4318; "
        "/v1/traces is appended). Off when unset (also read from OTEL_EXPORTER_OTLP_ENDPOINT): then "
        "OpenTelemetry is not even imported. On: a span per request in the caller's W3C trace, and one "
        "per batch linked to every request it computed; sampling follows OTEL_TRACES_SAMPLER (default "
        "parent-based). Costs CPU per sampled request; spans are flushed at the end of the drain.",
        default=None,
    )
    otlp_service_name: str = _knob(
        "The service.name of exported spans (also read from OTEL_SERVICE_NAME).", default="coalesce"
    )
    log_level: str = _knob("Log level: debug logs one line per request and per batch.", default="info")
    log_format: str = _knob("Log format: json (for collectors) or console (for people).", default="json")

    @property
    def default_long_input(self) -> str:
        """What a request that does not say gets for an input longer than the model (``--long-input``;
        without it, truncate, or error under ``--no-truncate``)."""
        return self.long_input or ("truncate" if self.truncate else "error")

    @property
    def model_specs(self) -> tuple[ModelSpec, ...]:
        """Models with the single-model ``--served-model-name`` and any ``--task`` applied."""
        specs = self.models
        if self.served_model_name and len(self.models) == 1 and self.models[0].name is None:
            specs = (ModelSpec(self.served_model_name, self.models[0].path),)
        tasks, templates = dict(self.tasks), dict(self.rerank_templates)
        specs = tuple(dataclasses.replace(m, task=tasks[m.name]) if m.name in tasks else m for m in specs)
        return tuple(dataclasses.replace(m, task="rerank", rerank_template=templates[m.name])
                     if m.name in templates else m for m in specs)


def _flag(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("flag", "--" + f.name.replace("_", "-")))


def _env_name(f: dataclasses.Field[Any]) -> str:
    return ENV_PREFIX + _flag(f).lstrip("-").replace("-", "_").upper()


def env_name(knob: str) -> str:
    """The environment variable of the Settings field ``knob`` (``COALESCE_...``)."""
    return _env_name(next(f for f in dataclasses.fields(Settings) if f.name == knob))


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


def _converter(f: dataclasses.Field[Any]) -> Any:
    if "parse" in f.metadata:
        return f.metadata["parse"]
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind.startswith("int") and "tuple" not in kind:
        return int
    if kind.startswith("float"):
        return float
    if kind.startswith("tuple[int"):
        return _int_tuple
    if kind.startswith("bool"):
        return _parse_bool
    return str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare every Settings knob on ``parser``; defaults are left None so the environment can fill them."""
    for f in dataclasses.fields(Settings):
        help_text = f"{f.metadata['help']} [env {_env_name(f)}]"
        kind = f.type if isinstance(f.type, str) else str(f.type)
        if kind.startswith("bool"):
            parser.add_argument(
                _flag(f), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif f.metadata.get("repeat"):
            parser.add_argument(
                _flag(f),
                dest=f.name,
                action="append",
                type=_converter(f),
                default=None,
                help=help_text,
                metavar=_flag(f).lstrip("-").upper(),
            )
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            parser.add_argument(
                _flag(f),
                dest=f.name,
                type=_converter(f),
                default=None,
                help=f"{help_text} (default: {default})",
            )


# Knobs that also honour a platform's or OpenTelemetry's own variable, below their COALESCE_* one.
_FOREIGN_ENV = {
    "port": "PORT",
    "otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "otlp_service_name": "OTEL_SERVICE_NAME",
}


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags over ``COALESCE_*`` environment over defaults. ``PORT`` is honoured for the port, and
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` and ``OTEL_SERVICE_NAME`` for the tracing knobs."""
    env = dict(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        given = getattr(args, f.name, None)
        if given is None:
            raw = env.get(_env_name(f))
            if raw is None and f.name in _FOREIGN_ENV:
                raw = env.get(_FOREIGN_ENV[f.name])
            if raw is None:
                continue
            convert = _converter(f)
            try:
                given = (
                    [convert(p) for p in raw.split(";") if p] if f.metadata.get("repeat") else convert(raw)
                )
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise SystemExit(f"invalid {_env_name(f)}={raw!r}: {exc}") from exc
        if f.metadata.get("repeat"):
            given = tuple(given)
        values[f.name] = given
    settings = Settings(**values)
    _validate(settings)
    return settings


def build(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from a command line (without the ``serve`` word) and an environment."""
    parser = argparse.ArgumentParser(prog="coalesce serve")
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)), environ)


def _validate(s: Settings) -> None:
    problems = []
    for name in ("max_batch_size", "max_batch_tokens", "max_queued_tokens", "max_inputs", "max_body_bytes",
                 "max_connections", "max_header_bytes", "max_headers"):
        if getattr(s, name) < 1:
            problems.append(f"{name} must be at least 1")
    if s.cache_mb < 0:
        problems.append("cache_mb must be >= 0")
    if s.dtype not in ("auto", "float32", "fp32", "float16", "fp16", "half", "bfloat16", "bf16"):
        problems.append("dtype must be auto, float32, float16 or bfloat16")
    if s.backend not in ("auto", "torch", "onnx", "openvino"):
        problems.append("backend must be auto, torch, onnx or openvino")
    elif s.backend in ("onnx", "openvino") and s.device.startswith("cuda"):
        problems.append(f"the {s.backend} backend runs on the CPU: use --device cpu or auto, "
                        "or --backend torch")
    if s.graph_capture_budget_s < 0 or s.graph_memory_budget_mb < 0:
        problems.append("graph capture budgets must be >= 0")
    if s.batching not in ("adaptive", "fixed", "none"):
        problems.append("batching must be adaptive, fixed or none")
    if s.target_latency_ms <= 0 or s.request_timeout_ms <= 0:
        problems.append("target_latency_ms and request_timeout_ms must be > 0")
    if s.max_queue_wait_ms is not None and s.max_queue_wait_ms < 0:
        problems.append("max_queue_wait_ms must be >= 0")
    if s.burst_wait_ms < 0 or s.queue_interval_ms < 0 or (s.queue_target_ms or 0) < 0:
        problems.append("burst_wait_ms, queue_target_ms and queue_interval_ms must be >= 0")
    if s.interactive_batch_ms < 0:
        problems.append("interactive_batch_ms must be >= 0")
    if s.priority_ratio < 1:
        problems.append("priority_ratio must be >= 1")
    if s.max_wait_ms is not None and s.max_wait_ms < 0:
        problems.append("max_wait_ms must be >= 0")
    if s.tenant_max_queued_tokens < 0:
        problems.append("tenant_max_queued_tokens must be >= 0")
    if min(s.keepalive_timeout_s, s.header_timeout_s, s.body_timeout_s) <= 0:
        problems.append("keepalive_timeout_s, header_timeout_s and body_timeout_s must be > 0")
    if s.shutdown_grace_s < 0 or s.drain_timeout_s < 0:
        problems.append("shutdown_grace_s and drain_timeout_s must be >= 0")
    if not 0 <= s.pipeline_depth <= 4:
        problems.append("pipeline_depth must be 0..4")
    if not 0 <= s.cpu_forwards <= 64:
        problems.append("cpu_forwards must be 0..64 (0: auto)")
    if not (1 <= s.workers <= 64 or s.workers == WORKERS_AUTO):
        problems.append("workers must be auto or 1..64")
    if s.role not in ("all", "engine", "gateway"):
        problems.append("role must be all, engine or gateway")
    if s.runner_factory is not None and ":" not in s.runner_factory:
        problems.append("runner_factory must be MODULE:CALLABLE")
    if not 0 < s.port < 65536:
        problems.append("port must be 1..65535")
    if s.allocator not in ALLOCATORS:
        problems.append("allocator must be auto, jemalloc, glibc or system")
    if not 0 <= s.loop_core_share <= 1:
        problems.append("loop_core_share must be between 0 and 1 (0: off)")
    if s.switch_interval_ms < 0:
        problems.append("switch_interval_ms must be >= 0 (0: Python's default)")
    if s.cpu_kernel_cache < 0:
        problems.append("cpu_kernel_cache must be >= 0 (0: the libraries' defaults)")
    if s.log_format not in ("json", "console"):
        problems.append("log_format must be json or console")
    names = [m.name for m in s.model_specs if m.name]
    if len(names) != len(set(names)):
        problems.append("served model names must be unique")
    unknown = sorted({name for name, _ in s.tasks} - set(names))
    if unknown:
        problems.append(f"--task names {', '.join(unknown)}, not a served model name (use --model NAME=PATH)")
    for flag, named in (("--rerank-instruction", s.rerank_instructions),
                        ("--rerank-template", s.rerank_templates)):
        unknown = sorted({name for name, _ in named} - set(names))
        if unknown:
            problems.append(f"{flag} names {', '.join(unknown)}, not a served model name "
                            "(use --model NAME=PATH)")
    tasks = dict(s.tasks)
    conflicting = sorted(name for name, _ in s.rerank_templates if tasks.get(name, "rerank") != "rerank")
    if conflicting:
        problems.append(f"--rerank-template serves {', '.join(conflicting)} as a reranker; its --task says "
                        "otherwise")
    if s.max_rerank_tokens is not None and s.max_rerank_tokens < 1:
        problems.append("max_rerank_tokens must be at least 1")
    if s.long_input is not None and s.long_input not in LONG_INPUTS:
        problems.append("long_input must be truncate, chunk or error")
    elif not s.truncate and s.long_input not in (None, "error"):
        problems.append(f"--no-truncate contradicts --long-input {s.long_input}: give one of them")
    if s.chunk_overlap < 0 or s.max_input_tokens < 1:
        problems.append("chunk_overlap must be >= 0 and max_input_tokens at least 1")
    if problems:
        raise SystemExit("invalid settings: " + "; ".join(problems))
