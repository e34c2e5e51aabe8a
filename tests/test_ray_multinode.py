"""A replica whose TP ranks live on two nodes of a real multi-node Ray cluster (ray.cluster_utils)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start, wait_ready
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import WorkerId
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

pytestmark = pytest.mark.ray


def test_replica_spanning_two_nodes_is_ready_only_after_both(tmp_path: Path) -> None:
    make_adapters(tmp_path, SynthConfig(model="tiny", count=3, rank="8"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="lora-cache")
        service = start(ServeConfig(adapters=str(tmp_path), tp=2, placement="STRICT_SPREAD", worker_cpus=0.5),
                        CatalogConfig(model="tiny", max_rank=8), PlannerConfig(policy="queue"),
                        WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        try:
            infos = [ray.get(service.workers[WorkerId("replica-0", k)].describe.remote()) for k in (0, 1)]
            assert infos[0]["node"] != infos[1]["node"]  # the ranks really are on two nodes
            ray.get(service.controller.report_queue.remote("replica-0", [("adapter-001", time.time())]))
            wait_ready(service.controller, "adapter-001", "replica-0", 60)
            for k in (0, 1):  # readiness came from both ranks, each holding its own shard
                residency = ray.get(service.workers[WorkerId("replica-0", k)].describe.remote())["residency"]
                assert ("adapter-001", "ready") in {(a, s) for a, _, s, *_ in residency}
        finally:
            service.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
