#!/usr/bin/env bash
# The 2026-11-25 GPU runs (issue 20): every named scenario at router leads 0.05 and 0, with the simulator's
# check (bench.sim.check, costs fitted from the run) against the lead-0.05 run. One device call per scenario:
#   bash bench/gpu_1125.sh OUT seed        # also: uniform, zipf, bursty
# Per scenario: ondemand, overlap, queue, global, oracle at lead 0.05 (--check-sim), then global at lead 0.
# Logs go to $LOGDIR (default /tmp/logs); results (JSON) under OUT. Needs Ray from .device (../shared/tools/device-site).
set -u
out=${1:?output directory}; shift
logs=${LOGDIR:-/tmp/logs}
requests=${REQUESTS:-120}
mkdir -p "$out" "$logs"
common=(--engine real --model llama-3.1-8b --adapter-ranks 16,64 --no-plots --adapters /tmp/bench-adapters
        --requests "$requests")
step() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS; ( "$@" ) > "$logs/$name.log" 2>&1;
         echo "=== $name rc=$? $((SECONDS - t0)) s"; tr '\r' '\n' < "$logs/$name.log" | grep -v '%\|logging.cc\|^ *@' | tail -n 25; }
nvidia-smi -L
for scenario in "$@"; do
  case $scenario in
    seed|uniform|zipf|bursty) ;;
    *) echo "unknown scenario $scenario"; exit 2 ;;
  esac
  step "$scenario-lead0.05" python -m bench.run "${common[@]}" --scenario "$scenario" --hint-lead-s 0.05 \
       --policies global,queue,overlap,oracle,ondemand --check-sim --out "$out/$scenario-lead0.05"
  step "$scenario-lead0" python -m bench.run "${common[@]}" --scenario "$scenario" --hint-lead-s 0 \
       --policies global --out "$out/$scenario-lead0"
  for f in "$out/$scenario"-lead*/results.json; do gzip -f "$f"; done
done
