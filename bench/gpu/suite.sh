#!/usr/bin/env bash
# The benchmark job on GPUs (the real engine): each named scenario at each router lead, one bench.run each.
#
#   bash bench/gpu/suite.sh OUT [SCENARIO ...]     SCENARIO: a bench.run --scenario (seed, uniform, zipf,
#                                                  bursty); default: all four
#
# Each run writes OUT/[TAG-]SCENARIO-leadL/results.json (gzipped unless GZIP=0: bench.report and
# bench.sim.check read either; plots are redrawn off the GPU machine with "$PYTHON" -m bench.report) and its
# console log to LOGDIR. Options, from the environment (defaults in brackets):
#   MODEL [llama-3.1-8b]  RANKS [16,64]: the model shape and the adapters' ranks
#   REQUESTS [the scenario's]  POLICIES [all]: requests per run, policies run (in order)
#   LEADS [0.05]: router lead times in seconds, space-separated: one run per lead
#   CHECK_SIM [0]: 1 adds --check-sim (the simulator against each run, costs fitted from the run)
#   ATTACH [0]: 1 adds --attach (every engine rank in a process of its own, attached through the seam)
#   EXTRA []: more bench.run options for every run, e.g. "--replicas 2 --arrivals poisson:8" or "--tp 4"
#   TAG []: a prefix for every run's name, so runs of other EXTRA options stay apart (e.g. fleet2)
#   ADAPTERS [$TMPDIR/lora-cache-bench-adapters-MODEL]: the adapters, made by the first run that needs
#     them and shared by the rest (outside OUT: they are large, and a machine keeps them between calls)
#   LOGDIR [OUT/logs]  TAIL [25]: where the console logs go, how many of their last lines are printed
#   PYTHON [python, else python3]: the interpreter (with torch and Ray)
#   DRY [0]: 1 prints the commands and runs nothing
# Exit status: the number of runs that failed. Examples (bench/RESULTS.md has the runs):
#   LEADS="0.05 0" CHECK_SIM=1 REQUESTS=120 bash bench/gpu/suite.sh OUT seed uniform zipf bursty
#   TAG=fleet2 EXTRA="--replicas 2 --arrivals poisson:8" REQUESTS=160 bash bench/gpu/suite.sh OUT zipf
#   TAG=attach ATTACH=1 POLICIES=global,ondemand REQUESTS=120 bash bench/gpu/suite.sh OUT zipf
#   MODEL=llama-3.1-70b TAG=tp4 EXTRA="--tp 4" POLICIES=ondemand,global REQUESTS=60 bash bench/gpu/suite.sh OUT zipf
# bench/gpu/parallel.sh runs several scenarios at once, each on GPUs of its own.
set -u
. "$(dirname "$0")/lib.sh"
model=${MODEL:-llama-3.1-8b}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-bench-adapters-$model}
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(seed uniform zipf bursty)
read -r -a leads <<< "${LEADS:-0.05}"
read -r -a extra <<< "${EXTRA:-}"
common=(--engine real --model "$model" --adapter-ranks "${RANKS:-16,64}" --adapters "$adapters" --no-plots
        --policies "${POLICIES:-all}" ${REQUESTS:+--requests "$REQUESTS"} "${extra[@]}")
[ "${CHECK_SIM:-0}" = 1 ] && common+=(--check-sim)
[ "${ATTACH:-0}" = 1 ] && common+=(--attach)
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
for scenario in "${scenarios[@]}"; do
  for lead in "${leads[@]}"; do
    name=${TAG:+$TAG-}$scenario-lead$lead
    step "$name" "$PYTHON" -m bench.run "${common[@]}" --scenario "$scenario" --hint-lead-s "$lead" --out "$out/$name"
    if [ "${GZIP:-1}" = 1 ] && [ -f "$out/$name/results.json" ]; then gzip -f "$out/$name/results.json"; fi
  done
done
exit "$failed"
