# Sourced by kernels/gpu_session.sh and kernels/gpu_ab.sh (the GPU machine's one-call scripts): the
# steps they share. The caller sets `set -uo pipefail` and `name` (its own, for messages); this sets
# out, bundle, py, site and started from the environment as both scripts document them.
out=${OUT:-gpu-out}
bundle=${GPU_BUNDLE:-.gpu}
py=${PYTHON:-python3}
site=${GPU_SITE:-/tmp/coalesce-site}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
started=$SECONDS

# A step that failed says which and when (machine.txt too: it comes back when the output does not).
step() { echo "$name: $1 failed (exit $2) after $((SECONDS - started)) s" | tee -a "$out/machine.txt"; exit 1; }

# The bundle's wheels into $site, first on PYTHONPATH; random weights into its model directory ($model);
# the card's name, driver, memory and clocks into machine.txt (read, never set).
prepare() {
    timeout -k 2 40 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$bundle"/whl/*.whl || step install $?
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    model=$(realpath "$bundle/model")
    timeout -k 2 60 "$py" -m coalesce.loadtests.gpu.bundle weights "$model" || step weights $?
    timeout -k 2 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv > "$out/machine.txt" 2>&1 || echo "no nvidia-smi" >> "$out/machine.txt"
    cat "$out/machine.txt"
}

# gpu_check stops its service on exit and on SIGTERM; after a SIGKILL (the kill grace ran out) the
# service, in its own session, would outlive it: its process group id is left behind for this.
reap_service() {
    if [ -s "$out/service.pgid" ]; then
        kill -KILL -- "-$(cat "$out/service.pgid")" 2>/dev/null
        echo "killed a service gpu_check left behind (process group $(cat "$out/service.pgid"))"
        rm -f "$out/service.pgid"
    fi
}
