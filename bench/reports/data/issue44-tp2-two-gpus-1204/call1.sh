#!/usr/bin/env bash
# thirty-third session, on two H200s: the engine's two-GPU tests (skipped on one GPU for many sessions), item 5's
# push at TP 2 with each rank on its own GPU (the goal's configuration), and the floor of a push at TP 2 there
set -u
W=$OUT
nvidia-smi -L > "$W/gpus.txt"
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_engine.py -k "tp2_equals_tp1 or real_shape" \
  > "$W/tp2-tests.txt" 2>&1; echo "rc=$?" >> "$W/tp2-tests.txt"
timeout 150 python -m bench.probes.push --tp 2 --model llama-3.1-8b --rank 16 --pushes 6 --source gpu \
  --out "$W/push8b-tp2.json" > "$W/push8b-tp2.txt" 2>&1; echo "rc=$?" >> "$W/push8b-tp2.txt"
timeout 100 python -m bench.probes.push_floor --model llama-3.1-8b --rank 16 --tp 2 --repeats 20 \
  --out "$W/floor8b-tp2.json" > "$W/floor8b-tp2.txt" 2>&1; echo "rc=$?" >> "$W/floor8b-tp2.txt"
