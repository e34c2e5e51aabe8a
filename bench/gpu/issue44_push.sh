#!/usr/bin/env bash
# Issue 44 item 5 on one GPU host: a pushed version to READY against its shards' host-to-device copy
# (bench.probes.push), and a push's passes over its bytes against their one-thread forms (bench.probes.push_passes).
#
#   bash bench/gpu/issue44_push.sh OUT
#
# TP [2 where two GPUs are seen, else 1]. The 8B rank-16 push probe runs ROUNDS [2] times with PUSHES8 [6] pushes,
# the 70B rank-64 one once with PUSHES70 [3]. OLD=DIR: a copy of an earlier tree (`git archive`), whose push probes
# run after this tree's in the same call (its own PYTHONPATH: SITE [PYTHONPATH's first entry, the device site] and DIR), so that before and after
# share the machine and the hour. JSON per run under OUT (push8b-now-1.json, push8b-old-1.json, ...,
# passes-8b.json, passes-70b.json). Exit status: the number of runs that failed.
set -u
. "$(dirname "$0")/lib.sh"
tp=${TP:-$([ "$(gpus)" -ge 2 ] && echo 2 || echo 1)}
site=${SITE:-${PYTHONPATH:-}}
site=${site%%:*}
old=${OLD:+$(cd "$OLD" && pwd)}
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
push() {  # NAME MODEL RANK PUSHES: this tree's probe, then the old tree's
  local name=$1 model=$2 rank=$3 n=$4
  step "$name-now" "$PYTHON" -m bench.probes.push --tp "$tp" --model "$model" --rank "$rank" --pushes "$n" \
    --out "$out/$name-now.json"
  if [ -n "$old" ]; then
    step "$name-old" env -C "$old" PYTHONPATH="$site:$old" "$PYTHON" -m bench.probes.push --tp "$tp" \
      --model "$model" --rank "$rank" --pushes "$n" --out "$out/$name-old.json"
  fi
}
step passes-8b "$PYTHON" -m bench.probes.push_passes --model llama-3.1-8b --rank 16 --out "$out/passes-8b.json"
step passes-70b "$PYTHON" -m bench.probes.push_passes --model llama-3.1-70b --rank 64 --repeats 3 \
  --out "$out/passes-70b.json"
for round in $(seq "${ROUNDS:-2}"); do
  push "push8b-$round" llama-3.1-8b 16 "${PUSHES8:-6}"
done
push push70b llama-3.1-70b 64 "${PUSHES70:-3}"
exit "$failed"
