"""Issue 43 on a real local cluster: a service whose workers have a paged GPU pool. Each rank's report tells the
controller its pool bytes and page (``WorkerControl.describe``), the planner counts their room in whole pages, and
what it commands fits: four queued rank-16 adapters on a pool of four rank-8 pages (two rank-16 shards' bytes) get two
prefetches, both READY with their own bytes, and no eviction, where counting slots would command four."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start, wait_ready
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import WorkerId
from tests.ray_local import init_local
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

pytestmark = pytest.mark.ray

ADAPTERS = [f"adapter-{i:03d}" for i in range(4)]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=len(ADAPTERS), rank="16"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False)
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=1, tp=1),
                    CatalogConfig(model="tiny", max_rank=16), PlannerConfig(policy="queue"),
                    WorkerConfig(num_slots=4, page_rank=8, pool_pages=4,
                                 host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        yield svc
        svc.stop()
    finally:
        ray.shutdown()


def test_the_planner_counts_a_paged_pool_in_pages_and_commands_what_fits(service) -> None:
    ctl = service.controller
    capacity = ray.get(ctl.status.remote())["capacity"]["replica-0/0"]
    assert capacity["slots"] == 4 and capacity["page_bytes"] and capacity["bytes"] == 4 * capacity["page_bytes"]
    now = time.time()
    ray.get(ctl.report_queue.remote("replica-0", [(a, now) for a in ADAPTERS]))
    for adapter in ADAPTERS[:2]:  # the queue's first two: a rank-16 shard takes two of the four pages
        wait_ready(ctl, adapter, "replica-0", 30)
    worker = service.workers[WorkerId("replica-0", 0)]
    ray.get(ctl.check_integrity.remote())
    stats = ray.get(worker.stats.remote())
    assert stats["prefetches"] == 2 and stats["evictions"] == 0 and stats["prefetch_no_room"] == 0, stats
    for adapter in ADAPTERS[:2]:
        check = ray.get(worker.verify.remote(adapter))
        assert check["max_abs_diff"] == 0.0, check


def _capacity(ctl, worker: str, want: int, timeout_s: float = 30.0) -> dict:
    """The controller's view of ``worker``'s capacity once its bytes are ``want`` (its delta arrived)."""
    deadline = time.monotonic() + timeout_s
    while True:
        capacity = ray.get(ctl.status.remote())["capacity"][worker]
        if capacity["bytes"] == want or time.monotonic() > deadline:
            return capacity
        time.sleep(0.1)


def test_a_pool_that_lends_pages_reports_its_capacity_and_the_planner_plans_within_it(service) -> None:
    """Issue 43 item 3 on the cluster: the operator's ``resize_pool`` lends half the pool (evicting the least recently
    used idle adapter, never one in use); the rank's "capacity" delta reaches the controller after the eviction, the
    planner plans within the two pages left (no load fails), and taking the pages back lets it bring both back."""
    ctl, worker = service.controller, service.workers[WorkerId("replica-0", 0)]
    page = ray.get(ctl.status.remote())["capacity"]["replica-0/0"]["page_bytes"]
    now = time.time()
    ray.get(ctl.report_queue.remote("replica-0", [(a, now) for a in ADAPTERS[:2]]))
    for adapter in ADAPTERS[:2]:
        wait_ready(ctl, adapter, "replica-0", 30)
    with pytest.raises(ray.exceptions.RayTaskError, match="cannot give back 5 GPU pages"):
        ray.get(worker.resize_pool.remote(5 * page))  # more than the pool: refused, nothing changes
    lent = ray.get(worker.resize_pool.remote(2 * page))
    assert lent["capacity_bytes"] == 2 * page and lent["lent_bytes"] == 2 * page and len(lent["evicted"]) == 1
    assert _capacity(ctl, "replica-0/0", 2 * page)["bytes"] == 2 * page
    ray.get(ctl.report_queue.remote("replica-0", [(a, time.time()) for a in ADAPTERS[:2]]))
    ray.get(ctl.check_integrity.remote())
    resident = ray.get(worker.describe.remote())["residency"]
    assert len(resident) <= 1, resident  # two pages hold one rank-16 shard
    assert ray.get(worker.stats.remote())["load_failures"] == 0
    back = ray.get(worker.resize_pool.remote(0))
    assert back == {"capacity_bytes": 4 * page, "lent_bytes": 0, "page_bytes": page, "evicted": [],
                    "was_lent_bytes": 2 * page}
    assert _capacity(ctl, "replica-0/0", 4 * page)["bytes"] == 4 * page
    ray.get(ctl.report_queue.remote("replica-0", [(a, time.time()) for a in ADAPTERS[:2]]))
    for adapter in ADAPTERS[:2]:
        wait_ready(ctl, adapter, "replica-0", 30)
    for adapter in ADAPTERS[:2]:
        check = ray.get(worker.verify.remote(adapter))
        assert check["max_abs_diff"] == 0.0, check
