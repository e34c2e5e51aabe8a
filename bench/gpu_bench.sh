#!/usr/bin/env bash
# The benchmark job's H200 runs (real engine, Llama-3.1-8B shapes, rank 16/64 adapters), one device call each.
#   bash bench/gpu_bench.sh OUT smoke|seed|uniform|zipf|bursty|fleet2|tp4 ...
# Each run writes OUT/NAME/results.json (plots are redrawn off the device: python -m bench.report).
set -u
out=${1:?output directory}; shift
mkdir -p "$out"
common=(--engine real --model llama-3.1-8b --adapter-ranks 16,64 --no-plots --adapters /tmp/bench-adapters)
run() { local name=$1; shift; echo "=== $name: $*"; python -m bench.run --out "$out/$name" "$@" > "$out/$name.log" 2>&1;
        echo "=== $name rc=$?"; grep -v '%|' "$out/$name.log" | tail -n 30; }
nvidia-smi -L
for what in "$@"; do
  case $what in
    smoke)   run smoke "${common[@]}" --scenario zipf --policies ondemand,global --requests 24 ;;
    seed)    run seed "${common[@]}" --scenario seed --requests 100 ;;
    uniform) run uniform "${common[@]}" --scenario uniform --requests 100 ;;
    zipf)    run zipf "${common[@]}" --scenario zipf --requests 100 ;;
    bursty)  run bursty "${common[@]}" --scenario bursty --requests 120 --policies global,queue,ondemand,oracle,overlap ;;
    fleet2)  run fleet2 "${common[@]}" --scenario zipf --replicas 2 --requests 100 --arrivals poisson:4 --policies ondemand,queue,global ;;
    tp4)     python -m bench.tp_ready --tp 4 --model llama-3.1-70b --out "$out/tp4-ready.json" > "$out/tp4-ready.log" 2>&1
             echo "=== tp4-ready rc=$?"; tail -n 25 "$out/tp4-ready.log"
             run tp4-zipf --engine real --model llama-3.1-70b --adapter-ranks 16,64 --no-plots \
                 --adapters /tmp/bench-adapters-70b --scenario zipf --tp 4 --policies ondemand,global --requests 60 ;;
    *) echo "unknown run $what"; exit 2 ;;
  esac
done
