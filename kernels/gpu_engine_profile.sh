#!/usr/bin/env bash
# Where the engine process's CPU goes on the lent GPU machine, in one call (issue 25): the engine alone
# (`coalesce.loadtests.engine_ops`, no sockets, no model), then the service under load with py-spy
# sampling its engine process. Prepared here:
#
#     make gpu-bundle && cp "$(command -v py-spy)" .gpu/py-spy    # (py-spy: pip install py-spy)
#
# then one device call with .gpu carried: `bash kernels/gpu_engine_profile.sh`. Without .gpu/py-spy the
# service still runs, unsampled. Output in $OUT: machine.txt, engine-ops.txt, service.txt (gpu_check's
# row with its CPU split), engine-gil.raw (samples of the thread holding the GIL: where the engine's one
# interpreter lock goes) and engine-all.raw (every thread, idle ones left out), folded stacks as
# `py-spy record --format raw` writes them; `python -m coalesce.loadtests.pyspy_summary FILE` reads one.
#
# Device time: at most 40 + 60 + 10 + 2x40 + 100 s of script; expected about 100 s on an H200, the
# machine's start on top. Give the device call a limit of 320 s or more.
# GPU_PROFILE_WORKERS (default 8) and GPU_PROFILE_CLIENTS (default 256) shape the load.
set -uo pipefail
name=gpu_engine_profile
# shellcheck source=kernels/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
prepare

{
    timeout -k 2 40 "$py" -m coalesce.loadtests.engine_ops --gateways 8 --jobs 1,4 --rounds 2000
    timeout -k 2 40 "$py" -m coalesce.loadtests.engine_ops --gateways 48 --jobs 1 --rounds 400
} 2>&1 | tee "$out/engine-ops.txt"

workers=${GPU_PROFILE_WORKERS:-8}
serve="$py -m coalesce.service.cli serve --port {port} --model all-MiniLM-L6-v2=$model"
serve="$serve --log-level warning --shutdown-grace-s 0 --graph-capture-budget-s 5 --workers $workers"
timeout -k 3 100 "$py" -m coalesce.loadtests.gpu.check --sections service --out "$out" \
    --time-limit-s 90 --service-ready-s 40 --service-seconds 24 --concurrency "${GPU_PROFILE_CLIENTS:-256}" \
    --service-cmd "$serve" 2> "$out/gpu-check.err" &
check_pid=$!

spy="$bundle/py-spy"
if [ -x "$spy" ]; then
    # The engine is up once gpu_check's clients have started: wait for them, then sample mid-run.
    for _ in $(seq 90); do
        engine=$(pgrep -f -- "--role engine" | head -1)
        clients=$(pgrep -f -- "gpu.service_load client" | head -1)
        [ -n "$engine" ] && [ -n "$clients" ] && break
        sleep 1
    done
    if [ -n "${engine:-}" ] && [ -n "${clients:-}" ]; then
        sleep 3
        timeout -k 2 14 "$spy" record -p "$engine" -r 200 -d 9 --nonblocking --gil -f raw \
            -o "$out/engine-gil.raw" > "$out/py-spy.log" 2>&1
        timeout -k 2 14 "$spy" record -p "$engine" -r 200 -d 9 --nonblocking -f raw \
            -o "$out/engine-all.raw" >> "$out/py-spy.log" 2>&1
        tail -3 "$out/py-spy.log"
    else
        echo "no engine process under load to sample (engine '${engine:-}', clients '${clients:-}')"
    fi
else
    echo "no $spy: the service runs unsampled"
fi
wait "$check_pid"
check=$?
reap_service
echo "gpu_check: exit $check ($(cat "$out/status.txt" 2>/dev/null)); $((SECONDS - started)) s"
exit $check
