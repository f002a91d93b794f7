#!/usr/bin/env bash
# The bench's overload section, this checkout's code beside an earlier commit's, alternated in one run on
# this machine (current, baseline, current, ...), so that a change to admission is read side by side on
# a noisy VM, where one run's 4× goodput has ranged over a third:
#
#     bash loadtests/overload_ab.sh REV [ROUNDS]
#
# REV is built into a wheel and installed into a directory of its own, first on PYTHONPATH for the
# baseline's runs, its server's included (baseline_site.sh). ROUNDS (default 2) pairs. Each run is
# `python -m coalesce.loadtests.bench --only overload` against a scratch copy of BENCHMARKS.md, Infinity
# left out (its burst is the same program in every run); its log, copy and raw results go under OUT
# (default bench-out/overload-ab). Prints one line per run: round, which code, the capacity probe, then
# at 2× and at 4× the admitted p99 (ms), goodput ÷ capacity and the event loop's CPU per refusal (µs).
set -euo pipefail
rev=${1:?usage: bash loadtests/overload_ab.sh REV [ROUNDS]}
rounds=${2:-2}
py=${PYTHON:-.venv/bin/python}
out=${OUT:-bench-out/overload-ab}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$(dirname "$0")/baseline_site.sh"
baseline_site "$rev" "$work"
mkdir -p "$out"
echo "round code     capacity/s 2x_p99_ms 2x_goodput 2x_us/refusal 4x_p99_ms 4x_goodput 4x_us/refusal"
for r in $(seq "$rounds"); do
    for code in current baseline; do
        env=()
        [ "$code" = current ] || env=(env "PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}")
        cp BENCHMARKS.md "$out/$code$r.md"
        "${env[@]}" "$py" -m coalesce.loadtests.bench --only overload --file "$out/$code$r.md" \
            --out "$out/$code$r" --infinity-bin /nonexistent > "$out/$code$r.log" 2>&1
        # The capacity probe's figure, then the open-loop table's 2× and 4× rows: p99, ÷ capacity, µs/refusal.
        figures=$(awk -F'|' '
            /Capacity \(closed loop/ { match($0, /\*\*[0-9.,]+ req\/s\*\*/); cap = substr($0, RSTART + 2, RLENGTH - 10) }
            $2 ~ /^ (2|4)× $/ && NF > 12 { gsub(/ /, "", $5); gsub(/ /, "", $7); gsub(/ /, "", $12); row = row " " $7 " " $5 " " $12 }
            END { print cap row }' "$out/$code$r.log")
        printf '%-5s %-8s %s\n' "$r" "$code" "$figures"
    done
done
