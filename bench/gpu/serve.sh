#!/usr/bin/env bash
# Issue 32, item 1: one Ray Serve app (examples/ray_serve_lora.py) on the GPUs, routed by lora-cache's router
# (LoraCacheRouter, the controller planning the slots) against Ray Serve's own multiplexed routing, at equal GPU
# memory, in one device call of under BUDGET seconds (first-run costs included: adapters, kernels, engines).
#
#   bash bench/gpu/serve.sh OUT
#
# Runs, in this order, each one `python -m bench.probes.ray_serve --device cuda` (REPLICAS Serve replicas, one GPU
# each, the reference engine in bfloat16 with CUDA graphs, MODEL-shaped adapters of RANKS, SLOTS slots and HOST_MIB of
# pinned host tier per replica under both routings; an open loop of REQUESTS Poisson arrivals at RATE requests/s,
# Zipf popularity over COUNT adapters, INPUT_LEN-token prompts, one output token: TTFT mean/p99, GPU hit rate, loads;
# --fresh-state: the second routing's controller does not inherit the first's popularity counts):
#   env         the probe's --preflight: its options checked, the imports the runs need (ray, ray.serve, fastapi,
#               the app) and their versions, in seconds
#   adapters    the probe's --write-adapters: the missing adapters written (progress per part), before the timed
#               runs (the first GPU try spent its whole step writing them, bench/RESULTS.md)
#   serve       both routings, serve then lora-cache, SEED: OUT/serve.json
#   serve-again both again, lora-cache then serve, SEED + 1: OUT/serve-again.json, only while the call's time plus
#               EST seconds stays under BUDGET
# then OUT/ray-logs.tar.gz: Ray's session logs (the replicas' own output), cut down to fit the files-back limits.
# At most 7 files: OUT/serve.json, OUT/serve-again.json, OUT/ray-logs.tar.gz, OUT/logs/{env,adapters,serve,serve-again}.log.
# Options, from the environment (defaults in brackets): DEVICE [cuda] (cpu: the same on the CPU with the tiny model,
# to try the script anywhere; its defaults in brackets after the GPU's), MODEL [llama-3.1-8b | tiny],
# RANKS [16,64 | 8,16], ADAPTERS [$TMPDIR/lora-cache-bench-adapters-MODEL: written once, reused], COUNT [64 | 16],
# REPLICAS [4 | 3], SLOTS [4], REQUESTS [300 | 40], RATE [40 | 12], INPUT_LEN [512 | 64], HOST_MIB [8192 | 16],
# SEED [0], BUDGET [480], EST [150 | 60], EXTRA [] (more probe options), and those of lib.sh (LOGDIR, TAIL, PYTHON,
# DRY). Exit status: the number of steps that failed (a skipped one is not a failure).
set -u
. "$(dirname "$0")/lib.sh"
device=${DEVICE:-cuda}
if [ "$device" = cuda ]; then g=1; else g=0; fi
pick() { if [ "$g" = 1 ]; then echo "$1"; else echo "$2"; fi; }  # GPU default, CPU default
model=${MODEL:-$(pick llama-3.1-8b tiny)}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-bench-adapters-$model}
budget=${BUDGET:-480}
est=${EST:-$(pick 150 60)}
seed=${SEED:-0}
read -r -a extra <<< "${EXTRA:-}"
common=(--device "$device" --model "$model" --adapter-ranks "${RANKS:-$(pick 16,64 8,16)}" --adapter-dir "$adapters"
        --adapters "${COUNT:-$(pick 64 16)}" --replicas "${REPLICAS:-$(pick 4 3)}" --slots "${SLOTS:-4}"
        --requests "${REQUESTS:-$(pick 300 40)}" --rate "${RATE:-$(pick 40 12)}" --input-len "${INPUT_LEN:-$(pick 512 64)}"
        --host-mib "${HOST_MIB:-$(pick 8192 16)}" --fresh-state)
export PYTHONUNBUFFERED=1
left() { local l=$((budget - SECONDS - 15)); [ "$l" -gt 30 ] || l=30; echo "$l"; }  # a step's own limit
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
step env "$PYTHON" -m bench.probes.ray_serve "${common[@]}" --preflight
step adapters timeout -k 15 "$(left)" "$PYTHON" -m bench.probes.ray_serve "${common[@]}" --write-adapters
step serve timeout -k 15 "$(left)" "$PYTHON" -m bench.probes.ray_serve "${common[@]}" --seed "$seed" \
     --routings serve,lora-cache "${extra[@]}" --json "$out/serve.json"
spent=$SECONDS
[ "${DRY:-0}" = 1 ] && spent=$est
if [ $((spent + est)) -le "$budget" ]; then
  step serve-again timeout -k 15 "$(left)" "$PYTHON" -m bench.probes.ray_serve "${common[@]}" \
       --seed "$((seed + 1))" --routings lora-cache,serve "${extra[@]}" --json "$out/serve-again.json"
else
  echo "=== serve-again skipped: $spent s spent, about $est s more needed, budget $budget s"
fi
logs_dir=${TMPDIR:-/tmp}/ray/session_latest/logs
if [ "${DRY:-0}" != 1 ] && [ -d "$logs_dir" ]; then  # the largest files left out until the tarball fits (16 MiB)
  (cd "$logs_dir" && find . -type f -printf '%s %p\n' | sort -n | awk '{s += $1; if (s < 40e6) print $2}' \
     > "$out/.ray-logs" && tar czf "$out/ray-logs.tar.gz" -T "$out/.ray-logs"; rm -f "$out/.ray-logs")
  ls -la "$out/ray-logs.tar.gz"
fi
echo "=== done in ${SECONDS} s; failed: $failed"
exit "$failed"
