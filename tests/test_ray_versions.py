"""Versions and deaths through the real service on a local Ray (CPU): invariants 1 and 4 under change.

- Re-registration under traffic: a hosted TP-2 engine (the benchmark's real path: each rank inside its
  worker actor, over the cache the controller prefetches into) serves a stream of requests while the
  adapter is re-registered again and again through the controller. Every step, both ranks computed
  each item with the same version, the one its request was admitted with, and the slot held exactly
  that version's bytes (a digest of the rank's shard, read from that version's own files).
- A TP rank killed mid-load, at a fault point (a barrier, not a sleep): the replica is never reported
  ready for that adapter until the restarted rank has loaded it; the surviving rank's other adapters
  stay READY in their slots, unreloaded, and the replica is ready for them again after the restart.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

ray = pytest.importorskip("ray")

from bench.version_check import check_steps  # noqa: E402
from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import read_adapter  # noqa: E402
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES  # noqa: E402
from lora_cache.adapters.shards import shard_layout  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters, write_adapter  # noqa: E402
from lora_cache.app.serve import ServeConfig, Service, start, wait_ready  # noqa: E402
from lora_cache.errors import NotFoundError  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.vocab import WorkerId  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.engine import EngineConfig, Request  # noqa: E402
from workers.engine.rank import slot_digest  # noqa: E402
from workers.faults import Gate  # noqa: E402
from workers.reads.shard import read_shard  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

TINY = SHAPES["tiny"]
HOT = "adapter-000"  # re-registered under traffic
VERSIONS = 4
NEW = "tenant-new"  # under a root (the versions directory), registered by nobody: resolved on demand


class Fleet(NamedTuple):
    svc: Service
    root: Path  # the adapters registered at start (by directory name)
    versions: Path  # HOT's other versions, each in its own directory


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("adapters")
    versions: Path = tmp_path_factory.mktemp("versions")  # not under root: not registered at start
    make_adapters(root, SynthConfig(model="tiny", count=6, rank="8,16"))
    write_adapter(versions / NEW, TINY, 8, 16.0, list(MODULE_ORDER), torch.float32, torch.Generator().manual_seed(7))
    for v in range(VERSIONS):
        write_adapter(versions / f"{HOT}-v{v}", TINY, 16 if v % 2 else 8, 16.0, list(MODULE_ORDER), torch.float32,
                      torch.Generator().manual_seed(1000 + v))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False)
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=2, tp=2),
                    CatalogConfig(adapter_roots=(str(root), str(versions)), model="tiny", max_rank=16),
                    PlannerConfig(policy="global"),
                    WorkerConfig(num_slots=3, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        yield Fleet(svc, root, versions)
        svc.stop()
    finally:
        ray.shutdown()


def expected_digest(directory: Path, name: str, rank: int) -> str:
    spec = read_adapter(name, directory, TINY, 16)
    layout = shard_layout(spec, TINY, 2, rank, torch.bfloat16)  # the workers' slot dtype (WorkerConfig)
    staged = torch.empty(layout.numel, dtype=layout.dtype)
    read_shard(spec, layout, staged)
    return slot_digest(staged)


@pytest.mark.parametrize("admission", ["ondemand", "overlap"])
def test_reregistration_under_traffic_keeps_one_version_per_step_on_every_rank(fleet: Fleet, admission: str) -> None:
    service, ctl, replica = fleet.svc, fleet.svc.controller, "replica-0"
    ranks = [service.workers[WorkerId(replica, k)] for k in (0, 1)]
    dirs: dict[str, Path] = {}  # version -> its directory, as the controller registered it (an identity version
    # names its file, not only its bytes: docs/decisions.md, "A local version from its file's identity")
    engine = EngineConfig(adapters=str(fleet.root), model="tiny", device="cpu", tp=2, num_slots=3, max_adapters=2,
                          max_running=4, max_prefill_tokens=24, max_seq_len=32, max_rank=16, admission=admission,
                          audit_steps=True, host=HostTierConfig(host_bytes=1 << 22, pin=False))
    meet = ray.get(ranks[0].engine_rendezvous.remote(2), timeout=60)
    ray.get([h.engine_build.remote(engine, meet) for h in ranks], timeout=300)
    requests = [Request(i, HOT if i % 3 else "adapter-001", 3 + i % 4, 2 + i % 3, 0.04 * i) for i in range(90)]
    start_wall = time.time() + 1.0
    runs = [ranks[0].engine_run.remote(requests, start_wall, 0, True), ranks[1].engine_run.remote(requests, start_wall)]
    registered = 0
    current = ray.get(ctl.__ray_call__.remote(lambda self: self.core.paths.get(HOT, "")), timeout=30)
    after = next((v + 1 for v in range(VERSIONS) if current == str(fleet.versions / f"{HOT}-v{v}")), 0)
    while ray.wait(runs, num_returns=2, timeout=0.0)[1]:  # re-register while the engine serves
        path = fleet.versions / f"{HOT}-v{(after + registered) % VERSIONS}"  # never the current one again
        version, previous = ray.get(ctl.register_adapter_info.remote(HOT, str(path)))
        assert version != previous
        if not dirs:
            dirs[previous] = fleet.root / HOT
        dirs[version] = path
        registered += 1
        ray.wait(runs, num_returns=2, timeout=0.3)  # pacing only: every check below is per step
    result = ray.get(runs[0])
    assert registered >= 3, "the run ended before the adapter was re-registered under it"

    checked, served = check_steps(result.records, [stats.audit for stats in result.ranks], HOT,
                                  lambda name, v: dirs[v] if name == HOT else fleet.root / name, expected_digest)
    print(f"{admission}: {registered} re-registrations under traffic, {checked} slot digests checked, versions "
          f"served {served}")
    assert ray.get(ctl.check_integrity.remote())


def test_a_rank_killed_mid_load_keeps_its_replica_unready_for_that_adapter_only(fleet: Fleet) -> None:
    service, ctl, replica = fleet.svc, fleet.svc.controller, "replica-1"
    target, others = "adapter-004", ["adapter-002", "adapter-003"]
    ray.get(ctl.report_queue.remote(replica, [(a, time.time()) for a in others]))
    for a in others:
        wait_ready(ctl, a, replica, 60)
    survivor, victim = service.workers[WorkerId(replica, 0)], service.workers[WorkerId(replica, 1)]
    before = ray.get(victim.describe.remote())
    held = {(a, s) for a, _, s, *_ in ray.get(survivor.describe.remote())["residency"] if a in others}
    loads_before = len(ray.get(survivor.load_log.remote()))
    gate = ray.remote(Gate).remote()
    ray.get(victim.arm_fault.remote("before_copy", target, gate))
    cursor = ray.get(ctl.begin_watch.remote(replica, target))

    ray.get(ctl.report_queue.remote(replica, [(a, time.time()) for a in [target, *others]]))
    assert ray.get(gate.wait_arrived.remote(60)).startswith(f"{target}@")  # the victim is mid-load, stopped
    wait_for(lambda: (target, "ready") in residency(survivor), "the survivor's own load of the target", timeout=30)
    assert replica not in ray.get(ctl.lookup.remote(target))["ready"], "ready with one rank mid-load"
    ray.kill(victim, no_restart=False)  # dies at the fault point; Ray restarts it, empty

    while True:  # every readiness event of the target on this replica, until it is ready again
        events = ray.get(ctl.wait_events.remote(cursor, replica, target, 60.0))
        assert events, "the replica never became ready for the target after the restart"
        cursor = events[-1].seq
        if any(e.ready for e in events):
            break
    report = ray.get(victim.describe.remote())
    assert report["incarnation"] != before["incarnation"], "ready before the rank restarted"
    assert (target, "ready") in {(a, s) for a, _, s, *_ in report["residency"]}, "ready before the new rank loaded it"

    assert held <= residency(survivor), "the survivor's other adapters left their slots"
    new_loads = [r.adapter for _, r in ray.get(survivor.load_log.remote())[loads_before:]]
    assert not set(new_loads) & set(others), f"the survivor reloaded {new_loads}"
    for a in others:  # the replica is whole again: the restarted rank reloaded them (planned, not asked)
        wait_ready(ctl, a, replica, 60)
    assert ray.get(ctl.check_integrity.remote())


def residency(worker) -> set[tuple[str, str]]:
    try:
        return {(a, s) for a, _, s, *_ in ray.get(worker.describe.remote(), timeout=5)["residency"]}
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return set()


def test_the_hosted_engine_serves_a_name_registered_by_nobody_once_it_resolves_it(fleet: Fleet) -> None:
    """Issue 44 items 1 and 4 for the reference engine: a streaming run's rank 0 takes a submit naming an adapter
    nobody registered that lies under an adapter root; the submit has the controller register it (request-time
    resolution) and returns once rank 0's catalog holds it; both ranks serve it at that version. A name under no
    root refuses its whole submit with the controller's NotFoundError, naming its requests, and the run goes on.
    (Before: ``HostedEngine.submit`` refused any name rank 0's catalog lacked, "register it first".)"""
    service, ctl, replica = fleet.svc, fleet.svc.controller, "replica-1"
    ranks = [service.workers[WorkerId(replica, k)] for k in (0, 1)]
    with pytest.raises(ray.exceptions.RayTaskError, match="not registered"):
        ray.get(ctl.lookup_adapter.remote(NEW))
    engine = EngineConfig(adapters=str(fleet.root), model="tiny", device="cpu", tp=2, num_slots=3, max_adapters=2,
                          max_running=4, max_prefill_tokens=24, max_seq_len=32, max_rank=16, admission="overlap",
                          audit_steps=True, host=HostTierConfig(host_bytes=1 << 22, pin=False))
    meet = ray.get(ranks[0].engine_rendezvous.remote(2), timeout=60)
    ray.get([h.engine_build.remote(engine, meet) for h in ranks], timeout=300)
    start_wall = time.time()
    runs = [ranks[0].engine_run.remote([], start_wall, 0, True, True), ranks[1].engine_run.remote([], start_wall)]
    ray.get(ranks[0].engine_submit.remote([Request(0, "adapter-001", 3, 2), Request(1, NEW, 3, 2)]), timeout=60)
    version = ray.get(ctl.lookup_adapter.remote(NEW), timeout=30)["version"]  # registered by the submit
    with pytest.raises(NotFoundError, match=r"requests \[3\] \(nothing of this call was submitted\).*'nowhere'"):
        ray.get(ranks[0].engine_submit.remote([Request(2, NEW, 4, 1), Request(3, "nowhere", 3, 1)]), timeout=60)
    ray.get(ranks[0].engine_submit.remote([Request(4, NEW, 5, 1)]), timeout=60)
    ray.get(ranks[0].engine_end_stream.remote(), timeout=60)
    result = ray.get(runs[0], timeout=300)
    ray.get(runs[1], timeout=60)
    records = {r.rid: r for r in result.records}
    assert sorted(records) == [0, 1, 4], "the refused submit's requests ran, or an accepted one did not"
    for rid in (1, 4):
        assert records[rid].ok and records[rid].version == version, records[rid]
        for rank in result.ranks:  # both ranks computed it at the resolved version, never another
            keys = {key for audit in rank.audit for r, key in zip(audit.rids, audit.keys) if r == rid}
            assert keys == {f"{NEW}@{version}"}, (rank.rank, rid, keys)
    assert ray.get(ctl.check_integrity.remote())
