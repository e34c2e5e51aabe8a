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
# passes-8b.json, passes-70b.json). PARTS [passes push]: which parts run, of passes, push and resolve (request-time
# resolution timed on the GPU, bench.probes.resolve_ttft: 8B adapters of RESOLVE_RANKS [16 64] in moto's S3 server,
# RESOLVE_LATENCY [0,20] ms added per store request, RESOLVE_PAIRS [6]; resolve-8b-rR.json). ARGS: more arguments of
# every push probe (e.g. "--source gpu": the pushed tensors on GPU 0; "--one-gpu" with TP=2: both ranks on GPU 0); the
# old tree runs this tree's probe (copied into it), so that both take the same arguments. PUSHES70=0 leaves the 70B
# out. PARTS may name loop: does a push stall the running batches? A push every second against the 8B reference engine
# (bench.probes.push_loop, TP 1, RATE [20] requests a second for LOOP_S [30] s), once for each of the trainer's tensors
# on each of SOURCES [gpu] (gpu: the engine's GPU, as a colocated RL trainer's; cpu) and the push's pass threads at each
# niceness of NICES [0 10] (LORA_CACHE_PUSH_NICE), LOOP_ROUNDS [3] rounds, the order reversed every other round
# (neither setting always first on a warming machine); loop-nN-R.json (loop-SOURCE-nN-R.json where SOURCES names
# several; the summary: steps overlapping a push against the others) and .jsonl. PARTS may name read: a rank taking
# its shard from the trainer's GPU buffer by one gather launch (the device read's GPU tests, then
# bench.probes.device_read for the 8B rank-16 and the 70B rank-64 at TP READ_TPS [1,2], every rank on GPU r % GPUs;
# read-8b.json, read-70b.json). PARTS may name slots: a push taken into the ranks' slots from the trainer's GPU buffer,
# READY on every rank (the image loads' and the device read's GPU tests, then bench.probes.push_slots, real worker
# actors, for the 8B rank-16 and the 70B rank-64 at TP READ_TPS [1,2]; slots-8b.json, slots-70b.json). PARTS may name
# device: a trainer's device push end to end (bench.probes.push --via DEVICE_VIA [device,device-now,ray] --source gpu
# --one-gpu: the DevicePusher's push registered ahead by the controller (device) or at the call (device-now), every
# rank READY from the buffer by its doorbell, the node copy landed after, each slot checked against the landed file;
# against a push by Ray reference in the same run), the 8B
# rank-16 at each TP of DEVICE_TPS [1 2] with PUSHES8 [6] pushes, the 70B rank-64 at TP 2 with PUSHES70 [3]; the GPU
# tests of the image loads first; device-8b-tpN.json, device-70b-tp2.json; with OLD=DIR, each 8B run is followed by
# the old tree's (device-8b-tpN-old.json). PARTS may name rank: a rank's own part of a device push in one process with
# no Ray (bench.probes.fill_host: its phases after idle gaps, and what each host step costs alone), at each TP of
# DEVICE_TPS; rank-load-tpN.json. Exit status: the number of runs that failed.
set -u
. "$(dirname "$0")/lib.sh"
tp=${TP:-$([ "$(gpus)" -ge 2 ] && echo 2 || echo 1)}
site=${SITE:-${PYTHONPATH:-}}
site=${site%%:*}
old=${OLD:+$(cd "$OLD" && pwd)}
if [ -n "$old" ] && [ "${DRY:-0}" != 1 ]; then  # one probe, one set of arguments
  mkdir -p "$old/bench/probes" && cp bench/probes/push.py "$old/bench/probes/push.py"
fi
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
push() {  # NAME MODEL RANK PUSHES: this tree's probe, then the old tree's
  local name=$1 model=$2 rank=$3 n=$4
  # shellcheck disable=SC2086  # ARGS: words
  step "$name-now" "$PYTHON" -m bench.probes.push --tp "$tp" --model "$model" --rank "$rank" --pushes "$n" \
    ${ARGS:-} --out "$out/$name-now.json"
  if [ -n "$old" ]; then
    # shellcheck disable=SC2086
    step "$name-old" env -C "$old" PYTHONPATH="$site:$old" "$PYTHON" -m bench.probes.push --tp "$tp" \
      --model "$model" --rank "$rank" --pushes "$n" ${ARGS:-} --out "$out/$name-old.json"
  fi
}
parts=" ${PARTS:-passes push} "
if [[ $parts == *" passes "* ]]; then
  step passes-8b "$PYTHON" -m bench.probes.push_passes --model llama-3.1-8b --rank 16 --out "$out/passes-8b.json"
  step passes-70b "$PYTHON" -m bench.probes.push_passes --model llama-3.1-70b --rank 64 --repeats 3 \
    --out "$out/passes-70b.json"
fi
if [[ $parts == *" push "* ]]; then
  for round in $(seq "${ROUNDS:-2}"); do
    push "push8b-$round" llama-3.1-8b 16 "${PUSHES8:-6}"
  done
  [ "${PUSHES70:-3}" = 0 ] || push push70b llama-3.1-70b 64 "${PUSHES70:-3}"
fi
if [[ $parts == *" resolve "* ]]; then
  for rank in ${RESOLVE_RANKS:-16 64}; do
    step "resolve-8b-r$rank" "$PYTHON" -m bench.probes.resolve_ttft --model llama-3.1-8b --rank "$rank" --device cuda \
      --latency-ms "${RESOLVE_LATENCY:-0,20}" --pairs "${RESOLVE_PAIRS:-6}" --cpus 8 --out "$out/resolve-8b-r$rank.json"
  done
fi
if [[ $parts == *" loop "* ]]; then
  read -r -a sources <<< "${SOURCES:-gpu}"
  read -r -a nices <<< "${NICES:-0 10}"
  variants=()
  for source in "${sources[@]}"; do for nice in "${nices[@]}"; do variants+=("$source:$nice"); done; done
  for round in $(seq "${LOOP_ROUNDS:-3}"); do
    order=("${variants[@]}")
    if [ $((round % 2)) = 0 ]; then
      order=(); for ((i = ${#variants[@]} - 1; i >= 0; i--)); do order+=("${variants[i]}"); done
    fi
    for variant in "${order[@]}"; do
      source=${variant%%:*} nice=${variant#*:}
      name=loop-n$nice-$round
      [ "${#sources[@]}" = 1 ] || name=loop-$source-n$nice-$round
      step "$name" env LORA_CACHE_PUSH_NICE="$nice" "$PYTHON" -m bench.probes.push_loop --gpu --tp 1 \
        --model llama-3.1-8b --source "$source" --no-audit --rate "${RATE:-20}" --seconds "${LOOP_S:-30}" \
        --summary "$out/$name.json" --out "$out/$name.jsonl"
    done
  done
fi
if [[ $parts == *" read "* ]]; then
  step read-tests "$PYTHON" -m pytest -q -m gpu tests/test_device_read.py
  step read-8b "$PYTHON" -m bench.probes.device_read --model llama-3.1-8b --rank 16 --tp "${READ_TPS:-1,2}" \
    --out "$out/read-8b.json"
  step read-70b "$PYTHON" -m bench.probes.device_read --model llama-3.1-70b --rank 64 --tp "${READ_TPS:-1,2}" \
    --repeats 10 --out "$out/read-70b.json"
fi
if [[ $parts == *" slots "* ]]; then
  step slots-tests "$PYTHON" -m pytest -q -m gpu tests/test_image_loads.py tests/test_device_read.py
  step slots-8b "$PYTHON" -m bench.probes.push_slots --model llama-3.1-8b --rank 16 --tp "${READ_TPS:-1,2}" \
    --out "$out/slots-8b.json"
  step slots-70b "$PYTHON" -m bench.probes.push_slots --model llama-3.1-70b --rank 64 --tp "${READ_TPS:-1,2}" \
    --repeats 10 --out "$out/slots-70b.json"
fi
if [[ $parts == *" device "* ]]; then
  dvia=${DEVICE_VIA:-device,device-now,ray}
  step device-tests "$PYTHON" -m pytest -q -m gpu tests/test_image_loads.py
  for dtp in ${DEVICE_TPS:-1 2}; do
    # shellcheck disable=SC2086  # ARGS: words
    step "device-8b-tp$dtp" "$PYTHON" -m bench.probes.push --tp "$dtp" --model llama-3.1-8b --rank 16 \
      --pushes "${PUSHES8:-6}" --via "$dvia" --source gpu --one-gpu ${ARGS:-} --out "$out/device-8b-tp$dtp.json"
    if [ -n "$old" ]; then
      # shellcheck disable=SC2086
      step "device-8b-tp$dtp-old" env -C "$old" PYTHONPATH="$site:$old" "$PYTHON" -m bench.probes.push --tp "$dtp" \
        --model llama-3.1-8b --rank 16 --pushes "${PUSHES8:-6}" --via "$dvia" --source gpu --one-gpu ${ARGS:-} \
        --out "$out/device-8b-tp$dtp-old.json"
    fi
  done
  if [ "${PUSHES70:-3}" != 0 ]; then
    # shellcheck disable=SC2086
    step device-70b-tp2 "$PYTHON" -m bench.probes.push --tp 2 --model llama-3.1-70b --rank 64 \
      --pushes "${PUSHES70:-3}" --via "$dvia" --source gpu --one-gpu ${ARGS:-} --out "$out/device-70b-tp2.json"
  fi
fi
if [[ $parts == *" rank "* ]]; then
  for dtp in ${DEVICE_TPS:-1 2}; do
    step "rank-load-tp$dtp" "$PYTHON" -m bench.probes.fill_host --tp "$dtp" --out "$out/rank-load-tp$dtp.json"
  done
fi
exit "$failed"
