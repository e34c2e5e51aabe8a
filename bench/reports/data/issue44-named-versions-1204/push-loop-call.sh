#!/usr/bin/env bash
# thirty-third session: push_loop with requests naming a version K pushes behind the newest (ondemand admission,
# a push every 0.25 s), this tree against the engine files before the named-versions change (2f85bc5): CPU ranks
# (tiny, TP 2, audited), on the GPU host's 16 cores
set -u
W=/tmp/w7; mkdir -p "$W"
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ && rm -rf /tmp/old/.device
cp .device/old/feed.py .device/old/hosted.py .device/old/rank.py /tmp/old/workers/engine/
cp .device/old/versions.py /tmp/old/workers/attach/
SITE=/tmp/site
for run in 1 2; do
  for tree in new old; do
    dir=$PWD; [ $tree = old ] && dir=/tmp/old
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout 120 python -m bench.probes.push_loop --seconds 15 --rate 20 --tp 2 \
       --push-every 0.25 --staleness 2 --keep-versions 2 --admission ondemand --out "$W/cpu-$tree-$run.jsonl" \
       --summary "$W/cpu-$tree-$run.json" > "$W/cpu-$tree-$run.txt" 2>&1; echo "rc=$?" >> "$W/cpu-$tree-$run.txt")
  done
done
tar czf "$OUT/all.tgz" -C "$W" .
