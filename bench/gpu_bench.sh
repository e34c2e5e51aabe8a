#!/usr/bin/env bash
# The benchmark job's H200 runs (real engine, Llama-3.1-8B shapes, rank 16/64 adapters), one device call each.
#   bash bench/gpu_bench.sh OUT smoke|seed|uniform|zipf|bursty|seed-s|uniform-s|zipf-s|bursty-s|seed-l|uniform-l|zipf-l|bursty-l|seed-q|uniform-q|zipf-q|bursty-q|fleet2-l|seed4|bursty4|fleet2|fleet2-s|tp4 ...
# (bench/gpu_parallel.sh runs several at once, each on its own GPUs.) Logs go to $LOGDIR (default OUT):
# a device call brings back at most 8 files, so there keep them off $OUT (LOGDIR=/tmp/logs).
# Each run writes OUT/NAME/results.json (plots are redrawn off the device: python -m bench.report).
set -u
out=${1:?output directory}; shift
logs=${LOGDIR:-$out}
mkdir -p "$out" "$logs"
first=global,oracle,ondemand,queue,overlap  # a run cut short by the device's time limit keeps these
common=(--engine real --model llama-3.1-8b --adapter-ranks 16,64 --no-plots --adapters /tmp/bench-adapters)
run() { local name=$1; shift; echo "=== $name: $*"; python -m bench.run --out "$out/$name" "$@" > "$logs/$name.log" 2>&1;
        echo "=== $name rc=$?"; tr '\r' '\n' < "$logs/$name.log" | grep -v '%\|logging.cc\|^ *@' | tail -n 30; }
nvidia-smi -L
for what in "$@"; do
  case $what in
    smoke)   run smoke "${common[@]}" --scenario zipf --policies ondemand,global --requests 24 ;;
    seed)    run seed "${common[@]}" --scenario seed --requests 150 ;;
    uniform) run uniform "${common[@]}" --scenario uniform --requests 150 ;;
    zipf)    run zipf "${common[@]}" --scenario zipf --requests 150 ;;
    bursty)  run bursty "${common[@]}" --scenario bursty --requests 180 ;;
    # the scenarios as first run (2026-11-22 morning), at the engine's default of 4 adapters per batch
    seed4)   run seed4 "${common[@]}" --scenario seed --requests 150 --max-adapters 4 ;;
    bursty4) run bursty4 "${common[@]}" --scenario bursty --requests 120 --max-adapters 4 --policies oracle,overlap ;;
    # shorter streams of the same scenarios, to fit a device call
    seed-s)  run seed "${common[@]}" --scenario seed --requests 100 ;;
    uniform-s) run uniform "${common[@]}" --scenario uniform --requests 100 ;;
    zipf-s)  run zipf "${common[@]}" --scenario zipf --requests 100 ;;
    bursty-s) run bursty "${common[@]}" --scenario bursty --requests 120 ;;
    # the fifth pass (staging): 200 requests (p99 is the third worst), global and the oracle first
    seed-l)  run seed "${common[@]}" --scenario seed --requests 200 --policies "$first" ;;
    uniform-l) run uniform "${common[@]}" --scenario uniform --requests 200 --policies "$first" ;;
    zipf-l)  run zipf "${common[@]}" --scenario zipf --requests 200 --policies "$first" ;;
    bursty-l) run bursty "${common[@]}" --scenario bursty --requests 200 --policies "$first" ;;
    # ... and the other two policies of the same workloads, in a second call (merge with bench.report --merge)
    seed-q)  run seed-q "${common[@]}" --scenario seed --requests 200 --policies queue,overlap ;;
    uniform-q) run uniform-q "${common[@]}" --scenario uniform --requests 200 --policies queue,overlap ;;
    zipf-q)  run zipf-q "${common[@]}" --scenario zipf --requests 200 --policies queue,overlap ;;
    bursty-q) run bursty-q "${common[@]}" --scenario bursty --requests 200 --policies queue,overlap ;;
    fleet2-l) run fleet2 "${common[@]}" --scenario zipf --replicas 2 --requests 160 --arrivals poisson:8 \
                  --policies global,oracle,ondemand,queue ;;
    # two replicas (2 GPUs), each at the one-replica scenarios' load
    fleet2)  run fleet2 "${common[@]}" --scenario zipf --replicas 2 --requests 200 --arrivals poisson:8 ;;
    fleet2-s) run fleet2 "${common[@]}" --scenario zipf --replicas 2 --requests 160 --arrivals poisson:8 ;;
    tp4)     python -m bench.probes.tp_ready --tp 4 --model llama-3.1-70b --out "$out/tp4-ready.json" > "$logs/tp4-ready.log" 2>&1
             echo "=== tp4-ready rc=$?"; tail -n 25 "$logs/tp4-ready.log"
             run tp4-zipf --engine real --model llama-3.1-70b --adapter-ranks 16,64 --no-plots \
                 --adapters /tmp/bench-adapters-70b --scenario zipf --tp 4 --policies ondemand,global --requests 60 ;;
    *) echo "unknown run $what"; exit 2 ;;
  esac
done
