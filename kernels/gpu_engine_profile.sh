#!/usr/bin/env bash
# Where the engine process's CPU goes on the lent GPU machine, in one call (issue 25): the engine alone
# (`coalesce.loadtests.engine_ops`, no sockets, no model), then the service under load with py-spy
# sampling its engine process (issue 25: one engine process, at about one core, capped the H200 replica
# of 2026-12-04). Prepared here with `make gpu-bundle` (it packs .gpu/py-spy), then one device call with
# .gpu carried: `bash kernels/gpu_engine_profile.sh`. Without .gpu/py-spy the service runs unsampled.
# `kernels/gpu_session.sh` samples its `--workers auto` row the same way, for 5 s; this is the longer look.
# Output in $OUT: machine.txt, engine-ops.txt, service.txt (gpu_check's row with its CPU split),
# engine-gil.raw (samples of the thread holding the GIL: where the engine's one interpreter lock goes)
# and engine-all.raw (every thread, idle ones left out), folded stacks as `py-spy record --format raw`
# writes them; `python -m coalesce.loadtests.pyspy_summary FILE` reads one.
#
# Device time: at most 40 + 60 + 10 + 3x30 + 100 s of script (+ kill graces); expected about 110 s on an
# H200, the machine's start on top. Give the device call a limit of 340 s or more.
# GPU_PROFILE_WORKERS (default 8) and GPU_PROFILE_CLIENTS (default 256) shape the load.
set -uo pipefail
name=gpu_engine_profile
# shellcheck source=kernels/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
prepare
engine_ops

workers=${GPU_PROFILE_WORKERS:-8}
sample_engine engine 60 9 9 &
sampler=$!
timeout -k 3 100 "$py" -m coalesce.loadtests.gpu.check --sections service --out "$out" \
    --time-limit-s 90 --service-ready-s 40 --service-seconds 24 --concurrency "${GPU_PROFILE_CLIENTS:-256}" \
    --service-cmd "$serve --workers $workers" 2> "$out/gpu-check.err"
check=$?
kill "$sampler" 2>/dev/null  # (still waiting for an engine under load: there will be none now)
wait "$sampler" 2>/dev/null
reap_service
echo "gpu_check: exit $check ($(cat "$out/status.txt" 2>/dev/null)); $((SECONDS - started)) s"
exit $check
