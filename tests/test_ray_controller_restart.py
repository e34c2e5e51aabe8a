"""A controller killed under hint traffic comes back with its hints, queue reports and popularity (issue 19,
item 5): the hinted adapter is still prefetched after the restart, and the first plan comes within one sync
period of the new controller's start."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start, wait_ready  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the lambdas below run inside the controller
SYNC_S, HEALTH_S = 5.0, 0.5  # the controller's defaults


def status_or_none(ctl):
    try:
        return ray.get(ctl.status.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return None


def test_controller_killed_under_hint_traffic_keeps_its_hints_queues_and_popularity(tmp_path: Path) -> None:
    make_adapters(tmp_path, SynthConfig(model="tiny", count=6, rank="8"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False)
    stop, sent, failed = threading.Event(), [0], [0]
    try:
        svc = start(ServeConfig(adapters=str(tmp_path), replicas=1, tp=1), CatalogConfig(model="tiny", max_rank=8),
                    PlannerConfig(policy="global", hint_horizon_s=2.0),
                    WorkerConfig(num_slots=1, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        ctl = svc.controller

        def traffic() -> None:  # far hints for other adapters, all the time, across the kill
            while not stop.is_set():
                try:
                    ray.get(ctl.hint.remote([(f"t{sent[0]}", "adapter-002", "replica-0", 60.0)]), timeout=5)
                    sent[0] += 1
                except Exception:  # the controller is restarting: the router retries (counted)
                    failed[0] += 1
                stop.wait(0.05)

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        ray.get(ctl.report_queue.remote("replica-0", [("adapter-001", time.time())]))
        wait_ready(ctl, "adapter-001", "replica-0", 60)  # the queue holds the only slot
        ray.get(ctl.hint.remote([("key", "adapter-005", "replica-0", 8.0)]))  # far now: no slot, no evict
        before = ray.get(ctl.status.remote())
        wait_for(lambda: ray.get(ctl.status.remote())["snapshots_written"] > before["snapshots_written"],
                 "a snapshot after the key hint", timeout=10)
        ray.kill(ctl, no_restart=False)
        after = wait_for(lambda: (s := status_or_none(ctl)) and s["epoch"] > before["epoch"] and s,
                         "the controller restarted", timeout=60)
        assert after["restored"]["hints"] >= 2 and after["restored"]["queues"] == 1, after["restored"]
        assert after["restored"]["counts"] >= 2 and after["queue_depths"] == {"replica-0": 1}
        first_plan = wait_for(lambda: ray.get(ctl.status.remote())["first_plan_at"], "a first plan", timeout=30)
        assert first_plan - after["started_at"] <= SYNC_S + HEALTH_S, "first plan later than one sync period"
        ray.get(ctl.report_queue.remote("replica-0", []))  # the engine served adapter-001: its slot is free
        wait_ready(ctl, "adapter-005", "replica-0", 60)  # the restored hint (near by now) is prefetched
        assert sent[0] > 0
    finally:
        stop.set()
        ray.shutdown()


def restarted(ctl, epoch: int) -> dict:
    seen: list[dict] = []  # ray.kill is asynchronous: the old process may still answer the first calls
    ray.kill(ctl, no_restart=False)
    wait_for(lambda: seen.append(status_or_none(ctl) or {}) or seen[-1].get("epoch", epoch) > epoch,
             "the controller restarted with a larger epoch", timeout=60)
    return seen[-1]


def test_with_no_rank_attached_a_restarted_controller_keeps_its_catalog_and_never_an_old_version(
        tmp_path: Path) -> None:
    """``serve --replicas 0`` (attached engines' mode) with none attached: only the controller knows the catalog.
    A restart brings back names, paths, versions and a kept older version from the GCS snapshot; a file changed
    while it was down comes back under its new version, a deleted one not at all (issue 29, item 4)."""
    import shutil

    from lora_cache.adapters.files import FileIdentity
    from lora_cache.adapters.peft import WEIGHTS_FILE

    root = tmp_path / "adapters"
    make_adapters(root, SynthConfig(model="tiny", count=4, rank="8"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=0), CatalogConfig(model="tiny", max_rank=8),
                    PlannerConfig(), WorkerConfig(num_slots=1, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        ctl = svc.controller

        def versions(name: str) -> list[str]:
            return ray.get(ctl.__ray_call__.remote(lambda self: self.core.catalog.versions(name)), timeout=30)

        shutil.copytree(root / "adapter-002", root / "alt")
        old0 = versions("adapter-000")[-1]
        new0, previous = ray.get(ctl.register_adapter_info.remote("adapter-000", str(root / "alt"), "req-alt"))
        assert previous == old0 and versions("adapter-000") == [old0, new0]
        before = {a: versions(a) for a in ("adapter-000", "adapter-001", "adapter-002", "adapter-003")}
        status = ray.get(ctl.status.remote())

        after = restarted(ctl, status["epoch"])
        assert after["adapters"] == 4 and after["workers"] == 0, after
        assert {a: versions(a) for a in before} == before, "the catalog came back otherwise"
        assert after["catalog_restored"]["entries"] == 4 and after["catalog_restored"]["changed"] == 0
        # issue 46 item 3a: the registration's answer was lost; its retry by request id, after the restart, is
        # answered as the first was (not "previous: new0") and registers nothing
        assert after["request_ids"]["restored"] >= 1, after["request_ids"]
        retry = ray.get(ctl.register_adapter_info.remote("adapter-000", str(root / "alt"), "req-alt"))
        assert retry == (new0, old0) and versions("adapter-000") == [old0, new0]
        with pytest.raises(ray.exceptions.RayTaskError, match="id 'req-alt' was used for adapter 'adapter-000'"):
            ray.get(ctl.register_adapter_info.remote("adapter-001", str(root / "alt"), "req-alt"))

        (root / "adapter-001" / WEIGHTS_FILE).write_bytes((root / "adapter-003" / WEIGHTS_FILE).read_bytes())
        shutil.rmtree(root / "adapter-003")
        again = restarted(ctl, after["epoch"])
        assert again["adapters"] == 3, again
        current = ray.get(ctl.__ray_call__.remote(lambda self: self.core.catalog.get("adapter-001")), timeout=30)
        now = FileIdentity.of(os.stat(root / "adapter-001" / WEIGHTS_FILE))
        assert current.source.identity == now, "a changed file did not come back as it is now"
        assert before["adapter-001"][-1] not in versions("adapter-001") and len(versions("adapter-001")) == 1
        assert versions("adapter-000") == [old0, new0]
        assert versions("adapter-002") == before["adapter-002"]
        with pytest.raises(ray.exceptions.RayTaskError, match="not registered"):
            ray.get(ctl.lookup_adapter.remote("adapter-003"))
        assert again["catalog_restored"]["changed"] == 1 and again["catalog_restored"]["refused"] == 1
    finally:
        ray.shutdown()


def test_a_service_on_a_new_cluster_restores_its_catalog_from_the_copy_when_the_head_is_lost(tmp_path: Path) -> None:
    """Issue 46 item 5: the catalog's snapshot lives in the GCS, on the head; losing the head lost every
    registration. With ``--catalog-copy`` every snapshot is also written off the cluster: the whole cluster is shut
    down here (its GCS with it), a new one started, and the service on it, given no adapters to register, comes back
    with every name at every version (a kept older version included), proven against the files as any restore."""
    import shutil

    root, copy = tmp_path / "adapters", tmp_path / "copy"
    make_adapters(root, SynthConfig(model="tiny", count=3, rank="8"))
    worker = WorkerConfig(num_slots=1, host=HostTierConfig(host_bytes=1 << 22, pin=False))

    def versions(ctl: object, names: list[str]) -> dict[str, list[str]]:
        return ray.get(ctl.__ray_call__.remote(  # type: ignore[attr-defined]
            lambda self: {n: self.core.catalog.versions(n) for n in names}), timeout=30)

    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=0, catalog_copy=str(copy)),
                    CatalogConfig(model="tiny", max_rank=8), PlannerConfig(), worker)
        shutil.copytree(root / "adapter-002", root / "alt")
        ray.get(svc.controller.register_adapter_info.remote("adapter-000", str(root / "alt")))
        before = versions(svc.controller, ["adapter-000", "adapter-001", "adapter-002"])
        assert len(before["adapter-000"]) == 2
    finally:
        ray.shutdown()  # the cluster and its GCS gone: as if the head were lost
    assert (copy / "lora-cache" / "catalog.v1").is_file()
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    try:
        svc = start(ServeConfig(replicas=0, catalog_copy=str(copy)),
                    CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=8), PlannerConfig(), worker)
        status = ray.get(svc.controller.status.remote(), timeout=60)
        assert status["catalog_restored"]["from_copy"] == 1 and status["catalog_restored"]["entries"] == 3, status
        assert versions(svc.controller, list(before)) == before, "the catalog came back otherwise"
    finally:
        ray.shutdown()
