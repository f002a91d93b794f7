# Sourced by kernels/gpu_session.sh, gpu_ab.sh and gpu_engine_profile.sh (the GPU machine's one-call
# scripts): the steps they share. The caller sets `set -uo pipefail` and `name` (its own, for messages);
# this sets out, bundle, py, site and started from the environment as the scripts document them.
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
# the card's name, driver, memory and clocks into machine.txt (read, never set); $serve, the service's
# command line on that model as every script starts it (gpu_check fills in {port}; add --workers).
prepare() {
    timeout -k 2 40 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$bundle"/whl/*.whl || step install $?
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    model=$(realpath "$bundle/model")
    timeout -k 2 60 "$py" -m coalesce.loadtests.gpu.bundle weights "$model" || step weights $?
    serve="$py -m coalesce.service.cli serve --port {port} --model all-MiniLM-L6-v2=$model"
    serve="$serve --log-level warning --shutdown-grace-s 0 --graph-capture-budget-s 5"
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

# The engine alone on this host's CPU (coalesce.loadtests.engine_ops: no sockets, no model), at one-
# request messages from 8 and from 48 gateways, and at 48 as the service runs it (result cache on,
# metrics shared between processes), into $out/engine-ops.txt: the engine's own Python per request and
# per batch here, beside what a request costs the engine process in the service rows.
engine_ops() {
    # The bundle's model (its tokenizer; the forward is skipped): the device has no embedded default.
    local ops="$py -m coalesce.loadtests.engine_ops --jobs 1 --model $model"  # (split on purpose)
    # shellcheck disable=SC2086
    {
        timeout -k 2 30 $ops --gateways 8 --rounds 2000
        timeout -k 2 30 $ops --gateways 48 --rounds 400
        timeout -k 2 30 $ops --gateways 48 --rounds 400 --cache-mb 64 --shared-metrics
        # One engine process fed over its sockets by 15 gateways' clients until it is the busy process
        # (this host's CPU; the forward costs nothing): what it takes at 1, 2 and 4 requests in flight each.
        timeout -k 2 45 "$py" -m coalesce.loadtests.engine_ceiling --gateways 15 --outstanding 1,2,4 \
            --seconds 3 --model "$model"
        # The same engine running the model's own forward on the GPU (graphs captured within 5 s, as
        # $serve's): what the device's own CPU work (launches, copies, the wait) adds to a request.
        timeout -k 2 60 "$py" -m coalesce.loadtests.engine_ceiling --gateways 15 --outstanding 2,4 \
            --seconds 3 --model "$model" --real --serve-arg=--graph-capture-budget-s --serve-arg=5
    } > "$out/engine-ops.txt" 2>&1
    cat "$out/engine-ops.txt"
}

# Run in the background beside gpu_check: waits up to $2 s for an engine process (`--role engine`)
# whose load clients are running, then samples it for $3 s with py-spy (carried as $bundle/py-spy;
# without it, says so and returns), into $out/$1-gil.raw (the thread holding the interpreter lock: what
# caps the one engine) and, when $4 is given, $4 s more of every busy thread into $out/$1-all.raw.
# `python -m coalesce.loadtests.pyspy_summary FILE` reads them.
sample_engine() {
    local spy="$bundle/py-spy" engine="" clients=""
    if [ ! -x "$spy" ]; then
        echo "no $spy: the engine is not sampled"
        return 0
    fi
    for _ in $(seq "$2"); do
        engine=$(pgrep -f -- "--role engine" | head -1)
        clients=$(pgrep -f -- "gpu.service_load client" | head -1)
        [ -n "$engine" ] && [ -n "$clients" ] && break
        sleep 1
    done
    if [ -z "$engine" ] || [ -z "$clients" ]; then
        echo "no engine process under load to sample (engine '$engine', clients '$clients')"
        return 0
    fi
    sleep 1
    timeout -k 2 $(($3 + 5)) "$spy" record -p "$engine" -r 250 -d "$3" --nonblocking --gil -f raw \
        -o "$out/$1-gil.raw" > "$out/$1-py-spy.log" 2>&1
    if [ -n "${4:-}" ]; then
        timeout -k 2 $(($4 + 5)) "$spy" record -p "$engine" -r 250 -d "$4" --nonblocking -f raw \
            -o "$out/$1-all.raw" >> "$out/$1-py-spy.log" 2>&1
    fi
    echo "sampled engine $engine: $(grep Samples "$out/$1-py-spy.log" | tr "\n" " ")"
}
