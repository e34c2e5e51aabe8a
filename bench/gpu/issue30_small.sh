#!/usr/bin/env bash
# Issue 30 item 1, the small-shard fixed costs, on ONE GPU at TP 1 (under 200 s on one H100): a cold load's phases
# and the goals for Llama-3.1-8B shards of rank 8 and 16, against references measured in the same run; with
# BEFORE, the same probe from an older tree too, so the phases before and after compare on one card. Everything
# (JSON, summary, console logs) ends up in one tar file: OUT/issue30-small.tgz.
#
#   bash bench/gpu/issue30_small.sh OUT [PART ...]     default: host 8b-r16 before fixed 8b-r8 summary
#
# Parts (under OUT/issue30-small/ until packed):
#   host     the GPU, cores, memory, Python and torch
#   8b-r16   bench.probes.cold_read, llama-3.1-8b rank 16 at TP 1 (an 80 MiB shard), each of VARIANTS; the
#            reference at 8 and 16 threads (cold-8b-r16.json)
#   before   the same probe and command run from BEFORE (a tree holding the older workers/, bench/ and lora_cache/,
#            e.g. `git archive BASE workers bench lora_cache | tar -x -C out/before`; skipped if BEFORE is unset)
#            (before-8b-r16.json)
#   8b-r8    the same, rank 8 (a 40 MiB shard) (cold-8b-r8.json)
#   fixed    bench.probes.fixed_costs, llama-3.1-8b rank 16 at TP 1 on the GPU: the slot metadata's write of a known
#            pattern, a reader's open / plan / whole call (one process of 16 threads; part 1 of 4) (fixed.json);
#            with BEFORE, the same file run against BEFORE's modules too (before/fixed.json)
#   summary  the goals per shape and row and the phases (summary.md, bench.probes.cold_read --summary; the
#            before run's in before/summary.md)
# Options, from the environment (defaults in brackets):
#   REPEATS [5]  ADAPTERS [$TMPDIR]  BEFORE ['']  PYTHON [python]  TAIL [30]  DRY [0]
#   BUDGET [180]: seconds for all the parts: each command gets what is left (timeout), a part that finds none left
#            is skipped, and the tar is made whatever happened
#   VARIANTS [process:0:0:sample,process:8:1:sample]: READS:READERS:SPLIT:VERIFY each (0: auto): the default
#            (16 threads over 4 reader processes on a 16-core host), and 8 threads in one process
# Exit status: the number of parts' commands that failed.
set -u
TAIL=${TAIL:-30}
. "$(dirname "$0")/lib.sh"
top=$out
out=$top/issue30-small
rmdir "$logs" 2>/dev/null  # lib.sh's default, under OUT: this script's logs go into the tar
logs=$out/logs
mkdir -p "$out/before" "$logs"
repeats=${REPEATS:-5}
tp=1
variants=${VARIANTS:-process:0:0:sample,process:8:1:sample}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}}
before=${BEFORE:-}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(host 8b-r16 before fixed 8b-r8 summary)
budget=${BUDGET:-180}
left() { local n=$((budget - SECONDS)); [ "$n" -gt 5 ] && echo "$n" || echo 5; }
cold() {  # NAME RANK OUTDIR ARGS...: one bench.probes.cold_read run at TP 1 within the budget
  local name=$1 rank=$2 dir=$3; shift 3
  step "$name" timeout "$(left)" "$PYTHON" -m bench.probes.cold_read --model llama-3.1-8b --rank "$rank" --tp "$tp" \
       --repeats "$repeats" --adapters "$adapters/lora-cache-cold-llama-3.1-8b-r$rank" --out "$dir/$name.json" \
       --variants "$variants" --ref-threads 8,16 "$@"
}
for part in "${parts[@]}"; do
  if [ "$SECONDS" -ge "$budget" ] && [ "$part" != summary ] && [ "${DRY:-0}" != 1 ]; then
    echo "=== $part skipped: the budget ($budget s) is spent"; continue
  fi
  case $part in
    host)    step host bash -c 'nvidia-smi -L; echo "cores $(nproc)"; grep -E "MemTotal|MemAvailable" /proc/meminfo;
                   '"$PYTHON"' -c "import torch, sys; print(sys.version.split()[0], torch.__version__)"' ;;
    8b-r16)  cold cold-8b-r16 16 "$out" ;;
    8b-r8)   cold cold-8b-r8 8 "$out" ;;
    before)  if [ -z "$before" ]; then echo "=== before skipped: BEFORE is unset"; continue; fi
             step before-8b-r16 bash -c 'cd "$1" && shift && PYTHONPATH=. "$@"' _ "$(cd "$before" && pwd)" \
                  timeout "$(left)" "$PYTHON" -m bench.probes.cold_read --model llama-3.1-8b --rank 16 --tp "$tp" \
                  --repeats "$repeats" --adapters "$adapters/lora-cache-cold-llama-3.1-8b-r16" \
                  --out "$out/before/cold-8b-r16.json" --variants "$variants" --ref-threads 8,16 ;;
    fixed)   step fixed timeout "$(left)" "$PYTHON" -m bench.probes.fixed_costs --model llama-3.1-8b --rank 16 \
                  --tp "$tp" --adapters "$adapters/lora-cache-cold-llama-3.1-8b-r16" --out "$out/fixed.json"
             if [ -n "$before" ]; then
               here=$(pwd)
               step fixed-before bash -c 'cd "$1" && shift && PYTHONPATH=. "$@"' _ "$(cd "$before" && pwd)" \
                    timeout "$(left)" "$PYTHON" "$here/bench/probes/fixed_costs.py" --model llama-3.1-8b --rank 16 \
                    --tp "$tp" --adapters "$adapters/lora-cache-cold-llama-3.1-8b-r16" --out "$out/before/fixed.json"
             fi ;;
    summary) step summary "$PYTHON" -m bench.probes.cold_read --summary "$out"
             if [ -n "$before" ]; then step summary-before "$PYTHON" -m bench.probes.cold_read --summary "$out/before"; fi ;;
    *) echo "unknown part $part (host, 8b-r16, before, 8b-r8, fixed, summary)" >&2; exit 2 ;;
  esac
done
if [ "${DRY:-0}" != 1 ]; then
  tar czf "$top/issue30-small.tgz" -C "$top" issue30-small && rm -rf "$out"
  echo "=== packed $top/issue30-small.tgz"
fi
exit "$failed"
