#!/usr/bin/env bash
# Several bench/gpu/suite.sh calls at once on one host, each on GPUs of its own and its own embedded Ray.
#
#   bash bench/gpu/parallel.sh OUT SCENARIO@GPUS ...     e.g. seed@0 uniform@1 zipf@2 bursty@3
#
# Every call gets the same options (the environment: MODEL, RANKS, REQUESTS, POLICIES, LEADS, EXTRA, ...;
# bench/gpu/suite.sh lists them), CUDA_VISIBLE_DEVICES=GPUS, and writes under OUT as suite.sh does; its
# console goes to LOGDIR/SCENARIO.console, printed once all are done. The adapters are made (or topped up)
# here first, for every scenario named, as each run would: two runs topping up one directory at once race.
# Exit status: the number of calls that failed.
set -u
. "$(dirname "$0")/lib.sh"
model=${MODEL:-llama-3.1-8b}
export ADAPTERS=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-bench-adapters-$model}
scenarios=()
for spec in "$@"; do scenarios+=("${spec%@*}"); done
read -r -a extra <<< "${EXTRA:-}"
step adapters "$PYTHON" - "${scenarios[@]}" -- --model "$model" --adapter-ranks "${RANKS:-16,64}" \
     --adapters "$ADAPTERS" ${REQUESTS:+--requests "$REQUESTS"} "${extra[@]}" <<'PY'
import sys

from bench.run import adapter_dir, build_parser, configs

cut = sys.argv.index("--")
for scenario in sys.argv[1:cut]:
    bench, spec = configs(build_parser().parse_args(["--scenario", scenario, *sys.argv[cut + 1:]]))
    print(scenario, adapter_dir(bench, spec.adapter_names(bench.slots)))
PY
[ "$failed" = 0 ] || exit 1
pids=()
for spec in "$@"; do
  CUDA_VISIBLE_DEVICES=${spec#*@} bash bench/gpu/suite.sh "$out" "${spec%@*}" > "$logs/${spec%@*}.console" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed=$((failed + 1))
  echo "##### ${scenarios[$i]}"; cat "$logs/${scenarios[$i]}.console"
done
exit "$failed"
