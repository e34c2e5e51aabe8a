#!/usr/bin/env bash
# Issue 30 item 1 on one 4-GPU host, in one call (under 8 minutes on 4x H100): where a cold shard load's time
# goes, phase by phase, and the item's goals, against references measured in the same run.
#
#   bash bench/gpu/issue30_reads.sh OUT [PART ...]     default: host 8b-r16 8b-r64 70b-r64 pin tests summary
#
# Parts (JSON under OUT, console logs under LOGDIR):
#   host     the GPUs, cores, memory, Python and torch
#   8b-r16   bench.probes.cold_read, llama-3.1-8b rank 16 at TP 4, each of VARIANTS (below); the reference
#            at 8 and 16 threads; rank 0's mechanisms at 8 threads
#   8b-r64   the same, llama-3.1-8b rank 64 (mechanisms at 8 and 16 threads)
#   70b-r64  the same, llama-3.1-70b rank 64 (no mechanisms)
#   pin      item 3: pinning a PIN_GIB [16] shared host arena in place, then in the background with small GPU
#            steps timed meanwhile, then registered in 256 MiB pieces (a copy across two pieces checked)
#            (bench.probes.cold_read --arena-pin; OUT/arena-pin.json)
#   tests    this round's tests (the arena's pinning, phases, split reads) on this host, then the read path's
#            GPU tests (tests/test_gpu.py -k "read or host or load or stage"), each under a TESTS_S guard
#   summary  the goals per shape from the JSON (OUT/summary.md): load / read, cold / memcpy, hit / memcpy,
#            ready / bound, and the phase split of the default row's cold and hit loads
# Each probe row: cold loads (prefetch -> READY through WorkerCache, the file in the page cache, the shard
# dropped from the host tier first) per rank alone and all four at once, host-tier hits all at once, and each
# load's phases (bench.probes.cold_read.phases: dispatch, to_reader, open, plan, read, report/issue lags, reply,
# copy_tail, finish; the reader threads' busy read / crc time).
# Options, from the environment (defaults in brackets):
#   TP [4]: ranks, one GPU each  REPEATS [3]  TESTS_S [120]  ADAPTERS [$TMPDIR]
#   VARIANTS [process:0:0:sample,process:8:1:sample,process:0:0:identity,thread:0:1:sample]: the caches measured,
#            READS:READERS:SPLIT:VERIFY each (0: auto): the default now (process reads, 16 threads over 4
#            processes on a 64-core 4-GPU host), the default before (8 threads in one process), no block check,
#            reads on threads of the worker
#   PACK [0]: 1 packs LOGDIR into OUT/logs.tgz   LOGDIR [OUT/logs]  TAIL [40]  PYTHON [python]  DRY [0]
# Exit status: the number of parts' commands that failed.
set -u
TAIL=${TAIL:-40}
. "$(dirname "$0")/lib.sh"
repeats=${REPEATS:-3}
tp=${TP:-4}
variants=${VARIANTS:-process:0:0:sample,process:8:1:sample,process:0:0:identity,thread:0:1:sample}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(host 8b-r16 8b-r64 70b-r64 pin tests summary)
for part in "${parts[@]}"; do
  case $part in
    host)    step host bash -c 'nvidia-smi -L; echo "cores $(nproc)"; grep -E "MemTotal|MemAvailable" /proc/meminfo;
                   '"$PYTHON"' -c "import torch, sys, zlib; print(sys.version.split()[0], torch.__version__, zlib.ZLIB_RUNTIME_VERSION)";
                   '"$PYTHON"' -c "import isal; print(\"isal\", isal.__version__)" 2>/dev/null || echo "isal: absent"' ;;
    8b-r16)  probe cold-8b-r16 llama-3.1-8b 16 --variants "$variants" --ref-threads 8,16 --mechanisms 8 ;;
    8b-r64)  probe cold-8b-r64 llama-3.1-8b 64 --variants "$variants" --ref-threads 8,16 --mechanisms 8,16 ;;
    70b-r64) probe cold-70b-r64 llama-3.1-70b 64 --variants "$variants" --ref-threads 8,16 ;;
    tests)   step tests timeout "${TESTS_S:-120}" "$PYTHON" -m pytest -q -p no:cacheprovider -rfE -x \
                   tests/test_arena_pin.py tests/test_read_phases.py
             step gpu_tests timeout "${TESTS_S:-120}" "$PYTHON" -m pytest -q -p no:cacheprovider -rfE -m gpu \
                   -k "read or host or load or stage" tests/test_gpu.py ;;
    pin)     step arena-pin "$PYTHON" -m bench.probes.cold_read --arena-pin "${PIN_GIB:-16}" --out "$out/arena-pin.json" ;;
    summary) step summary "$PYTHON" -m bench.probes.cold_read --summary "$out" ;;
    *) echo "unknown part $part (host, 8b-r16, 8b-r64, 70b-r64, pin, tests, summary)" >&2; exit 2 ;;
  esac
done
if [ "${PACK:-0}" = 1 ] && [ "${DRY:-0}" != 1 ]; then
  tar czf "$out/logs.tgz" -C "$(dirname "$logs")" "$(basename "$logs")" && rm -rf "$logs"
fi
exit "$failed"
