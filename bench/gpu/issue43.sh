#!/usr/bin/env bash
# Issue 43 on one GPU, one call: the paged pool's GPU checks and the kernels on it against slots.
#
#   bash bench/gpu/issue43.sh OUT
#
# Parts: the GPU tests that read the pool (the paged pool's Triton kernels against their twin, the stream-race
# and last-use tests on the row-stride-0 pool, the engine's outputs against base + LoRA, CUDA graphs); then
# bench.probes.kernels on the slots' pool and on a paged one (the same adapters in shuffled pages, offsets from
# each one's pages), as kernels_slots.json and kernels_paged.json; then bench.probes.pages (CPU) as pages.json.
# Options: MODEL [llama-3.1-8b]  TOKENS [16,256]  RANKS [16,64]  MIXES [uniform8,distinct]  REPS [20]
# Exit status: the number of parts' commands that failed.
set -u
. "$(dirname "$0")/lib.sh"
model=${MODEL:-llama-3.1-8b}
k=(--model "$model" --tokens "${TOKENS:-16,256}" --ranks "${RANKS:-16,64}" --mixes "${MIXES:-uniform8,distinct}"
   --modes bgmv,sgmv --reps "${REPS:-20}" --ref-reps 1)
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
step gpu_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_pages.py tests/test_gpu.py \
  tests/test_engine.py -k "not real_shape and not tp2"
step kernels_slots "$PYTHON" -m bench.probes.kernels "${k[@]}" --out "$out/kernels_slots.json"
step kernels_paged "$PYTHON" -m bench.probes.kernels "${k[@]}" --paged --out "$out/kernels_paged.json"
step pages "$PYTHON" -m bench.probes.pages --out "$out/pages.json"
exit "$failed"
