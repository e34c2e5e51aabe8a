#!/usr/bin/env bash
# Issue 42 on one 2-GPU host: where a miss hurts (the device store: every read from the device, the page cache
# bypassed) and where it does not (the page cache), `global` behind Route and behind affinity against the best
# baselines and the oracle, at equal GPU slots and host tier, with the engine's defaults (--max-adapters 4).
#
#   bash bench/gpu/issue42.sh OUT [PART ...]      default: dev2-aff dev2-route
#
# PARTs (each one bench.run into OUT/PART, results.json gzipped, its log under OUT/logs):
#   dev2-aff     2 replicas x TP 1, device store, affinity router: queue, global, oracle (--check-sim)
#   dev2-route   2 replicas x TP 1, device store, Route (lora-cache router): global (--check-sim)
#   dev2-oracle  2 replicas x TP 1, device store: the oracle alone (where dev2-aff's step limit cut it)
#   dev2-oracle-route  2 replicas x TP 1, device store, Route, workload seed SEED [0]: the oracle (behind affinity at
#                --max-adapters 4 the oracle spreads every adapter over both replicas' adapter lanes and is no lower
#                bound), named by the seed
#   dev2-full    2 replicas x TP 1, device store, a host tier of FULL_HOST_BYTES [24 GiB] per rank (holds the
#                catalog), workload seed SEED [0]: global behind Route, queue and global behind affinity, the
#                oracle behind Route; one bench.run each
#   dev2-pair    2 replicas x TP 1, device store, workload seed SEED [0]: `global` behind Route, then `queue` behind
#                affinity (the pair a goal is judged on; with MAX_ADAPTERS=8 the engine's larger batch), one
#                bench.run each, named by the seed and MAX_ADAPTERS, so that calls for several seeds sum up
#   dev2-queue   dev2-pair's second run alone: `queue` behind affinity for SEED
#   dev2-tiers   2 replicas x TP 1, device store, workload seed SEED [0]: `global` behind Route with inclusive, then
#                exclusive host tiers (--host-tiers: a GPU load lets go of its host copy, an evicted slot's shard is
#                written back), one bench.run each, named by MAX_ADAPTERS, the seed and the tiers (an A/B in one call)
#   dev2-ll      2 replicas x TP 1, device store, least-loaded router: overlap
#   dev1         1 replica, device store: queue, global, oracle (--check-sim)
#   pc2-aff      2 replicas x TP 1, page-cache store, affinity: queue, global
#   pc2-route    2 replicas x TP 1, page-cache store, Route: global
#   dev2-seed    2 replicas x TP 1, device store, workload seed SEED [0]: queue, global and the oracle behind
#                affinity, then global behind Route (one call per seed: the p99 is judged on several runs)
#   dev1-seed    1 replica, device store, workload seed SEED [0]: POLICIES [queue,global,oracle], named by both and
#                HOST_EVICTION if given (where one GPU is lent; one policy per run fits STEP_LIMIT with the warm-up)
#   s3-1         1 replica, the S3 store (moto's server behind the throttling proxy, bench/store.py) at S3
#                [s3:200MBps,30ms], workload seed SEED [0]: POLICIES [queue,global] in one bench.run (the catalog is
#                uploaded once per run), named by MAX_ADAPTERS, the seed, DISK_BYTES (the node's disk tier, if given;
#                default the service's 64 GiB, which holds the catalog) and the policies
#   sh2          2 replicas x TP 1 sharing ONE GPU (--gpu-share 0.5: where only one-GPU hosts are lent; the two
#                engines share its compute and copy engines, so not the 2-GPU fleet), the store SH2_STORE [device],
#                workload seed SEED [0]: `global` behind Route, `global` behind affinity, `queue` behind affinity,
#                one bench.run each, named by the store, MAX_ADAPTERS and the seed (Route against affinity, item 5);
#                SH2_RUNS [route-global aff-global aff-queue] picks and orders them (three do not fit one call)
#   sh2-order    sh2's fleet on SH2_STORE [s3:200MBps,30ms]: POL [global] behind ROUTER [lora-cache] once per demand
#                fetch order in ORDERS [soonest shared] (--fetch-order: the node's demand fetches one at a time, the one
#                that ends soonest alone first, or all at once), the node's disk tier DISK_BYTES if given, one bench.run
#                each (an A/B in one call)
# The workload: Zipf 1.5 over NUM_ADAPTERS [100] adapters of ranks 16 and 64 (Llama-3.1-8B shapes), Poisson RATE
# [4] requests/s per replica, REQUESTS [200] measured after WARMUP [300] warm-up requests (bench/warmup.py: long
# enough for the warm stages to fill the host tiers at the device's ~1.2 GB/s), the host tier
# HOST_BYTES [4 GiB] per rank: about a quarter of the catalog's shard bytes, its tiers TIERS [exclusive] (every part
# but dev2-tiers, which names its own), its eviction order HOST_EVICTION [bench.run's default]; DIRECT=1: the
# workers read cold adapter files with O_DIRECT (--direct-reads on; dev1-seed's run names end in -direct), DIRECT=auto: each
# file system and shard size tries each way and takes the fastest (--direct-reads auto; names end in -auto), DIRECT=ahead: a
# cold file is asked for whole as its read starts (--read-ahead; names end in -ahead). Each run is
# killed after STEP_LIMIT
# [280] s; a run that finds ADAPTERS short of the catalog (a fresh machine: it makes the adapters first, ~2 min for
# the 8B catalog) gets MAKE_S [300] s more. Exit status: the number of runs that failed.
set -u
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] || set -- dev2-aff dev2-route
model=${MODEL:-llama-3.1-8b}
adapters=${ADAPTERS:-${TMPDIR:-/tmp}/lora-cache-i42-adapters-$model}
rate=${RATE:-4}
limit=${STEP_LIMIT:-280}
common=(--engine real --model "$model" --adapter-ranks 16,64 --adapters "$adapters" --no-plots --scenario zipf
        --num-adapters "${NUM_ADAPTERS:-100}" --requests "${REQUESTS:-200}" --host-bytes "${HOST_BYTES:-4294967296}"
        --max-adapters "${MAX_ADAPTERS:-4}" --warmup-requests "${WARMUP:-300}" --host-tiers "${TIERS:-exclusive}"
        ${HOST_EVICTION:+--host-eviction "$HOST_EVICTION"} --direct-reads "$(case ${DIRECT:-0} in 1) echo on ;; auto) echo auto ;; *) echo off ;; esac)"
        $([ "${DIRECT:-0}" = ahead ] && echo --read-ahead))
[ "${DRY:-0}" = 1 ] || nvidia-smi -L
made() {  # whether ADAPTERS holds NUM_ADAPTERS adapters already (else the next run makes them within its limit)
  [ "$(find "$adapters" -maxdepth 2 -name adapter_config.json 2>/dev/null | wc -l)" -ge "${NUM_ADAPTERS:-100}" ]
}
run() {  # NAME ARGS...
  local name=$1 this=$limit; shift
  made || this=$((limit + ${MAKE_S:-300}))
  step "$name" timeout -k 15 "$this" "$PYTHON" -m bench.run "${common[@]}" "$@" --out "$out/$name"
  if [ -f "$out/$name/results.json" ]; then gzip -f "$out/$name/results.json"; fi
}
two=(--replicas 2 --tp 1 --arrivals "poisson:$((rate * 2))")
for part in "$@"; do
  case $part in
    dev2-aff)   run "$part" "${two[@]}" --store device --router affinity --policies queue,global,oracle --check-sim ;;
    dev2-route) run "$part" "${two[@]}" --store device --router lora-cache --policies global --check-sim ;;
    dev2-oracle) run "$part" "${two[@]}" --store device --router affinity --policies oracle ;;
    dev2-oracle-route) run "dev2-oracle-route-s${SEED:-0}" "${two[@]}" --workload-seed "${SEED:-0}" --store device \
                  --router lora-cache --policies oracle ;;
    dev2-full)  full=(--host-bytes "${FULL_HOST_BYTES:-25769803776}" --workload-seed "${SEED:-0}" --store device)
                run "dev2-full-route-s${SEED:-0}" "${two[@]}" "${full[@]}" --router lora-cache --policies global
                run "dev2-full-aff-s${SEED:-0}" "${two[@]}" "${full[@]}" --router affinity --policies queue,global
                run "dev2-full-oracle-s${SEED:-0}" "${two[@]}" "${full[@]}" --router lora-cache --policies oracle ;;
    dev2-pair)  pair=(--workload-seed "${SEED:-0}" --store device)
                run "dev2-route-m${MAX_ADAPTERS:-4}-s${SEED:-0}" "${two[@]}" "${pair[@]}" --router lora-cache --policies global
                run "dev2-queue-m${MAX_ADAPTERS:-4}-s${SEED:-0}" "${two[@]}" "${pair[@]}" --router affinity --policies queue ;;
    dev2-queue) run "dev2-queue-m${MAX_ADAPTERS:-4}-s${SEED:-0}" "${two[@]}" --workload-seed "${SEED:-0}" --store device \
                  --router affinity --policies queue ;;
    dev2-tiers) for tiers in inclusive exclusive; do  # the last --host-tiers wins in argparse
                  run "dev2-route-m${MAX_ADAPTERS:-4}-s${SEED:-0}-$tiers" "${two[@]}" --workload-seed "${SEED:-0}" \
                    --store device --router lora-cache --policies global --host-tiers "$tiers"
                done ;;
    dev2-ll)    run "$part" "${two[@]}" --store device --router least-loaded --policies overlap ;;
    dev1)       run "$part" --replicas 1 --arrivals "poisson:$rate" --store device --policies queue,global,oracle --check-sim ;;
    pc2-aff)    run "$part" "${two[@]}" --store page-cache --router affinity --policies queue,global ;;
    pc2-route)  run "$part" "${two[@]}" --store page-cache --router lora-cache --policies global ;;
    dev2-seed)  seed=(--workload-seed "${SEED:-0}")
                run "dev2-aff-s${SEED:-0}" "${two[@]}" "${seed[@]}" --store device --router affinity --policies queue,global,oracle
                run "dev2-route-s${SEED:-0}" "${two[@]}" "${seed[@]}" --store device --router lora-cache --policies global ;;
    dev1-seed)  run "dev1-s${SEED:-0}${POLICIES:+-${POLICIES//,/-}}${HOST_EVICTION:+-$HOST_EVICTION}$(case ${DIRECT:-0} in 1) echo -direct ;; auto) echo -auto ;; ahead) echo -ahead ;; esac)" --replicas 1 --arrivals "poisson:$rate" --workload-seed "${SEED:-0}" \
                  --store device --policies "${POLICIES:-queue,global,oracle}" ;;
    s3-1)       p=${POLICIES:-queue,global}; d=${DISK_BYTES:+-d$((DISK_BYTES >> 30))}
                run "s3-1-m${MAX_ADAPTERS:-4}-s${SEED:-0}$d-${p//,/-}" --replicas 1 --arrivals "poisson:$rate" \
                  --workload-seed "${SEED:-0}" --store "${S3:-s3:200MBps,30ms}" --policies "$p" \
                  ${DISK_BYTES:+--disk-bytes "$DISK_BYTES"}
                rm -rf "$out"/s3-1-*/disk-tier ;;  # the runs' fetched copies (bench.run removes each policy's)
    sh2)        st=${SH2_STORE:-device}; sh=(--replicas 2 --tp 1 --gpu-share 0.5 --arrivals "poisson:$((rate * 2))"
                    --workload-seed "${SEED:-0}" --store "$st")
                tag="${st%%:*}-m${MAX_ADAPTERS:-4}-s${SEED:-0}"
                runs=${SH2_RUNS:-route-global aff-global aff-queue}
                for r in $runs; do  # every name checked before the first run starts
                  case $r in route-global|aff-global|aff-queue) ;;
                    *) echo "SH2_RUNS: unknown run $r; give route-global, aff-global or aff-queue" >&2; exit 2 ;;
                  esac
                done
                for r in $runs; do
                  case $r in
                    route-global) run "sh2-$r-$tag" "${sh[@]}" --router lora-cache --policies global ;;
                    aff-global)   run "sh2-$r-$tag" "${sh[@]}" --router affinity --policies global ;;
                    aff-queue)    run "sh2-$r-$tag" "${sh[@]}" --router affinity --policies queue ;;
                  esac
                done
                rm -rf "$out"/sh2-*/disk-tier ;;
    sh2-order)  st=${SH2_STORE:-s3:200MBps,30ms}; sh=(--replicas 2 --tp 1 --gpu-share 0.5 --arrivals "poisson:$((rate * 2))"
                    --workload-seed "${SEED:-0}" --store "$st")
                tag="${st%%:*}-m${MAX_ADAPTERS:-4}-s${SEED:-0}"
                for o in ${ORDERS:-soonest shared}; do
                  run "sh2-order-$o-${POL:-global}-${ROUTER:-lora-cache}-$tag" "${sh[@]}" --router "${ROUTER:-lora-cache}" \
                    --policies "${POL:-global}" --fetch-order "$o" ${DISK_BYTES:+--disk-bytes "$DISK_BYTES"}
                  rm -rf "$out"/sh2-order-*/disk-tier
                done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
exit "$failed"
