"""A controller killed under hint traffic comes back with its hints, queue reports and popularity (issue 19,
item 5): the hinted adapter is still prefetched after the restart, and the first plan comes within one sync
period of the new controller's start."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start, wait_ready  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.host_tier import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
SYNC_S, HEALTH_S = 5.0, 0.5  # the controller's defaults


def status_or_none(ctl):
    try:
        return ray.get(ctl.status.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return None


def test_controller_killed_under_hint_traffic_keeps_its_hints_queues_and_popularity(tmp_path: Path) -> None:
    make_adapters(tmp_path, SynthConfig(model="tiny", count=6, rank="8"))
    ray.init(num_cpus=2, namespace="lora-cache", include_dashboard=False)
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
