#!/usr/bin/env bash
# Every GPU check and measurement of the control plane, kernels and engine in one device call.
#   bash bench/gpu_session.sh OUT_DIR        (needs 2 GPUs for the TP 2 parts)
set -u
out=${1:?output directory}
mkdir -p "$out"
step() { local name=$1; shift; echo "=== $name: $*"; ( "$@" ) > "$out/$name.log" 2>&1; echo "=== $name rc=$?"; tail -n 25 "$out/$name.log"; }
nvidia-smi -L
step tp_ready python -m bench.probes.tp_ready --tp 2 --out "$out/tp2.json"
step kernel_tests python -m pytest tests/test_kernels.py -m gpu -q -x -p no:cacheprovider
step kernels_bench python -m bench.probes.kernels --out "$out/kernels-h200.json"
step gpu_tests python -m pytest tests/test_gpu.py tests/test_engine.py -m gpu -q -p no:cacheprovider
step engine_tp1_ondemand python -m workers.engine --adapters /tmp/ad8b --make-adapters 8 --model llama-3.1-8b --tp 1 --device cuda --requests 64 --num-slots 4 --rate 20 --admission ondemand --json
step engine_tp1_overlap python -m workers.engine --adapters /tmp/ad8b --model llama-3.1-8b --tp 1 --device cuda --requests 64 --num-slots 4 --rate 20 --admission overlap --json
step engine_tp2_overlap python -m workers.engine --adapters /tmp/ad8b --model llama-3.1-8b --tp 2 --device cuda --requests 64 --num-slots 4 --rate 20 --admission overlap --json
