#!/usr/bin/env bash
# Issue 30 on one host of TP GPUs: the read path's tests, then cold (page-cache) loads and host-tier hits per TP
# rank against a parallel read and a pinned memcpy measured in the same run (bench/probes/cold_read.py).
#
#   bash bench/gpu/cold_path.sh OUT [PART ...]     default: tests 8b-r16 8b-r64 70b-r64
#
# Parts (figures as JSON under OUT, console logs under LOGDIR):
#   tests     the read path's GPU tests (tests/test_gpu.py), then its CPU tests on this host's cores: parallel
#             reads, reader processes (one thread or four), files changing under split reads, the probe's smoke test
#   8b-r16    llama-3.1-8b rank 16: readers 1 (the single reader) and auto (the default); rank 0's mechanisms
#   8b-r64    llama-3.1-8b rank 64: readers 1,4,8,16,auto; the reference at 1,4,8,16 threads; rank 0's mechanisms
#   70b-r64   llama-3.1-70b rank 64: readers 1 and auto; rank 0's mechanisms
# Options, from the environment (defaults in brackets):
#   TP [4]: ranks, one GPU each   REPEATS [5]   ADAPTERS [$TMPDIR]: where the probes make their adapters
#   PACK [0]: 1 packs LOGDIR into OUT/logs.tgz at the end (fewer files to carry back)
#   LOGDIR [OUT/logs]  TAIL [25]  PYTHON [python, else python3]  DRY [0]: as in bench/gpu/suite.sh
# Exit status: the number of parts' commands that failed.
set -u
. "$(dirname "$0")/lib.sh"
tp=${TP:-4}
repeats=${REPEATS:-5}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests 8b-r16 8b-r64 70b-r64)
if [ "${DRY:-0}" != 1 ]; then
  nvidia-smi -L
  echo "cores: $(nproc)  zlib: $("$PYTHON" -c 'import zlib; print(zlib.ZLIB_RUNTIME_VERSION)')"
fi
cpu_k="parallel or process or reader or during_a_read or returns_its_versions or probe"
for part in "${parts[@]}"; do
  case $part in
    tests)   step gpu_read_tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rfE \
                  -k "read or host or load or stage" tests/test_gpu.py
             step cpu_read_tests "$PYTHON" -m pytest -q -p no:cacheprovider -rfE -k "$cpu_k" \
                  tests/test_read_parallel.py tests/test_host_tier.py tests/test_adapter_files.py \
                  tests/test_bench_cold_read.py ;;
    8b-r16)  probe cold-8b-r16 llama-3.1-8b 16 --readers 1,auto --mechanisms 8,16 ;;
    8b-r64)  probe cold-8b-r64 llama-3.1-8b 64 --readers 1,4,8,16,auto --ref-threads 1,4,8,16 --mechanisms 1,4,8,16 ;;
    70b-r64) probe cold-70b-r64 llama-3.1-70b 64 --readers 1,auto --ref-threads 8,16 --mechanisms 8,16 ;;
    *) echo "unknown part $part (tests, 8b-r16, 8b-r64, 70b-r64)" >&2; exit 2 ;;
  esac
done
if [ "${PACK:-0}" = 1 ] && [ "${DRY:-0}" != 1 ]; then
  tar czf "$out/logs.tgz" -C "$(dirname "$logs")" "$(basename "$logs")" && rm -rf "$logs"
fi
exit "$failed"
