#!/usr/bin/env bash
# thirty-third session, on two H200s (second call): the engine's two-GPU test alone, with room to finish
set -u
timeout 330 python -u -m pytest -v -p no:cacheprovider -m gpu tests/test_engine.py -k "tp2_equals_tp1" \
  > "$OUT/tp2-test.txt" 2>&1; echo "rc=$?" >> "$OUT/tp2-test.txt"
