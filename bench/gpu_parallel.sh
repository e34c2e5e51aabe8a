#!/usr/bin/env bash
# Several bench/gpu_bench.sh runs at once on one host, each on its own GPUs and its own embedded Ray:
#   bash bench/gpu_parallel.sh OUT NAME@GPUS ...        e.g. seed@0 uniform@1 fleet2@2,3
# The runs share the adapters, topped up here first (bench.run.adapter_dir, as each run would: two runs
# topping up one directory at once would race).
set -u
out=${1:?output directory}; shift
logs=${LOGDIR:-$out}
mkdir -p "$out" "$logs"
python -c "from bench.run import BenchConfig, adapter_dir
adapter_dir(BenchConfig(model='llama-3.1-8b', adapter_ranks='16,64', adapters='/tmp/bench-adapters'), [f'adapter-{i:03d}' for i in range(50)])" || exit 1
names=()
for spec in "$@"; do
  name=${spec%@*}; gpus=${spec#*@}
  CUDA_VISIBLE_DEVICES=$gpus bash bench/gpu_bench.sh "$out" "$name" > "$logs/$name.console" 2>&1 &
  names+=("$name")
done
wait
for name in "${names[@]}"; do echo "##### $name"; cat "$logs/$name.console"; done
