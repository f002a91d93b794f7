#!/usr/bin/env bash
# The GPU session in one call, on the lent GPU machine, from the repository root, with the bundle that
# `make gpu-bundle` built here carried along (device run, carry [".gpu"]):
#
#     bash kernels/gpu_session.sh
#
# Installs the bundle's wheels, writes random weights into its model directory, runs the GPU tests, the
# engine alone on this host's CPU (engine_ops, engine_ceiling) and then gpu_check (correctness, capture
# cost, latency table, service throughput) against that model, with py-spy sampling the first
# multi-process row's engine under load (`--workers auto`; when the bundle carries py-spy, as
# `make gpu-bundle` packs it).
#
# Device time: at most 565 s of script (the step limits below, their kill graces included); on the H200
# of 2026-12-04 07:05 the whole script took 118 s (the GPU tests 29 s, gpu_check with three services
# about 75 s; engine_ops, added since, takes about 30 s, and engine_ceiling's null-model rows about 25 s
# on the 2-core CPU machine, its two rows on the GPU's forward an engine start each on top); the
# machine's start comes on top. Give the device call a limit of 600 s (the most a call may have), so
# that this script's own limits, not the call's, are the ones that fire:
#     install 40 s, weights 60 s, nvidia-smi 10 s, GPU tests 90 s, engine_ops 3x30 s, engine_ceiling 45 s
#     and 60 s, gpu_check 140 s (+ 2-3 s kill grace each)
# (install and weights were 15 s and 20 s until a fresh machine's first imports ran past them, silently:
# a failed step now says which and when, in machine.txt too; the GPU tests' 45 s killed the last test
# at 13:30 the same day, on a machine whose host side ran 2.3x slower: alone they took 42 s there).
# gpu_check stops starting work 12 s before its limit (--time-limit-s), and waits at most 40 s for a
# service to be ready; the service rows that would end past its limit are skipped, saying so.
#
# Everything lands in $OUT (or ./gpu-out) as it happens, so a step killed by its limit keeps what it
# finished: machine.txt, gpu-tests.log, gpu_check's sections (header.txt, correctness.txt, capture.txt,
# latency.txt, service.txt; a line at a time), its status.txt (complete, or where it stopped), the
# services' logs (service-1.log, service-2.log), gpu-check.err (progress and warnings), engine-ops.txt
# (engine_ops' rows, then engine_ceiling's: the null model's, then the GPU forward's),
# and engine-gil.raw with engine-py-spy.log (`python -m coalesce.loadtests.pyspy_summary` reads the first).
# GPU_CHECK_ARGS adds gpu_check flags, last, so they override (a CPU dry run: GPU_CHECK_ARGS="--device cpu ...").
set -uo pipefail
name=gpu_session
# shellcheck source=kernels/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"
prepare

# -v: one line per test as it finishes, so a kill keeps the verdicts so far.
COALESCE_GPU_MODEL="$model" timeout -k 3 90 "$py" -m pytest -m gpu tests/gpu -v --tb=short \
    -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
tests=$?
engine_ops

# gpu_check writes each section to $out as it goes; the services it starts log to $out/service-N.log.
# The service runs three times: one process, then `--workers auto` (4 gateways on a 16-core GPU host: the
# CPU line's "gateways ×N" says what it chose there) and 8 gateways, in front of one engine process:
# one event loop caps small requests/s, and the engine's one queue keeps batches whole.
# Each row gives throughput, mean batch size, and the GPU memory in use. `$serve` (gpu_lib's prepare)
# gives a short start-up capture budget: cells not captured by then are captured lazily under load.
# py-spy (when carried) samples the first row's engine under load: `--workers auto`'s.
sample_engine engine 100 5 &
sampler=$!
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
timeout -k 3 140 "$py" -m coalesce.loadtests.gpu.check --st-model "$model" --out "$out" \
    --time-limit-s 128 --service-ready-s 40 --capture-budget-s 10 --seconds-per-case 0.25 \
    --service-seconds 3 --concurrency 64,256 --service-cmd "$serve" \
    --service-cmd "$serve --workers ${GPU_WORKERS:-auto}" --service-cmd "$serve --workers ${GPU_WORKERS_MAX:-8}" \
    ${GPU_CHECK_ARGS:-} 2> >(tee "$out/gpu-check.err" >&2)
check=$?
kill "$sampler" 2>/dev/null  # (still waiting for an engine under load: there will be none now)
wait "$sampler" 2>/dev/null
reap_service
echo "gpu tests: exit $tests; gpu_check: exit $check ($(cat "$out/status.txt" 2>/dev/null)); $((SECONDS - started)) s"
exit $(( tests || check ))
