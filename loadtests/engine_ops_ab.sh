#!/usr/bin/env bash
# The engine's own path (`python -m coalesce.loadtests.engine_ops`), this checkout's code beside an
# earlier commit's, alternated in one run on this machine (current, baseline, current, ...), so that a
# change to the per-request path is read as ratios within one run on a noisy VM:
#
#     bash loadtests/engine_ops_ab.sh REV [ROUNDS] [engine_ops flags ...]
#
# REV is built into a wheel and installed into a directory of its own, first on PYTHONPATH for the
# baseline's runs (baseline_site.sh). ROUNDS (default 3) pairs; the
# flags default to the service's case behind many gateways: `--jobs 1 --gateways 48 --rounds 400
# --cache-mb 64 --shared-metrics`. Prints one line per run: round, which code, engine_ops' row; with
# `--ops`, then the Python bytecodes and function calls per request it counted, at the last `--jobs` (the
# same on any machine: a change's effect on the engine's Python read without the VM's noise).
set -euo pipefail
rev=${1:?usage: bash loadtests/engine_ops_ab.sh REV [ROUNDS] [engine_ops flags ...]}
rounds=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--jobs 1 --gateways 48 --rounds 400 --cache-mb 64 --shared-metrics)
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$(dirname "$0")/baseline_site.sh"
baseline_site "$rev" "$work"
run() {  # $1: current or baseline
    local env=()
    [ "$1" = current ] || env=(env "PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}")
    "${env[@]}" "$py" -m coalesce.loadtests.engine_ops "${flags[@]}" 2>&1 | awk '
        /requests\/message/ { getline; row = $0 }
        /Python bytecodes/ { for (i = 1; i <= NF; i++) if ($(i + 1) == "Python") { n = n " " $i; i++ } }
        END { print row n }'
}
ops=
for flag in "${flags[@]}"; do [ "$flag" = --ops ] && ops=" bytecodes/request calls/request"; done
echo "round code     requests/message batches/message inputs/batch threaded_us/request inline_us/request hand-off_us/batch$ops"
for r in $(seq "$rounds"); do
    for code in current baseline; do
        printf '%-5s %-8s %s\n' "$r" "$code" "$(HF_HUB_OFFLINE=1 run "$code")"
    done
done
