"""``serve --adapters s3://...`` on a real local Ray (issue 29, item 4): the controller and the workers as
``serve`` starts them register adapters from an object store (moto's server, its own process on 127.0.0.1),
a hint makes one ready on a replica whose two ranks share one fetch through the node's disk tier, and an
object replaced in the store is refused on every rank: never ready, never served.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import WEIGHTS_FILE  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.vocab import WorkerId  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.disk_tier import DiskTierConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
BUCKET = "fleet-adapters"


class World(NamedTuple):
    server: S3Server
    local: Path
    service: Any


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    local = tmp_path_factory.mktemp("adapters")
    make_adapters(local, SynthConfig(model="tiny", count=3, rank="8,16"))
    with S3Server(record=True) as server:
        server.upload_adapters(BUCKET, "tenants", local)
        saved = dict(os.environ)
        os.environ.update(server.env)  # as an operator sets AWS_* for serve and the cluster's processes
        init_local(
            num_cpus=2,
            namespace="lora-cache",
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": server.env},
        )
        try:
            disk = tmp_path_factory.mktemp("disk")
            svc = start(
                ServeConfig(adapters=f"s3://{BUCKET}/tenants", replicas=1, tp=2),
                CatalogConfig(model="tiny", max_rank=16),
                PlannerConfig(policy="global"),
                WorkerConfig(
                    num_slots=2,
                    host=HostTierConfig(host_bytes=1 << 22, pin=False),
                    disk=DiskTierConfig(disk_cache=str(disk)),
                ),
            )
            yield World(server, local, svc)
            svc.stop()
        finally:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved)


def ranks(world: World) -> list[Any]:
    return [world.service.workers[WorkerId("replica-0", r)] for r in (0, 1)]


def test_ranks_take_the_controllers_registrations_without_asking_the_store(world: World) -> None:
    """Registration is metadata carried with the command: the controller reads each adapter's config and header
    once; the two ranks take its versions as carried, with no request to the store."""
    wait_for(
        lambda: all(
            sum(ray.get(h.stats.remote())[k] for k in ("registrations_hashed", "registrations_taken")) == 3
            for h in ranks(world)
        ),
        "both ranks registered the three adapters",
        timeout=60,
    )
    configs = [r for r in world.server.requests() if r[0] == "GET" and r[1].endswith("/adapter_config.json")]
    assert len(configs) == 3, configs  # the controller's, one per adapter (before: three per adapter and rank)
    assert all(ray.get(h.stats.remote())["registrations_taken"] == 3 for h in ranks(world))


def test_a_hint_makes_a_store_adapter_ready_with_one_fetch_per_node(world: World) -> None:
    ctl = world.service.controller
    assert ray.get(ctl.status.remote())["adapters"] == 3
    assert ray.get(ctl.hint.remote([("h-0", "adapter-000", "replica-0", 1.0)])) == 1
    wait_for(
        lambda: "replica-0" in ray.get(ctl.lookup.remote("adapter-000"), timeout=10)["ready"],
        "adapter-000 ready on replica-0",
        timeout=60,
    )
    stats = [ray.get(h.stats.remote()) for h in ranks(world)]
    assert sum(s["disk_fetches"] for s in stats) == 1, stats  # the two ranks of the node share one fetch
    assert all(s["registrations_hashed"] + s["registrations_taken"] == 3 for s in stats)


def test_an_object_replaced_in_the_store_is_refused_on_every_rank(world: World) -> None:
    ctl = world.service.controller
    version = ray.get(ctl.lookup_adapter.remote("adapter-001"))["version"]
    other = (world.local / "adapter-000" / WEIGHTS_FILE).read_bytes()  # other bytes under adapter-001's key
    world.server.client().put_object(Bucket=BUCKET, Key=f"tenants/adapter-001/{WEIGHTS_FILE}", Body=other)
    assert ray.get(ctl.hint.remote([("h-1", "adapter-001", "replica-0", 1.0)])) == 1
    wait_for(
        lambda: all(ray.get(h.stats.remote())["load_failures"] >= 1 for h in ranks(world)),
        "every rank refused the replaced object",
        timeout=60,
    )
    assert "replica-0" not in ray.get(ctl.lookup.remote("adapter-001"))["ready"]
    for h in ranks(world):
        residency = ray.get(h.describe.remote())["residency"]
        assert not [r for r in residency if r[0] == "adapter-001" and r[2] in ("ready", "in_use")], residency
    assert ray.get(ctl.lookup_adapter.remote("adapter-001"))["version"] == version  # still the registered one
    assert ray.get(ctl.check_integrity.remote())
