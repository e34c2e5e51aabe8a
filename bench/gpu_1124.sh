#!/usr/bin/env bash
# The 2026-11-24 GPU checks and measurements (issues 19, 21, 22 and 20), one device call per part:
#   bash bench/gpu_1124.sh OUT checks     # gpu tests (chunked loads, versions in the kernels, stream races) + bench.probes.pipeline
#   bash bench/gpu_1124.sh OUT lead0      # zipf at leads 0 and 0.05: global, queue, overlap, pipelined, oracle, ondemand
#   bash bench/gpu_1124.sh OUT attach     # the engine seam: --attach against hosted engines, zipf, global + ondemand
# Logs go to $LOGDIR (default /tmp/logs); results (JSON) under OUT. Needs Ray from .device (../shared/tools/device-site).
set -u
out=${1:?output directory}; shift
logs=${LOGDIR:-/tmp/logs}
mkdir -p "$out" "$logs"
common=(--engine real --model llama-3.1-8b --adapter-ranks 16,64 --no-plots --adapters /tmp/bench-adapters)
step() { local name=$1; shift; echo "=== $name: $*"; ( "$@" ) > "$logs/$name.log" 2>&1; echo "=== $name rc=$?";
         tr '\r' '\n' < "$logs/$name.log" | grep -v '%\|logging.cc\|^ *@' | tail -n 30; }
nvidia-smi -L
for what in "$@"; do
  case $what in
    checks)
      step gpu_tests python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_engine.py \
           tests/test_kernel_versions.py tests/test_pipeline.py -k "not real_shape and not tp2" -rfE
      step pipeline python -m bench.probes.pipeline --repeats 5 --out "$out/pipeline.json" ;;
    lead0)
      for lead in 0 0.05; do
        step "zipf-lead$lead" python -m bench.run "${common[@]}" --scenario zipf --requests 150 --hint-lead-s "$lead" \
             --policies global,queue,overlap,pipelined,oracle,ondemand --out "$out/zipf-lead$lead"
      done ;;
    attach)
      step zipf-hosted python -m bench.run "${common[@]}" --scenario zipf --requests 120 --hint-lead-s 0.05 \
           --policies global,ondemand --out "$out/zipf-hosted"
      step zipf-attach python -m bench.run "${common[@]}" --scenario zipf --requests 120 --hint-lead-s 0.05 \
           --policies global,ondemand --attach --out "$out/zipf-attach" ;;
    *) echo "unknown part $what"; exit 2 ;;
  esac
done
