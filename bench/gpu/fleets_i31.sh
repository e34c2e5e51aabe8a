#!/usr/bin/env bash
# Issue 31, item 3, what the first 4x H100 call (bench/RESULTS.md, "Real fleet, 2 replicas x TP 2") left out:
# 4 replicas x TP 1 at leads 0.05 and 0, and 2 replicas x TP 2 at lead 0, in one device call of under 9 minutes.
#
#   bash bench/gpu/fleets_i31.sh OUT
#
# Runs, in this order (the most wanted first), each one bench.run with --check-sim into OUT/NAME (results.json
# gzipped) and its log under OUT/logs:
#   4x1-zipf-affinity        queue behind affinity (lead 0: it takes no hints)
#   4x1-zipf-lora-cache-lead0.05, 4x1-zipf-least-loaded (overlap and the oracle), 4x1-zipf-lora-cache-lead0
#   2x2-zipf-lora-cache-lead0
#   2x2-zipf-affinity, 2x2-zipf-least-loaded   the 2x2 baselines again on this host (the earlier ones ran on another)
#   FLEET-trace-*            only with TRACE=FILE (a JSONL trace, bench.workloads); the repository holds none
# A run starts only while the call's elapsed time plus its estimate (EST seconds a policy, 75 by default: the
# service, engines and model per policy, bench/RESULTS.md) stays under BUDGET (500 s by default), so the call
# ends before the device tool's 10 minutes (at 75 s a policy the two 2x2 baselines are left out unless the runs go
# faster than that); each run is also killed after STEP_LIMIT (240 s) of its own.
# Options, from the environment (defaults in brackets): REQUESTS [60], RATE [4] Poisson requests/s per replica,
# MODEL [llama-3.1-8b], RANKS [16,64], ADAPTERS [$TMPDIR/lora-cache-bench-adapters-MODEL], EXTRA [], and those of
# lib.sh (LOGDIR, TAIL, PYTHON, DRY). The first run on a fresh host also writes the adapters and compiles kernels.
# Exit status: the number of runs that failed (a skipped run is not a failure; the summary lists it).
set -u
. "$(dirname "$0")/lib.sh"
model=${MODEL:-llama-3.1-8b}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-bench-adapters-$model}
read -r -a extra <<< "${EXTRA:-}"
requests=${REQUESTS:-60}
rate=${RATE:-4}
budget=${BUDGET:-500}
est=${EST:-75}
limit=${STEP_LIMIT:-240}
common=(--engine real --model "$model" --adapter-ranks "${RANKS:-16,64}" --adapters "$adapters" --no-plots
        --check-sim --requests "$requests")
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
skipped=()
planned=0  # with DRY=1 the clock is the estimates so far (nothing runs)
run() {  # NAME POLICIES_COUNT ARGS...: one bench.run into OUT/NAME, if the budget allows
  local name=$1 count=$2; shift 2
  local spent=$SECONDS
  [ "${DRY:-0}" = 1 ] && spent=$planned
  if [ $((spent + est * count)) -gt "$budget" ]; then
    echo "=== $name skipped: $spent s spent, about $((est * count)) s more needed, budget $budget s"
    skipped+=("$name")
    return 0
  fi
  planned=$((planned + est * count))
  step "$name" timeout -k 15 "$limit" "$PYTHON" -m bench.run "${common[@]}" "$@" "${extra[@]}" --out "$out/$name"
  if [ "${GZIP:-1}" = 1 ] && [ -f "$out/$name/results.json" ]; then gzip -f "$out/$name/results.json"; fi
}
work_for() {  # FLEET SCENARIO: the workload options
  local replicas=${1%x*}
  if [ "$2" = trace ]; then echo "--arrivals trace --popularity trace:$TRACE --requests 0"
  else echo "--scenario $2 --arrivals poisson:$((rate * replicas))"; fi
}
shape_for() { echo "--replicas ${1%x*} --tp ${1#*x}"; }
fleet_run() {  # FLEET SCENARIO WHAT: WHAT is affinity, least-loaded or leadL
  local fleet=$1 scenario=$2 what=$3 shape work
  read -r -a shape <<< "$(shape_for "$fleet")"
  read -r -a work <<< "$(work_for "$fleet" "$scenario")"
  case $what in
    affinity) run "$fleet-$scenario-affinity" 1 "${shape[@]}" "${work[@]}" --router affinity --policies queue \
                --hint-lead-s 0 ;;
    least-loaded) run "$fleet-$scenario-least-loaded" 2 "${shape[@]}" "${work[@]}" --router least-loaded \
                    --policies overlap,oracle --hint-lead-s 0 ;;
    lead*) run "$fleet-$scenario-lora-cache-$what" 1 "${shape[@]}" "${work[@]}" --router lora-cache \
             --policies global --hint-lead-s "${what#lead}" ;;
  esac
}
fleet_run 4x1 zipf affinity
fleet_run 4x1 zipf lead0.05
fleet_run 4x1 zipf least-loaded
fleet_run 4x1 zipf lead0
fleet_run 2x2 zipf lead0
fleet_run 2x2 zipf affinity
fleet_run 2x2 zipf least-loaded
if [ -n "${TRACE:-}" ]; then
  for what in affinity lead0.05 least-loaded lead0; do fleet_run 2x2 trace "$what"; done
fi
echo "=== done in ${SECONDS} s; failed: $failed; skipped: ${skipped[*]:-none}"
exit "$failed"
