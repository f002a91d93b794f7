#!/usr/bin/env bash
# One process's request path (`python -m coalesce.loadtests.gateway_ops`: the Python bytecodes its event
# loop executes a request), this checkout's service beside an earlier commit's, alternated in one run:
#
#     bash loadtests/gateway_ops_ab.sh REV [ROUNDS] [gateway_ops flags ...]
#
# REV is built into a wheel and installed into a directory of its own, first on the server's PYTHONPATH
# for the baseline's runs (baseline_site.sh; the counting driver is this checkout's). ROUNDS (default 2)
# pairs. Prints one line per run: round, which code, requests answered, bytecodes and calls a request, and
# the three packages that execute the most.
set -euo pipefail
rev=${1:?usage: bash loadtests/gateway_ops_ab.sh REV [ROUNDS] [gateway_ops flags ...]}
rounds=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$(dirname "$0")/baseline_site.sh"
baseline_site "$rev" "$work"
run() {  # $1: current or baseline; the rest: gateway_ops flags
    local site=() code=$1
    shift
    [ "$code" = current ] || site=(--server-path "$work/site")
    "$py" -m coalesce.loadtests.gateway_ops "$@" "${site[@]}" --json | tail -1 | "$py" -c '
import json, sys
f = json.load(sys.stdin)
top = sorted(f["packages"].items(), key=lambda kv: -kv[1])[:3]
print("%8d %9.0f %7.1f  " % (f["requests"], f["bytecodes"], f["calls"]) + ", ".join("%s %.0f" % kv for kv in top))'
}
echo "round code     requests bytecodes/request calls/request  top packages (bytecodes/request)"
for r in $(seq "$rounds"); do
    for code in current baseline; do
        printf '%-5s %-8s %s\n' "$r" "$code" "$(HF_HUB_OFFLINE=1 run "$code" "$@")"
    done
done
