"""``bench.probes.push_floor``: the floor of a push into another process, measured against the shards' copy.

The shard sizes are the push probe's (the model's largest shard of the rank, per TP rank); the checksum that proves
each path copied each rank's own slice tells a slice at another offset or of another length; the probe itself, on
the CPU, starts real rank actors, pushes through the object store to each, checks every rank's slice and reports
the ratios the goal is judged by.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.probes.push_floor import _checksum, shard_bytes
from workers.gpu.copies import host_copy_ms

ROOT = Path(__file__).resolve().parents[1]


def test_a_ranks_shard_is_the_push_probes() -> None:
    assert shard_bytes("llama-3.1-8b", 16, 1, None) == 83_886_080  # the push probe's 8B rank-16 shard at TP 1
    assert shard_bytes("llama-3.1-8b", 16, 2, None) < 83_886_080 < 2 * shard_bytes("llama-3.1-8b", 16, 2, None)
    assert shard_bytes("llama-3.1-8b", 16, 2, 1.5) == 3 << 19


def test_the_reference_copy_is_timed_on_the_cpu_as_on_a_device() -> None:
    assert host_copy_ms(torch.device("cpu"), 1 << 20, repeats=3) > 0  # a memcpy there; a pinned copy on a GPU


def test_the_checksum_tells_a_slice_at_another_offset_or_of_another_length() -> None:
    payload = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    base = _checksum(payload[1024:2048])
    assert _checksum(payload[1024:2048].clone()) == base
    assert _checksum(payload[1025:2049]) != base
    assert _checksum(payload[1024:2047]) != base
    swapped = payload[1024:2048].clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert swapped[3] == swapped[4] or _checksum(swapped) != base  # two bytes swapped in place


@pytest.mark.ray
def test_the_probe_pushes_each_rank_its_slice_and_reports_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, "-m", "bench.probes.push_floor", "--tp", "2", "--cpu", "--mib", "1",
                           "--repeats", "3", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert result["devices"] == ["cpu", "cpu"] and summary["shard_bytes"] == 1 << 20
    assert len(result["call_all_ms"]) == len(result["host_all_ms"]) == 3
    for key in ("copy_ms", "call_ms", "host_ms"):
        assert summary[key] > 0
    assert summary["host_over_copy"] == pytest.approx(summary["host_ms"] / summary["copy_ms"])
    assert "ipc_ms" not in summary  # no GPU: no CUDA IPC path


@pytest.mark.gpu
@pytest.mark.ray
def test_on_a_gpu_each_rank_takes_its_slice_of_the_trainers_memory_by_cuda_ipc(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, "-m", "bench.probes.push_floor", "--tp", "2", "--mib", "3",
                           "--repeats", "3", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]  # the probe checks every rank's slice after each path
    summary = json.loads(out.read_text())["summary"]
    assert summary["ipc_ms"] > 0 and summary["ipc_first_ms"] > 0
