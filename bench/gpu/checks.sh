#!/usr/bin/env bash
# The GPU tests and the probes of the data path, kernels and engine, one call.
#
#   bash bench/gpu/checks.sh OUT [PART ...]     default: every part, in this order
#
# Parts (figures as JSON under OUT, console logs under LOGDIR):
#   tests     the GPU tests (pytest -m gpu): kernels, data path, engine, versions in the kernels, pipelined loads
#   kernels   "$PYTHON" -m bench.probes.kernels: bandwidth against a device copy, time against the torch reference
#   datapath  "$PYTHON" -m bench.probes.gpu_suite: H2D through the worker cache, disk reads, loads beside GEMMs
#   pipeline  "$PYTHON" -m bench.probes.pipeline: what a missed adapter adds to a prefill, chunked copies
#   tp        "$PYTHON" -m bench.probes.tp_ready --tp TP: one TP replica on Ray (needs TP GPUs; skipped with fewer)
#   engine    "$PYTHON" -m workers.engine alone: TP 1 ondemand and overlap, TP 2 overlap (with 2 GPUs)
#   push      "$PYTHON" -m bench.probes.push --tp TP: a trainer's pushes to READY on every rank against the shards'
#             host-to-device copy, MODEL at rank 16 and llama-3.1-70b at rank 64 (needs TP GPUs; skipped with fewer)
# Options, from the environment (defaults in brackets):
#   MODEL [llama-3.1-8b]: the model shape of kernels, tp and engine   TP [2]: the tp part's size
#   TESTS_K []: a pytest -k filter for the tests part (e.g. "not real_shape and not tp2")
#   ADAPTERS [$TMPDIR/lora-cache-engine-adapters-MODEL]: the engine part's adapters (8 made if empty)
#   LOGDIR [OUT/logs]  TAIL [25]  PYTHON [python, else python3]  DRY [0]: as in bench/gpu/suite.sh
# Exit status: the number of parts' commands that failed.
set -u
. "$(dirname "$0")/lib.sh"
model=${MODEL:-llama-3.1-8b}
tp=${TP:-2}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-engine-adapters-$model}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests kernels datapath pipeline tp engine push)
have=$(gpus)
engine=("$PYTHON" -m workers.engine --adapters "$adapters" --make-adapters 8 --model "$model" --device cuda
        --requests 64 --num-slots 4 --rate 20 --json)
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
for part in "${parts[@]}"; do
  case $part in
    tests)    step gpu_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE ${TESTS_K:+-k "$TESTS_K"} \
                   tests/test_kernels.py tests/test_gpu.py tests/test_engine.py tests/test_kernel_versions.py \
                   tests/test_pipeline.py ;;
    kernels)  step kernels "$PYTHON" -m bench.probes.kernels --model "$model" --out "$out/kernels.json" ;;
    datapath) step gpu_suite "$PYTHON" -m bench.probes.gpu_suite --model "$model" --out "$out" ;;
    pipeline) step pipeline "$PYTHON" -m bench.probes.pipeline --repeats 5 --out "$out/pipeline.json" ;;
    tp)       if [ "$have" -ge "$tp" ]; then
                step "tp$tp-ready" "$PYTHON" -m bench.probes.tp_ready --tp "$tp" --model "$model" --out "$out/tp$tp-ready.json"
              else echo "=== tp$tp-ready: skipped, $have GPUs"; fi ;;
    engine)   step engine_tp1_ondemand "${engine[@]}" --tp 1 --admission ondemand
              step engine_tp1_overlap "${engine[@]}" --tp 1 --admission overlap
              if [ "$have" -ge 2 ]; then step engine_tp2_overlap "${engine[@]}" --tp 2 --admission overlap
              else echo "=== engine_tp2_overlap: skipped, $have GPU"; fi ;;
    push)     if [ "$have" -ge "$tp" ]; then
                step "push-$model-r16" "$PYTHON" -m bench.probes.push --tp "$tp" --model "$model" --rank 16 \
                     --pushes 6 --out "$out/push-$model-r16.json"
                step push-llama-3.1-70b-r64 "$PYTHON" -m bench.probes.push --tp "$tp" --model llama-3.1-70b \
                     --rank 64 --pushes 3 --out "$out/push-llama-3.1-70b-r64.json"
              else echo "=== push: skipped, $have GPUs"; fi ;;
    *) echo "unknown part $part (tests, kernels, datapath, pipeline, tp, engine, push)" >&2; exit 2 ;;
  esac
done
exit "$failed"
