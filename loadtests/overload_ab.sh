#!/usr/bin/env bash
# The bench's overload (or soak, or engine) section, one code or knob beside another, alternated in one
# run on this machine (current, baseline, current, ...), so that a change to admission (or to the cost
# per request) is read side by side on a noisy VM, where one run's 4× goodput has ranged over a third:
#
#     bash loadtests/overload_ab.sh REV [ROUNDS]
#     CURRENT_ENV="COALESCE_QUEUE_INTERVAL_MS=250" bash loadtests/overload_ab.sh - [ROUNDS]
#
# REV is built into a wheel and installed into a directory of its own, first on PYTHONPATH for the
# baseline's runs, its server's included (baseline_site.sh); REV `-`: this checkout's code on both sides,
# to compare knobs. CURRENT_ENV and BASELINE_ENV (space-separated VAR=VALUE, e.g. a COALESCE_* knob) go
# into each side's environment, which the servers inherit. ROUNDS (default 2) pairs. SECTION: overload
# (default), soak (SOAK_MINUTES, default 10) or engine. Each run is `python -m coalesce.loadtests.bench --only
# SECTION` against a scratch copy of BENCHMARKS.md, Infinity left out (its burst is the same program in
# every run); its log, copy and raw results go under OUT (default bench-out/SECTION-ab). Prints one line
# per run: round, which code, the capacity probe, then for overload at 2× and at 4× the admitted p99
# (ms), goodput ÷ capacity and the event loop's CPU per refusal (µs), and the burst's failed calls and
# wall time (s); for soak the worst phase's admitted p99 (ms), the 2× phases' p99 (ms) and their mean
# goodput ÷ capacity; for engine the null model's CPU µs per request at saturation (16 clients) of one
# process, of the --workers 2 engine and of its gateways, one process ÷ the stub, the --workers 2 engine's
# µs at 1,200/s, and the real model's --workers 2 ÷ one process.
set -euo pipefail
rev=${1:?usage: bash loadtests/overload_ab.sh REV [ROUNDS]}
rounds=${2:-2}
section=${SECTION:-overload}
py=${PYTHON:-.venv/bin/python}
out=${OUT:-bench-out/$section-ab}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ "$rev" != - ]; then
    . "$(dirname "$0")/baseline_site.sh"
    baseline_site "$rev" "$work"
fi
case $section in
    overload) args=(--infinity-bin /nonexistent)
        echo "round code     capacity/s 2x_p99_ms 2x_goodput 2x_us/refusal 4x_p99_ms 4x_goodput 4x_us/refusal burst_failed burst_s cold_p99_ms cold_goodput" ;;
    soak) args=(--soak-minutes "${SOAK_MINUTES:-10}")
        echo "round code     capacity/s worst_p99_ms 2x_p99s_ms 2x_goodput" ;;
    engine) args=()
        echo "round code     one_process_us one_process_x_stub engine_us gateways_us engine_1200_us workers2_x_one" ;;
    *) echo "SECTION: overload, soak or engine" >&2; exit 2 ;;
esac
mkdir -p "$out"
for r in $(seq "$rounds"); do
    for code in current baseline; do
        env=(env)
        if [ "$code" = current ]; then
            env+=(${CURRENT_ENV:-})
        else
            env+=(${BASELINE_ENV:-})
            [ "$rev" = - ] || env+=("PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}")
        fi
        cp BENCHMARKS.md "$out/$code$r.md"
        "${env[@]}" "$py" -m coalesce.loadtests.bench --only "$section" --file "$out/$code$r.md" \
            --out "$out/$code$r" "${args[@]}" > "$out/$code$r.log" 2>&1
        if [ "$section" = engine ]; then
            # The section's table as written to the scratch copy: null-model rows, then the real model's ratio.
            figures=$(awk -F'|' '
                /bench:engine:start/ { on = 1 } /bench:engine:end/ { on = 0 } !on { next }
                { for (i = 2; i <= NF; i++) gsub(/^ +| +$|,/, "", $i) }
                $2 == "one process" && $3 == "saturation 16 clients" { one = $7 " " $8 }
                $2 == "--workers 2" && $3 == "saturation 16 clients" { eng = $5 " " $6 }
                $2 == "--workers 2" && $3 == "1200/s" { slow = $5 }
                $2 ~ /^throughput --workers 2 ÷ one process/ { ratio = $4 }
                END { print one, eng, slow, ratio }' "$out/$code$r.md")
            printf '%-5s %-8s %s\n' "$r" "$code" "$figures"
            continue
        fi
        if [ "$section" = soak ]; then
            # The probe, the worst phase's p99, then each 2× phase's p99 and their mean achieved ÷ probe.
            figures=$(awk -F'|' '
                /Capacity = closed-loop/ { match($0, /\*\*[0-9.,]+ req\/s\*\*/); cap = substr($0, RSTART + 2, RLENGTH - 10) }
                /worst phase/ { split($4, w, " "); worst = w[1]; gsub(/,/, "", worst) }
                $2 ~ /^ soak [0-9]+ / && NF > 10 && ++k % 2 == 0 {
                    p = $6; gsub(/[ ,]/, "", p); a = $4; gsub(/[ ,]/, "", a); p99s = p99s (p99s ? "," : "") p; sum += a; n++ }
                END { c = cap; gsub(/,/, "", c); printf "%s %s %s %.2f\n", cap, worst, p99s, n && c ? sum / n / c : 0 }' \
                "$out/$code$r.log")
            printf '%-5s %-8s %s\n' "$r" "$code" "$figures"
            continue
        fi
        # The capacity probe's figure, the open-loop table's 2× and 4× rows (p99, ÷ capacity, µs/refusal: thousands'
        # commas dropped), then the burst's failed calls and wall time, then the cold flood's p99 and ÷ capacity.
        figures=$(awk -F'|' '
            /Capacity \(closed loop/ { match($0, /\*\*[0-9.,]+ req\/s\*\*/); cap = substr($0, RSTART + 2, RLENGTH - 10) }
            $2 ~ /^ (2|4)× $/ && NF > 12 { gsub(/ /, "", $5); gsub(/[ ,]/, "", $7); gsub(/[ ,]/, "", $12); row = row " " $7 " " $5 " " $12 }
            $2 ~ /^ coalesce $/ && $3 ~ / of / { split($3, f, " "); w = $4; gsub(/ /, "", w); burst = " " f[1] " " w }
            $2 ~ /, cold $/ { gsub(/ /, "", $5); gsub(/[ ,]/, "", $7); cold = " " $7 " " $5 }
            END { print cap row burst cold }' "$out/$code$r.log")
        printf '%-5s %-8s %s\n' "$r" "$code" "$figures"
    done
done
