"""The control plane's metrics, read back from Ray's Prometheus endpoint (real local cluster)."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start, wait_ready
from lora_cache.planner import PlannerConfig
from lora_cache.runtime.ports import free_port
from lora_cache.vocab import WorkerId
from tests.ray_local import init_local
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

pytestmark = pytest.mark.ray

SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = []
    for line in body.splitlines():
        m = SAMPLE.match(line)
        if m and m["name"].startswith("ray_lora_cache_"):
            out.append((m["name"], dict(LABEL.findall(m["labels"] or "")), float(m["value"])))
    return out


def total(samples, name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items()))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=4, rank="8"))
    port = free_port()
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500})
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=1, tp=2),
                    CatalogConfig(model="tiny", max_rank=8), PlannerConfig(policy="queue"),
                    WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        yield svc, port
        svc.stop()
    finally:
        ray.shutdown()


def present(samples, name: str, **labels: str) -> bool:
    return any(n == name and all(ls.get(k) == x for k, x in labels.items()) for n, ls, _ in samples)


def test_counters_are_exported_from_zero_before_anything_happens(cluster) -> None:
    """Issue 34: counters appeared only after their first increment, so ``rate()`` missed it and dashboards
    said "no data". Runs first in this module: no load, eviction, failure or rejection has happened yet."""
    _, port = cluster
    zeros = [("ray_lora_cache_evictions_total", {"rank": "0"}), ("ray_lora_cache_evictions_total", {"rank": "1"}),
             ("ray_lora_cache_load_failures_total", {"rank": "1"}),
             ("ray_lora_cache_misses_total", {"rank": "0", "tier": "gpu"}),
             ("ray_lora_cache_moved_bytes_total", {"rank": "0", "path": "disk_to_host"}),
             ("ray_lora_cache_cold_reads_total", {"rank": "1", "way": "direct"}),
             ("ray_lora_cache_commands_rejected_total", {"reason": "stale_epoch"}),
             ("ray_lora_cache_load_failures_reported_total", {})]
    deadline, samples = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        samples = scrape(port)
        if all(present(samples, name, **labels) for name, labels in zeros):
            break
        time.sleep(0.5)
    missing = [(name, labels) for name, labels in zeros if not present(samples, name, **labels)]
    assert not missing, f"not exported before their first increment: {missing}"
    assert all(total(samples, name, **labels) == 0 for name, labels in zeros)
    assert not [n for n, _, _ in samples if n.endswith(("_ms", "_ms_count", "_ms_sum", "_ms_bucket"))], \
        "durations are in seconds (Prometheus base units)"


def test_metrics_reach_the_prometheus_endpoint(cluster) -> None:
    svc, port = cluster
    ctl = svc.controller
    ray.get(ctl.report_queue.remote("replica-0", [("adapter-000", time.time()), ("adapter-001", time.time())]))
    wait_ready(ctl, "adapter-001", "replica-0", 30)
    wait_ready(ctl, "adapter-000", "replica-0", 30)
    for rank in (0, 1):  # an engine step on every rank uses adapter-000 (a GPU-tier hit)
        ray.get(svc.workers[WorkerId("replica-0", rank)].step.remote(["adapter-000"]))
    # the queue moves on: adapter-000 (used) and adapter-001 (never used) are evicted for the new ones
    ray.get(ctl.report_queue.remote("replica-0", [("adapter-002", time.time()), ("adapter-003", time.time())]))
    wait_ready(ctl, "adapter-003", "replica-0", 30)
    wait_ready(ctl, "adapter-002", "replica-0", 30)

    want = {
        "ray_lora_cache_hits_total": {"tier": "gpu", "replica": "replica-0", "rank": "1"},
        "ray_lora_cache_misses_total": {"tier": "host", "rank": "0"},
        "ray_lora_cache_moved_bytes_total": {"path": "host_to_gpu", "rank": "1"},
        "ray_lora_cache_prefetches_retired_total": {"outcome": "unused"},
        "ray_lora_cache_time_to_ready_seconds_count": {"rank": "0"},
        "ray_lora_cache_planner_latency_seconds_count": {"policy": "queue"},
        "ray_lora_cache_commands_sent_total": {"kind": "evict"},
        "ray_lora_cache_queue_depth": {"replica": "replica-0"},
    }
    # every rank's figures below, as exported once the periodic export has caught up with both ranks (waiting for
    # any sample of a name was not enough: rank 0's "used" retirement once came one export after rank 1's)
    settled = {("ray_lora_cache_prefetches_retired_total", r, o): 1 for r in ("0", "1") for o in ("used", "unused")}
    # and every rank's copied bytes: the counters are exported each second, the load histograms at each load, so a
    # scrape once had all 4 loads' times and only 3 loads' bytes (CI 2026-12-01: 70656 of 94208 bytes)
    moved = {r: ray.get(svc.workers[WorkerId("replica-0", int(r))].stats.remote())["bytes_host_to_gpu"]
             for r in ("0", "1")}
    deadline, samples = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        samples = scrape(port)
        if all(total(samples, name, **labels) > 0 for name, labels in want.items()) and all(
                total(samples, name, rank=r, outcome=o) == n for (name, r, o), n in settled.items()) and all(
                total(samples, "ray_lora_cache_prefetch_accuracy", rank=r) > 0 for r in ("0", "1")) and all(
                total(samples, "ray_lora_cache_moved_bytes_total", rank=r, path="host_to_gpu") == n
                for r, n in moved.items()):
            break  # the accuracy gauge too: a scrape once had both ranks' retirements and one rank's gauge absent
        time.sleep(0.5)
    missing = [name for name, labels in want.items() if total(samples, name, **labels) <= 0]
    assert not missing, f"not exported: {missing}; got {sorted({n for n, _, _ in samples})}"

    # the figures agree with what happened: 4 loads of a shard per rank, 2 prefetches retired per rank,
    # one used (adapter-000), one not (adapter-001): accuracy 0.5
    for rank in ("0", "1"):
        assert total(samples, "ray_lora_cache_prefetches_retired_total", rank=rank, outcome="used") == 1
        assert total(samples, "ray_lora_cache_prefetches_retired_total", rank=rank, outcome="unused") == 1
        assert total(samples, "ray_lora_cache_prefetch_accuracy", rank=rank) == 0.5
        assert total(samples, "ray_lora_cache_time_to_ready_seconds_count", rank=rank) == 4
        assert total(samples, "ray_lora_cache_hits_total", rank=rank, tier="gpu") == 1
    for rank, nbytes in moved.items():
        assert total(samples, "ray_lora_cache_moved_bytes_total", rank=rank, path="host_to_gpu") == nbytes > 0
    assert total(samples, "ray_lora_cache_queue_depth", replica="replica-0") == 2


def test_every_metric_the_dashboard_names_is_scraped_from_the_live_service(cluster) -> None:
    """Issue 45 item 4: the Grafana dashboard's every query names a series this running service exports (runs after
    the test above, whose loads, hits, evictions and plans put a sample in every histogram and gauge)."""
    from lora_cache.runtime.dashboard import queries

    _, port = cluster
    wanted = {name for _, expr in queries() for name in re.findall(r"ray_lora_cache_\w+", expr)}
    deadline, names = time.monotonic() + 30, set()
    while time.monotonic() < deadline:
        names = {n for n, _, _ in scrape(port)}
        if wanted <= names:
            break
        time.sleep(0.5)
    assert wanted <= names, f"named by the dashboard, not exported: {sorted(wanted - names)}"
