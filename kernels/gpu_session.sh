#!/usr/bin/env bash
# The GPU session in one call, on the lent GPU machine, from the repository root, with the bundle that
# `make gpu-bundle` built here carried along (device run, carry [".gpu"]):
#
#     bash kernels/gpu_session.sh
#
# Installs the bundle's wheels, writes random weights into its model directory, runs the GPU tests and
# then gpu_check (correctness, capture cost, latency table, service throughput) against that model.
# Under 4 minutes on an H200. Logs go to $OUT (or ./gpu-out); gpu_check's table prints last.
# GPU_CHECK_ARGS adds gpu_check flags (a dry run here: GPU_CHECK_ARGS="--device cpu ...").
set -uo pipefail
out=${OUT:-gpu-out}
bundle=${GPU_BUNDLE:-.gpu}
py=${PYTHON:-python3}
site=${GPU_SITE:-/tmp/coalesce-site}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$bundle"/whl/*.whl || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
model=$(realpath "$bundle/model")
"$py" -m coalesce.kernels.gpu_bundle weights "$model" || exit 1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
        || echo "no nvidia-smi"
    "$py" -c 'import platform, torch, transformers, sentence_transformers as st
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "sentence-transformers", st.__version__)'
} 2>&1 | tee "$out/machine.txt"

COALESCE_GPU_MODEL="$model" timeout 90 "$py" -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    2>&1 | tee "$out/gpu-tests.log"
tests=$?

# Progress (stderr) shows as it happens and is kept; the table (stdout) prints once, at the end.
# The service runs twice, one process and four (--workers): one event loop caps small requests/s.
serve="$py -m coalesce.service.cli serve --port {port} --model all-MiniLM-L6-v2=$model"
serve="$serve --log-level warning --shutdown-grace-s 0"
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
timeout 210 "$py" -m coalesce.kernels.gpu_check --st-model "$model" --service-seconds 6 \
    --service-cmd "$serve" --service-cmd "$serve --workers ${GPU_WORKERS:-4}" \
    ${GPU_CHECK_ARGS:-} 2> >(tee "$out/gpu-check.err" >&2) | tee "$out/gpu-check.txt"
check=$?
echo "gpu tests: exit $tests; gpu_check: exit $check"
exit $(( tests || check ))
