"""Pushes on a real two-node Ray cluster (``ray.cluster_utils``), each node with a push area of its own
(``LORA_CACHE_PUSH_DIR`` set per node, as two machines' node memories are apart): a TP 2 replica's ranks on the two
nodes both serve every pushed version, the rank on the node without the controller reading its own node's copy,
proved to be the version before it is taken (a stale copy left under the tag is replaced); versions the controller
retires leave both nodes' memory, and an unregistered name leaves none."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from safetensors.torch import load, save  # noqa: E402

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402
from lora_cache.adapters.pushed import ENV  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.errors import NotFoundError  # noqa: E402
from lora_cache.integrations.ray_push import push_in_ray  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
SERVICE = "lora-cache-nodes"
NAME = "trained"
KEEP = 1  # older versions kept past those in use


def wait_until(done: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def tags(area: Path) -> list[str]:
    """The versions of ``NAME`` kept in one node's push area (not a copy being written)."""
    return sorted(p.name for p in (area / SERVICE / NAME).glob("*") if not p.name.startswith("."))


def test_a_push_serves_on_ranks_of_two_nodes_each_from_its_own_nodes_memory(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    make_adapters(root, SynthConfig(model="tiny", count=2, rank="8"))
    tensors = load((root / "adapter-001" / WEIGHTS_FILE).read_bytes())
    config = json.loads((root / "adapter-001" / CONFIG_FILE).read_text())
    areas = [tmp_path / "node-a-memory", tmp_path / "node-b-memory"]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "env_vars": {ENV: str(areas[0])}})
    try:
        other = cluster.add_node(num_cpus=1, env_vars={ENV: str(areas[1])})
        cluster.wait_for_nodes()
        area_of = {cluster.head_node.node_id: areas[0], other.node_id: areas[1]}
        ray.init(address=cluster.address, namespace=SERVICE, log_to_driver=False)
        service = start(ServeConfig(service=SERVICE, adapters=str(root), tp=2, placement="STRICT_SPREAD",
                                    worker_cpus=0.5),
                        CatalogConfig(model="tiny", max_rank=16, keep_versions=KEEP), PlannerConfig(policy="queue"),
                        WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        try:
            handles = list(service.workers.values())
            nodes = [ray.get(h.describe.remote(), timeout=60)["node"] for h in handles]
            assert sorted(map(area_of.get, nodes)) == areas  # the ranks really are on two nodes
            for step in (1, 2, 3, 4):
                pushed = {k: (v.float() * (1 + step / 10)).to(v.dtype) for k, v in tensors.items()}
                if step == 2:  # a copy a service of this name left under tag 2 off the controller's node, other bytes
                    copied = [ray.get(h.stats.remote(), timeout=30)["pushed_copied"] for h in handles]
                    off = area_of[nodes[copied.index(1)]]  # the node whose rank copied version 1
                    (off / SERVICE / NAME / "2").mkdir(parents=True)
                    (off / SERVICE / NAME / "2" / CONFIG_FILE).write_text(json.dumps(config))
                    (off / SERVICE / NAME / "2" / WEIGHTS_FILE).write_bytes(save({k: v * 3 for k, v in pushed.items()}))
                done = push_in_ray(NAME, pushed, config, tag=step, timeout_s=120)
                assert not done.rank_pending, done
                for handle in handles:  # each rank loads its shard of this version, equal to its file's slices
                    (record,) = ray.get(handle.preload.remote([NAME]), timeout=60)
                    assert record.version == done.version
                    check = ray.get(handle.verify.remote(NAME, done.version), timeout=60)
                    assert check["max_abs_diff"] == 0.0, check
                for area in areas:  # and that file, on both nodes, holds what the trainer pushed
                    held = load((area / SERVICE / NAME / str(step) / WEIGHTS_FILE).read_bytes())
                    assert held.keys() == pushed.keys() and all(torch.equal(held[k], pushed[k]) for k in held)
            stats = [ray.get(h.stats.remote(), timeout=30) for h in handles]
            # one rank (the one off the controller's node) copied every version; the other read the controller's
            assert sorted(s["pushed_copied"] for s in stats) == [0, 4], stats
            with pytest.raises(NotFoundError, match="not kept"):
                ray.get(service.controller.pushed_payload.remote(NAME, "99"), timeout=30)
            # the versions no rank holds any more retire from the controller's node, then from the other's copy
            wait_until(lambda: all(tags(a) == ["3", "4"] for a in areas),
                       f"both nodes keeping the newest {1 + KEEP} versions ({[tags(a) for a in areas]})", 90)
            ray.get(service.controller.unregister_adapter.remote(NAME), timeout=60)
            wait_until(lambda: not any(tags(a) for a in areas), "no copy left after the unregistration", 30)
        finally:
            service.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
