#!/usr/bin/env bash
# Issue 31, item 3: the fleet's value on a real 4-GPU host. Each named scenario on each fleet (2 replicas x TP 2,
# 4 replicas x TP 1): global behind Route against queue behind affinity, overlap behind least-loaded and the
# oracle behind least-loaded, with --check-sim (the simulator against every run); global at each lead.
#
#   bash bench/gpu/fleets.sh OUT [SCENARIO ...]     SCENARIO: a bench.run --scenario (seed, uniform, zipf,
#                                                   bursty) or "trace" (needs TRACE); default: zipf
#
# Per fleet and scenario: one bench.run per router (the baselines take no hints: their figures hold at every
# lead, so they run once, at lead 0), and one global run per lead. Each writes
# OUT/FLEET-SCENARIO-ROUTER[-leadL]/results.json (gzipped unless GZIP=0) and its console log to LOGDIR.
# Options, from the environment (defaults in brackets):
#   FLEETS [2x2 4x1]: REPLICASxTP, space-separated (4 GPUs each)
#   LEADS [0.05 0]: global's router leads, seconds
#   REQUESTS [40]: requests per run; RATE [4]: Poisson requests/s per replica, an integer (the scenarios' rate)
#   TRACE []: a JSONL trace (bench.workloads) for the "trace" scenario: --arrivals trace --popularity trace:TRACE
#   MODEL [llama-3.1-8b]  RANKS [16,64]  ADAPTERS [$TMPDIR/lora-cache-bench-adapters-MODEL]: as bench/gpu/suite.sh
#   EXTRA []: more bench.run options for every run; LOGDIR [OUT/logs]  TAIL [25]  PYTHON  DRY [0]: as suite.sh
# Sizing: a real policy run costs about 40-60 s of device time beyond its traffic (a fresh service, engines and
# model per policy: 65-85 s for 100 requests at 4/s on one H200 in results/h200-bench), and 40 requests at 8-16/s
# are 3-5 s of traffic; a fleet and scenario is 5 policy runs (queue; overlap and the oracle; global at 2 leads),
# about 4-5 minutes. The default (zipf on both fleets, 10 runs) is 8-10 minutes: give each fleet its own call
# (the device tool allows 10 minutes a command), and one scenario per fleet and call, e.g.
#   FLEETS=2x2 bash bench/gpu/fleets.sh OUT zipf; FLEETS=4x1 bash bench/gpu/fleets.sh OUT zipf   # ~4-5 min each
#   FLEETS=2x2 TRACE=trace.jsonl REQUESTS=300 bash bench/gpu/fleets.sh OUT trace               # a longer replay
# Exit status: the number of runs that failed.
set -u
. "$(dirname "$0")/lib.sh"
model=${MODEL:-llama-3.1-8b}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-bench-adapters-$model}
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(zipf)
read -r -a fleets <<< "${FLEETS:-2x2 4x1}"
read -r -a leads <<< "${LEADS:-0.05 0}"
read -r -a extra <<< "${EXTRA:-}"
requests=${REQUESTS:-40}
rate=${RATE:-4}
common=(--engine real --model "$model" --adapter-ranks "${RANKS:-16,64}" --adapters "$adapters" --no-plots
        --check-sim --requests "$requests")
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
run() {  # NAME ARGS...: one bench.run into OUT/NAME
  local name=$1; shift
  step "$name" "$PYTHON" -m bench.run "${common[@]}" "$@" "${extra[@]}" --out "$out/$name"
  if [ "${GZIP:-1}" = 1 ] && [ -f "$out/$name/results.json" ]; then gzip -f "$out/$name/results.json"; fi
}
for fleet in "${fleets[@]}"; do
  replicas=${fleet%x*}
  tp=${fleet#*x}
  shape=(--replicas "$replicas" --tp "$tp")
  for scenario in "${scenarios[@]}"; do
    if [ "$scenario" = trace ]; then
      if [ -z "${TRACE:-}" ]; then echo "=== $fleet-trace skipped: give TRACE=FILE"; continue; fi
      work=(--arrivals trace --popularity "trace:$TRACE")
    else
      work=(--scenario "$scenario" --arrivals "poisson:$((rate * replicas))")
    fi
    name=${fleet}-$scenario
    run "$name-affinity" "${shape[@]}" "${work[@]}" --router affinity --policies queue --hint-lead-s 0
    run "$name-least-loaded" "${shape[@]}" "${work[@]}" --router least-loaded --policies overlap,oracle --hint-lead-s 0
    for lead in "${leads[@]}"; do
      run "$name-lora-cache-lead$lead" "${shape[@]}" "${work[@]}" --router lora-cache --policies global --hint-lead-s "$lead"
    done
  done
done
exit "$failed"
