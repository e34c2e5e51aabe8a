"""The control plane on a real local Ray: queue -> plan -> loads -> readiness, faults, epochs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start, wait_ready
from lora_cache.planner import PlannerConfig
from lora_cache.vocab import Prefetch, WorkerId
from tests.ray_local import init_local
from tests.waiting import wait_for
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=8, rank="8,16"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False)
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=2, tp=2),
                    CatalogConfig(model="tiny", max_rank=16), PlannerConfig(policy="global"),
                    WorkerConfig(num_slots=3, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        yield svc
        svc.stop()
    finally:
        ray.shutdown()


def test_an_engine_load_reaches_the_controller_before_its_resync(service) -> None:
    """An adapter the engine loads itself (an acquire that missed, on every rank) is ready in the
    controller's view at once (~15 ms here): deltas carry it. Without them only the resync, every 5 s,
    does, which lands within the bound below about one time in five. (First: the fleet is still empty,
    so no plan competes for the slot.)"""
    ctl = service.controller
    cursor = ray.get(ctl.begin_watch.remote("replica-1", "adapter-003"))
    ray.get([service.workers[WorkerId("replica-1", rank)].step.remote(["adapter-003"]) for rank in (0, 1)])
    t0 = time.monotonic()
    while not any(e.ready for e in ray.get(ctl.wait_events.remote(cursor, "replica-1", "adapter-003", 0.5))):
        assert time.monotonic() - t0 < 1.0, "the controller did not see the engine's load (its resync is every 5 s)"
    assert "replica-1" in ray.get(ctl.lookup.remote("adapter-003"))["ready"]


def test_queue_report_reaches_readiness_and_subscriber(service) -> None:
    ctl = service.controller
    cursor = 0
    ray.get(ctl.report_queue.remote("replica-0", [("adapter-000", time.time()), ("adapter-001", time.time())]))
    # both queued adapters become ready; in no promised order: the two loads read on parallel reader threads, so
    # adapter-001 may be ready on both ranks before adapter-000 (under the full CI run it once was: asserting
    # adapter-000 ready at adapter-001's readiness failed with `'replica-0' in []`)
    for adapter in ("adapter-001", "adapter-000"):
        wait_ready(ctl, adapter, "replica-0", 30)
    events = ray.get(ctl.wait_events.remote(cursor, "replica-0", "adapter-001", 5.0))
    assert events and events[-1].ready and events[-1].replica == "replica-0"
    assert "replica-0" in ray.get(ctl.lookup.remote("adapter-000"))["ready"]
    for rank in (0, 1):  # each rank loaded its own shard; the replica became ready only after both
        residency = ray.get(service.workers[WorkerId("replica-0", rank)].describe.remote())["residency"]
        assert {("adapter-000", "ready"), ("adapter-001", "ready")} <= {(a, s) for a, _, s, *_ in residency}
    assert ray.get(ctl.check_integrity.remote())


def test_hint_drives_a_prefetch(service) -> None:
    ctl = service.controller
    assert ray.get(ctl.hint.remote([("hint-1", "adapter-005", "replica-1", 0.5)])) == 1
    assert ray.get(ctl.hint.remote([("hint-1", "adapter-005", "replica-1", 0.5)])) == 0  # idempotent by id
    wait_ready(ctl, "adapter-005", "replica-1", 30)


def test_stale_epoch_commands_are_rejected(service) -> None:
    worker = service.workers[WorkerId("replica-1", 0)]
    epoch = ray.get(worker.describe.remote())["epoch"]
    result = ray.get(worker.apply.remote([Prefetch("adapter-007", "any", 0, epoch=epoch - 1)]))
    assert result.rejected_stale == 1 and result.accepted == 0


def test_bad_inputs_are_clear_errors_and_change_nothing(service) -> None:
    ctl = service.controller
    before = ray.get(ctl.status.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="replica 'nope' is not known"):
        ray.get(ctl.report_queue.remote("nope", [("adapter-000", 0.0)]))
    with pytest.raises(ray.exceptions.RayTaskError, match="adapter 'ghost' is not registered"):
        ray.get(ctl.hint.remote([("h-ok", "adapter-002", "replica-0", 1.0), ("h-bad", "ghost", "replica-0", 1.0)]))
    assert ray.get(ctl.status.remote())["queue_depths"] == before["queue_depths"]
    # each hint by itself: the good one beside the bad one was taken, so sending it again is a known id
    assert ray.get(ctl.hint.remote([("h-ok", "adapter-002", "replica-0", 1.0)])) == 0


def test_worker_killed_is_dropped_then_reloaded(service) -> None:
    ctl = service.controller
    ray.get(ctl.report_queue.remote("replica-1", [("adapter-004", time.time())]))
    wait_ready(ctl, "adapter-004", "replica-1", 30)
    victim = service.workers[WorkerId("replica-1", 1)]
    ray.kill(victim, no_restart=False)  # Ray restarts it, empty; it tells the controller so
    # the new process holds the queued adapter again only if the controller dropped and replanned it
    wait_for(lambda: ("adapter-004", "ready") in _residency_or_empty(victim), "reload after restart", timeout=60)
    wait_ready(ctl, "adapter-004", "replica-1", 30)
    assert ray.get(ctl.check_integrity.remote())


def test_controller_restart_rebuilds_from_workers(service) -> None:
    """A restarted controller has the ranks' residency from their reports and its planner's inputs from its last
    snapshot (written at most once a second: ``DurableConfig.period_s``). The kill waits for the snapshot that holds
    the queue report: without it the restarted controller planned replica-0 from the queue before (adapter-000 and
    -001, and adapter-002's hint), evicted adapter-006 and the lookup found it nowhere (fresh-clone CI, 2026-11-29,
    twice in five runs; the message named the restored queue depth 2)."""
    ctl = service.controller
    ray.get(ctl.report_queue.remote("replica-0", [("adapter-006", time.time())]))
    wait_ready(ctl, "adapter-006", "replica-0", 30)
    wait_for(lambda: _snapshot_queue("replica-0") == ["adapter-006"], "the queue report in the durable snapshot",
             timeout=30)
    epoch = ray.get(ctl.status.remote())["epoch"]
    ray.kill(ctl, no_restart=False)
    seen: list[dict] = []  # ray.kill is asynchronous: the old process may still answer the first calls
    wait_for(lambda: seen.append(_status_or_none(ctl)) or (seen[-1] or {}).get("epoch", epoch) > epoch,
             "controller restart with a larger epoch", timeout=60)
    status = seen[-1]
    found = ray.get(ctl.lookup.remote("adapter-006"))
    if not (status["workers"] == 4 and status["adapters"] == 8 and "replica-0" in found["ready"]):
        # what the ranks say they hold, for the message (failed once in 4 fresh-clone runs, cause not yet seen)
        held = {str(w): sorted(_residency_or_empty(h)) for w, h in sorted(service.workers.items())}
        pytest.fail(f"not rebuilt from the reports: status {status}, lookup {found}, ranks {held}")


def _snapshot_queue(replica: str) -> list[str]:
    """The adapters of ``replica``'s queue in the controller's last durable snapshot (Ray's GCS key-value store)."""
    from lora_cache.controller.snapshots import DurableConfig, KvStore, decode

    data = KvStore(DurableConfig().key, "lora-cache").get()
    return [] if not data else [a for a, _ in decode(data)["queues"].get(replica, [])]


def _status_or_none(ctl):
    try:
        return ray.get(ctl.status.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return None


def _residency_or_empty(worker) -> set[tuple[str, str]]:
    try:
        return {(a, st) for a, _, st, *_ in ray.get(worker.describe.remote(), timeout=5)["residency"]}
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return set()


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: __import__("os").getpid()), timeout=30)


def test_a_stopped_worker_does_not_stall_the_health_of_the_others(service) -> None:
    """Issue 35: a worker stopped with SIGSTOP stalled the controller's health loop on its ``describe()``
    (no timeout): no health checks of other workers, no plans, no snapshots until it resumed. Now each ping
    and full report has a timeout and pings go out at once: with one worker stopped past a resync round,
    a second stopped worker is still found within seconds (its replica stops being READY), and both come
    back through the resync once they resume."""
    import os
    import signal

    ctl = service.controller
    ray.get(ctl.report_queue.remote("replica-0", [("adapter-007", time.time())]))
    wait_ready(ctl, "adapter-007", "replica-0", 30)
    first, second = service.workers[WorkerId("replica-1", 0)], service.workers[WorkerId("replica-0", 1)]
    pids = [_pid(first), _pid(second)]
    os.kill(pids[0], signal.SIGSTOP)
    try:
        time.sleep(7.0)  # past a resync round (sync_s 5 s): the old loop hung there on the stopped worker
        os.kill(pids[1], signal.SIGSTOP)
        wait_for(lambda: "replica-0" not in ray.get(ctl.lookup.remote("adapter-007"), timeout=10)["ready"],
                 "the second stopped worker dropped while the first is still stopped", timeout=30)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    wait_ready(ctl, "adapter-007", "replica-0", 60)  # resumed: the next resync reads it back
    assert ray.get(ctl.check_integrity.remote())


def test_route_registers_an_adapter_put_under_the_root_after_the_start(service) -> None:
    """Issue 44 item 4: a tenant's adapter written under the service's adapter root after it started is routed at
    its first request: ``Route`` registers it on demand (one lookup), every worker takes the registration, and a
    name under no root is still 'not registered', typed (NOT_FOUND for a router)."""
    from lora_cache.errors import NotFoundError
    from lora_cache.routing.advice import RouteRequest

    ctl = service.controller
    root = Path(ray.get(ctl.catalog_config.remote()).adapter_roots[0])
    make_adapters(root, SynthConfig(model="tiny", count=2, rank="8", prefix="late"))
    before = ray.get(ctl.status.remote())["resolver"]
    late, ghost = ray.get(ctl.route.remote([RouteRequest("late-000", tokens=16), RouteRequest("ghost-9")]))
    assert late.error is None and late.version and late.ranked, late
    assert isinstance(ghost.error, NotFoundError) and "under none of the roots" in str(ghost.error)
    after = ray.get(ctl.status.remote())["resolver"]
    assert (after["lookups"] - before["lookups"], after["resolved"] - before["resolved"]) == (2, 1)
    ray.get(ctl.report_queue.remote("replica-0", [("late-000", time.time())]))
    wait_ready(ctl, "late-000", "replica-0", 30)  # every rank took the registration and loads it
    ray.get(ctl.report_queue.remote("replica-0", []))
    version = ray.get(ctl.resolve_adapter.remote("late-001"))  # an engine's call, for a name its catalog lacks
    assert version == ray.get(ctl.lookup_adapter.remote("late-001"))["version"]
    with pytest.raises(ray.exceptions.RayTaskError, match=r"'ghost-9' is not registered; .*moments ago"):
        ray.get(ctl.resolve_adapter.remote("ghost-9"))  # the miss remembered: the roots are not asked again
    assert ray.get(ctl.status.remote())["resolver"]["lookups"] - after["lookups"] == 1
