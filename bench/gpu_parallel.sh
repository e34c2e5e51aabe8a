#!/usr/bin/env bash
# Several bench/gpu_bench.sh runs at once on one host, each on its own GPUs and its own embedded Ray:
#   bash bench/gpu_parallel.sh OUT NAME@GPUS ...        e.g. seed@0 uniform@1 fleet2@2,3
# The runs share the adapters, made once here first (a run only tops up a directory of its own adapters,
# so two making them at once would race).
set -u
out=${1:?output directory}; shift
logs=${LOGDIR:-$out}
mkdir -p "$out" "$logs"
python -c "from lora_cache.synth import SynthConfig, make_adapters
make_adapters('/tmp/bench-adapters', SynthConfig(model='llama-3.1-8b', count=50, rank='16,64'))" || exit 1
names=()
for spec in "$@"; do
  name=${spec%@*}; gpus=${spec#*@}
  CUDA_VISIBLE_DEVICES=$gpus bash bench/gpu_bench.sh "$out" "$name" > "$logs/$name.console" 2>&1 &
  names+=("$name")
done
wait
for name in "${names[@]}"; do echo "##### $name"; cat "$logs/$name.console"; done
