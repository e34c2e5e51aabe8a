#!/usr/bin/env bash
# Issue 30 on one 4-GPU host, in one call: the host, the benchmark's start-up, TP 4 end to end, the GPU tests.
# The GPU image lacks Ray and a grpcio as new as the generated code: bundle them (the device-site tool, with
# grpcio==1.85.3 protobuf grpcio-reflection grpcio-health-checking) and start with the prefix it prints.
#
#   bash bench/gpu/issue30.sh OUT [PART ...]     default: host start tp cold
#
# Parts (figures as JSON under OUT, console logs under LOGDIR; GPU 0 for start, GPUs 1.. for the tests beside it):
#   host    the GPUs, cores, memory (MemAvailable: the host tier's auto size follows it), read libraries present
#   start   two things at once on GPUs of their own: the benchmark's start-up (bench.probes.fast_start: 100
#           8B-shaped adapters, policies ondemand and global, service start -> first request per policy, its
#           phases) on GPU 0, and the GPU test suite (python -m pytest -m gpu) on GPU 1, under a guard
#   tp      bench.probes.tp_ready at TP 4 (every rank loads its shard, the replica ready after all): 8B and
#           70B shapes, ranks 16 and 64, cold (page-cache) loads
#   cold    bench.probes.cold_read at TP 4: cold loads and host-tier hits per rank and all four at once against
#           a parallel read and a pinned memcpy measured in the same run: 8B r16, 8B r64, 70B r64
# Options, from the environment (defaults in brackets):
#   REPEATS [3]  TESTS_S [200]: the GPU tests' guard in seconds  ADAPTERS [$TMPDIR]: where probes make adapters
#   PACK [0]: 1 packs the JSON and the logs into OUT/issue30.tgz at the end and leaves nothing else in OUT
#   LOGDIR [OUT/logs]  TAIL [25]  PYTHON [python, else python3]  DRY [0]: as in bench/gpu/suite.sh
# Exit status: the number of parts' commands that failed.
set -u
. "$(dirname "$0")/lib.sh"
repeats=${REPEATS:-3}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(host start tp cold)
cold() {  # NAME MODEL RANK ARGS...
  local name=$1 model=$2 rank=$3; shift 3
  step "$name" "$PYTHON" -m bench.probes.cold_read --model "$model" --rank "$rank" --tp 4 --repeats "$repeats" \
       --adapters "$adapters/lora-cache-cold-$model-r$rank" --out "$out/$name.json" "$@"
}
for part in "${parts[@]}"; do
  case $part in
    host)  step host bash -c 'nvidia-smi -L; echo "cores $(nproc)"; grep -E "MemTotal|MemAvailable" /proc/meminfo;
                 '"$PYTHON"' -c "import torch, sys; print(sys.version.split()[0], torch.__version__)";
                 for m in kvikio runai_model_streamer cufile; do
                   '"$PYTHON"' -c "import $m" 2>/dev/null && echo "$m: importable" || echo "$m: absent"; done;
                 ls /usr/local/cuda/lib64/libcufile* 2>/dev/null | head -2 || true' ;;
    start) if [ "${DRY:-0}" = 1 ]; then
             step fast_start "$PYTHON" -m bench.probes.fast_start --model llama-3.1-8b --count 100 \
                 --out "$adapters/lora-cache-fast-start" --keep "$out/fast_start"
             step gpu_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE tests
           else
             ( CUDA_VISIBLE_DEVICES=1 timeout "${TESTS_S:-200}" "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE \
                 tests > "$logs/gpu_tests.log" 2>&1; echo "=== gpu_tests rc=$?" >> "$logs/gpu_tests.log" ) &
             tests=$!
             CUDA_VISIBLE_DEVICES=0 step fast_start timeout 300 "$PYTHON" -m bench.probes.fast_start \
                 --model llama-3.1-8b --count 100 --out "$adapters/lora-cache-fast-start" --keep "$out/fast_start"
             wait "$tests"
             echo "=== gpu_tests (beside fast_start, GPU 1):"; tail -n "$TAIL" "$logs/gpu_tests.log"
             grep -q "gpu_tests rc=0" "$logs/gpu_tests.log" || failed=$((failed + 1))
           fi ;;
    tp)    step tp_ready-8b timeout 150 "$PYTHON" -m bench.probes.tp_ready --tp 4 --model llama-3.1-8b --ranks 16,64 \
                --count 4 --out "$out/tp_ready-8b.json"
           step tp_ready-70b timeout 200 "$PYTHON" -m bench.probes.tp_ready --tp 4 --model llama-3.1-70b --ranks 16,64 \
                --count 4 --out "$out/tp_ready-70b.json" ;;
    cold)  cold cold-8b-r16 llama-3.1-8b 16 --readers auto --ref-threads 8
           cold cold-8b-r64 llama-3.1-8b 64 --readers 1,auto --ref-threads 8
           cold cold-70b-r64 llama-3.1-70b 64 --readers auto --ref-threads 8 ;;
    *) echo "unknown part $part (host, start, tp, cold)" >&2; exit 2 ;;
  esac
done
if [ "${PACK:-0}" = 1 ] && [ "${DRY:-0}" != 1 ]; then
  (cd "$out" && find . -name adapters -prune -o -type f \( -name '*.json' -o -name '*.log' \) -print \
     | tar czf issue30.tgz -T - && find . -mindepth 1 -maxdepth 1 ! -name issue30.tgz -exec rm -rf {} +)
fi
exit "$failed"
