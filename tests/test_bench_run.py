"""The benchmark job's quick configuration through the real path on the CPU: every figure present and sane.

``python -m bench.run --quick`` in a subprocess: an embedded Ray, per policy a fresh controller, two
replicas of one worker each hosting the reference engine (tiny shape), the gRPC gateway and a router.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("ondemand", "overlap", "queue", "global", "oracle", "pipelined")
LATENCY = [f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")]
CACHE = ("gpu_hit_rate", "host_hit_rate", "prefetch_accuracy", "mean_load_wait_ms", "p99_load_wait_ms",
         "median_time_to_ready_ms", "p99_time_to_ready_ms", "loads", "evictions", "bytes_host_to_gpu",
         "bytes_disk_to_host")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    out = tmp_path_factory.mktemp("bench-quick")
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, json.loads((out / "results.json").read_text()), out


def test_every_policy_serves_every_request(quick) -> None:
    proc, doc, _ = quick
    requests = doc["config"]["workload"]["requests"]
    assert list(doc["figures"]) == list(POLICIES)
    for name, figs in doc["figures"].items():
        assert (figs["completed"], figs["failed"]) == (requests, 0), name
        assert len(doc["requests"][name]) == requests
        assert f"| {name} |" in proc.stdout


def test_every_figure_is_present_and_sane(quick) -> None:
    _, doc, _ = quick
    for name, f in doc["figures"].items():
        missing = [k for k in (*LATENCY, *CACHE, "request_throughput", "output_throughput") if k not in f]
        assert not missing, (name, missing)
        for m in ("ttft", "tpot", "itl", "e2el"):
            assert 0 <= f[f"median_{m}_ms"] <= f[f"p90_{m}_ms"] <= f[f"p99_{m}_ms"], (name, m)
        assert 0 < f["mean_ttft_ms"] <= f["mean_e2el_ms"], name
        assert f["request_throughput"] > 0 and f["output_throughput"] > 0
        assert 0 <= f["gpu_hit_rate"] <= 1 and 0 <= f["host_hit_rate"] <= 1
        assert f["prefetch_accuracy"] is None or 0 <= f["prefetch_accuracy"] <= 1
        moved = sum(x["nbytes"] for x in doc["loads"][name])
        assert f["bytes_host_to_gpu"] == moved, name  # the counters and the load log agree
        assert f["loads"] == len(doc["loads"][name]), name
        for r in doc["requests"][name]:
            assert r["arrival_s"] <= r["prefill_s"] <= r["first_token_s"] <= r["finish_s"], (name, r)


def test_policies_behave_as_defined(quick) -> None:
    _, doc, _ = quick
    f = doc["figures"]
    adapters = doc["config"]["adapters"]
    assert adapters > doc["config"]["bench"]["slots"]  # more adapters than slots
    assert f["oracle"]["loads"] == 0 and f["oracle"]["gpu_hit_rate"] == 1.0  # everything resident at t=0
    assert f["oracle"]["mean_load_wait_ms"] == 0
    assert f["ondemand"]["prefetches"] == 0  # on first use only, in the step
    assert f["ondemand"]["demand_loads"] > 0
    # pipelined loads as overlap does (prefetches for held-back requests); a request runs layer by layer on a copy
    # the engine reports issued (LOADING), in the next batch (issue 31)
    assert f["pipelined"]["loads"] > 0 and f["pipelined"]["prefetches"] > 0
    assert f["global"]["prefetches"] > 0  # hints and queue reports reached the planner, which prefetched
    ranks = doc["ranks"]["ondemand"]
    assert {(r["replica"], r["rank"]) for r in ranks} == {("replica-0", 0), ("replica-1", 0)}


def test_start_up_host_tier_and_tier_costs_are_reported(quick) -> None:
    """Issue 30: each real policy run's start-up phases, one host tier for every policy, the miss cost per tier."""
    proc, doc, _ = quick
    assert doc["config"]["host_tier"] == {"host_bytes_per_rank": 2 << 30, "same_for_every_policy": True}
    assert "host tier: 2.00 GiB per rank, the same for every policy" in proc.stderr
    assert "| miss cost per tier |" in proc.stdout
    for name, f in doc["figures"].items():
        phases = doc["startup"][name]
        assert 0 < phases["service_s"] < f["start_to_first_request_s"] == phases["to_first_request_s"], name
        assert phases["engine_build_s"] >= phases["rank_warm_up_s"] >= 0, name
        assert f["gpu_hits"] + f["host_hit_loads"] + f["disk_loads"] > 0, name
        assert f["host_hit_loads"] + f["disk_loads"] == len(doc["loads"][name]), name
        assert f"policy {name}: start to first request" in proc.stderr


def test_outputs_are_written(quick) -> None:
    _, doc, out = quick
    for png in ("ttft_cdf.png", "cache_over_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["config"]["bench"]["model"] == "tiny" and doc["config"]["workload"]["popularity"] == "zipf:1.5"
    assert set(doc["timeline"]) == set(POLICIES)
    assert doc["steps"]["global"] and {"kind", "tokens", "ms"} <= set(doc["steps"]["global"][0])
