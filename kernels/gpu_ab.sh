#!/usr/bin/env bash
# The service on the lent GPU machine, this checkout's code beside an earlier commit's, in one call: the
# same random-weight model, the same load, the two servers alternated (current, baseline, current, ...)
# so that a ratio between them is read within one run. Prepared here:
#
#     make gpu-bundle && .venv/bin/python -m coalesce.loadtests.gpu.bundle baseline .gpu REV
#
# then one device call with .gpu carried: `bash kernels/gpu_ab.sh`. Each service row carries its CPU
# split (engine, gateways and their event loops, the load clients). No GPU tests and no latency table:
# `kernels/gpu_session.sh` is the whole check; this is the side-by-side of the service alone.
#
# Device time: at most 40 + 20 + 60 + 10 + 160 s of script (+ kill graces); expected about 2.5 minutes
# on an H200, the machine's start on top. Give the device call a limit of 330 s or more.
# GPU_AB_WORKERS (default "8 4") lists the --workers values; each is run current, baseline, and the
# first once more at the end (both servers) when time allows. GPU_AB_CLIENTS: concurrency (256,512).
set -uo pipefail
name=gpu_ab
# shellcheck source=kernels/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
base=${GPU_BASE_SITE:-/tmp/coalesce-base}
[ -n "$(ls "$bundle"/base/coalesce-*.whl 2>/dev/null)" ] || step "finding $bundle/base/coalesce-*.whl" 2
prepare
timeout -k 2 20 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$base" "$bundle"/base/coalesce-*.whl || step "baseline install" $?

# The baseline's package first on its path, the bundle's dependencies after it.
current="env PYTHONPATH=$site $serve"
baseline="env PYTHONPATH=$base:$site $serve"
cmds=()
read -ra workers <<< "${GPU_AB_WORKERS:-8 4}"
for w in "${workers[@]}"; do
    cmds+=(--service-cmd "$current --workers $w" --service-cmd "$baseline --workers $w")
done
cmds+=(--service-cmd "$baseline --workers ${workers[0]}" --service-cmd "$current --workers ${workers[0]}")
timeout -k 3 160 "$py" -m coalesce.loadtests.gpu.check --sections service --out "$out" \
    --time-limit-s 148 --service-ready-s 40 --service-seconds 3 --concurrency "${GPU_AB_CLIENTS:-256,512}" \
    "${cmds[@]}" 2> >(tee "$out/gpu-check.err" >&2)
check=$?
reap_service
echo "gpu_check: exit $check ($(cat "$out/status.txt" 2>/dev/null)); $((SECONDS - started)) s"
exit $check
