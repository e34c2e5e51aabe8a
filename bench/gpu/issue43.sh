#!/usr/bin/env bash
# Issue 43 on one GPU: the paged pool's GPU checks and kernels, the pool that breathes, hit rate and TTFT at equal
# GPU bytes against today's slots.
#
#   bash bench/gpu/issue43.sh OUT [PART ...]      default: checks
#
# PARTs:
#   checks    the GPU tests that read the pool (the paged pool's Triton kernels against their twin, the stream-race
#             and last-use tests on the row-stride-0 pool, the engine's outputs against base + LoRA, CUDA graphs);
#             bench.probes.kernels on the slots' pool and on a paged one (kernels_slots.json, kernels_paged.json);
#             bench.probes.pages (CPU) as pages.json. Options: MODEL [llama-3.1-8b] TOKENS [16,256] RANKS [16,64]
#             MIXES [uniform8,distinct] REPS [20]
#   lend      the lending tests on the GPU (tests/test_lend.py -m gpu: the engine's writes follow the evicted shard's
#             write-back, the next load follows the engine's last use), then bench.probes.give_back --device cuda
#             (give_back.json: the time to give back GIVE_GB [1] GB under load)
#   kv        the engine's borrowed KV rows on the GPU (tests/test_kv_rows.py -m gpu: decode graphs for own rows,
#             eager steps over lent pages, the outputs of own rows) and the engine's other GPU tests
#   kv-trade  bench.probes.kv_trade (kv_trade.json): a fixed engine (32 own KV rows) against a breathing one (8 own
#             rows, the other rows' bytes as adapter pages it borrows back) on a quiet-burst-quiet workload
#   bytes-kv  bench.run --engine real, SCENARIO [seed] (or zipf: as bytes-zipf), one replica, `queue` and `global`
#             (POLICIES), SEED [0]: 32 pages of rank 16 and the engine's own KV cache, then the same pages plus the
#             KV cache's bytes as pages (33 rows of 4 pages at max_seq_len 2048) with --kv-rows KV_ROWS [8]: the KV
#             cache in the pool; SLOTS [15]: the adapters a pool may hold at once (metadata rows), for both runs
#   bytes-seed  bench.run --engine real, the `seed` scenario (16 adapters of ranks 16 and 64, uniform), one
#             replica, the page cache, `queue` and `global` (POLICIES), workload seed SEED [0]: 8 slots of rank 64,
#             then the same bytes as 32 pages of rank 16 (15 slots), each run its own directory
#   bytes-zipf  the same pair on Zipf 1.5 over 100 adapters, the device store (reads from the device), a 4 GiB host
#             tier, Poisson 4/s, 150 warm-up then 200 measured requests, workload seed SEED [0]
# Each bench.run is killed after STEP_LIMIT [240] s. Exit status: the number of parts' commands that failed.
set -u
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] || set -- checks
model=${MODEL:-llama-3.1-8b}
limit=${STEP_LIMIT:-240}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-i43-adapters-$model}
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
pair() {  # NAME ARGS...: the slots' run, then the paged one at the same bytes
  local name=$1; shift
  local common=(--engine real --model "$model" --adapter-ranks 16,64 --no-plots --policies "${POLICIES:-queue,global}"
                --max-rank 64 "$@")
  for pool in slots paged; do
    local extra=(--slots 8)
    [ "$pool" = paged ] && extra=(--slots 15 --page-rank 16 --pool-pages 32)
    step "$name-$pool" timeout -k 15 "$limit" "$PYTHON" -m bench.run "${common[@]}" "${extra[@]}" --out "$out/$name-$pool"
    gz "$out/$name-$pool"
  done
}
gz() {  # DIR: its results.json compressed, where the run wrote one
  if [ -f "$1/results.json" ]; then gzip -f "$1/results.json"; fi
}
for part in "$@"; do
  case $part in
    checks)
      k=(--model "$model" --tokens "${TOKENS:-16,256}" --ranks "${RANKS:-16,64}" --mixes "${MIXES:-uniform8,distinct}"
         --modes bgmv,sgmv --reps "${REPS:-20}" --ref-reps 1)
      step gpu_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_pages.py tests/test_gpu.py \
        tests/test_engine.py -k "not real_shape and not tp2"
      step kernels_slots "$PYTHON" -m bench.probes.kernels "${k[@]}" --out "$out/kernels_slots.json"
      step kernels_paged "$PYTHON" -m bench.probes.kernels "${k[@]}" --paged --out "$out/kernels_paged.json"
      step pages "$PYTHON" -m bench.probes.pages --out "$out/pages.json" ;;
    lend)
      step lend_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_lend.py
      step give_back "$PYTHON" -m bench.probes.give_back --device cuda --model "$model" --give-gb "${GIVE_GB:-1}" \
        --out "$out/give_back.json" ;;
    kv)
      step kv_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_kv_rows.py tests/test_engine.py \
        -k "not real_shape and not tp2" ;;
    kv-trade)
      step kv_trade "$PYTHON" -m bench.probes.kv_trade --model "$model" --out "$out/kv_trade.json" ;;
    bytes-kv)
      kv=(--engine real --model "$model" --adapter-ranks 16,64 --no-plots --policies "${POLICIES:-queue,global}"
          --max-rank 64 --workload-seed "${SEED:-0}" --slots "${SLOTS:-15}" --page-rank 16)
      if [ "${SCENARIO:-seed}" = zipf ]; then
        kv+=(--scenario zipf --num-adapters 100 --adapters "$adapters" --max-adapters 4 --warmup-requests 150
             --requests 200 --arrivals poisson:4 --host-bytes 4294967296 --store device)
      else
        kv+=(--scenario seed --num-adapters 16 --max-adapters 8 --warmup-requests 100 --requests 200 --store page-cache)
      fi
      name="bytes-kv-${SCENARIO:-seed}-s${SEED:-0}-slots${SLOTS:-15}"
      step "$name-own" timeout -k 15 "$limit" "$PYTHON" -m bench.run "${kv[@]}" --pool-pages 32 --out "$out/$name-own"
      step "$name-pool" timeout -k 15 "$limit" "$PYTHON" -m bench.run "${kv[@]}" --pool-pages 164 \
        --kv-rows "${KV_ROWS:-8}" --out "$out/$name-pool"
      gz "$out/$name-own"
      gz "$out/$name-pool" ;;
    bytes-seed)
      pair "bytes-seed-s${SEED:-0}" --scenario seed --num-adapters 16 --max-adapters 8 --warmup-requests 100 \
        --requests 200 --store page-cache --workload-seed "${SEED:-0}" ;;
    bytes-zipf)
      pair "bytes-zipf-s${SEED:-0}" --scenario zipf --num-adapters 100 --adapters "$adapters" --max-adapters 4 \
        --warmup-requests 150 --requests 200 --arrivals poisson:4 --host-bytes 4294967296 --store device \
        --workload-seed "${SEED:-0}" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
exit "$failed"
