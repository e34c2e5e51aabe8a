#!/usr/bin/env bash
# thirty-third session: the GPU tests at this tree (the engine's ranks keep named older versions), and the
# versions/feed CPU tests on the GPU host
set -u
W=/tmp/w5; mkdir -p "$W"
timeout 480 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_versions.py tests/test_gpu.py tests/test_kernels.py tests/test_kv_rows.py tests/test_lend.py tests/test_engine.py tests/test_pages.py tests/test_push.py tests/test_arena_pin.py 2>&1 | tail -30 > "$W/gpu-tests.txt"
echo "rc=$?" >> "$W/gpu-tests.txt"
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_versions.py tests/test_feed.py 2>&1 | tail -5 > "$W/cpu-tests.txt"
nvidia-smi -L >> "$W/cpu-tests.txt"
tar czf "$OUT/all.tgz" -C "$W" .
