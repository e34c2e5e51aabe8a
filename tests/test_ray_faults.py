"""The fault-injection suite on a real two-node Ray cluster (issue 35, item 8; ``ray.cluster_utils.Cluster``, as
tests/test_ray_multinode.py): two TP-2 replicas, each with one rank on each node. Faults, in order: a file
changed mid-read in a worker (its read fails, the worker lives), a rank killed mid-load and one killed after its
loads, a worker stopped with SIGSTOP (the rest of the fleet goes on, an UnregisterAdapter with a 2 s drain
returns in about 2 s, SIGCONT recovers it), the controller killed (restarted with its catalog and the workers'
residency), and the second node lost (its ranks' replicas ready for nothing while it is gone, ready again on a
new node).

Invariants checked throughout (``audit``): no wrong READY (a replica reported ready for adapter@version while
one of its ranks, asked before and after, does not hold exactly that version ready; a rank that cannot be asked
because it is stopped is not counted, one that is dead holds nothing) and nothing lost (the registered catalog
and its versions as before, the controller's residency equal to the workers' own reports once recovered). The
figures (faults injected, survived, wrong READY seen, data lost) are printed at the end (``fault_tally``) and
kept in bench/RESULTS.md.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, Service, start, wait_ready  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.vocab import WorkerId  # noqa: E402
from tests.fault_tally import Tally  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.faults import Gate  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the lambdas below run inside the actors

REPLICAS, TP = ("replica-0", "replica-1"), 2
NAMES = [f"adapter-{i:03d}" for i in range(6)]
RESTART_S = 120  # a controller on the lost node: the GCS finds the node dead (~13 s), then the new one starts (a
# torch import: 40 s seen on this 2-core machine beside busy loops)
DEAD = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Fleet(NamedTuple):
    cluster: Any
    svc: Service
    root: Path
    tally: Tally


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=len(NAMES), rank="8,16"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    tally = Tally("test_ray_faults (two-node Ray, 2 replicas x TP 2)")
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="lora-cache")
        svc = start(
            ServeConfig(adapters=str(root), replicas=len(REPLICAS), tp=TP, placement="STRICT_SPREAD", worker_cpus=0.5),
            CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=16),
            PlannerConfig(policy="queue"),
            WorkerConfig(num_slots=3, host=HostTierConfig(host_bytes=1 << 22, pin=False)),
        )
        try:
            yield Fleet(cluster, svc, root, tally)
        finally:
            tally.report()
            svc.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()


# -- the invariants -----------------------------------------------------------------------------------------


def residency(worker: Any, timeout_s: float = 1.0) -> set[tuple[str, str, str]] | None:
    """(adapter, version, state) the worker holds; empty if it is dead or restarting, None if it does not
    answer (stopped)."""
    try:
        return {(a, v, s) for a, v, s, *_ in ray.get(worker.describe.remote(), timeout=timeout_s)["residency"]}
    except DEAD:
        return set()
    except ray.exceptions.GetTimeoutError:
        return None


def ranks(fleet: Fleet, replica: str) -> list[WorkerId]:
    return [WorkerId(replica, k) for k in range(TP)]


def audit(fleet: Fleet, names: list[str] = NAMES, skip: frozenset[WorkerId] = frozenset()) -> int:
    """Wrong READYs now: every rank's report, every lookup, every rank's report again. ``skip``: ranks known to be
    stopped (they hold what they held; they cannot say)."""
    ctl, workers = fleet.svc.controller, fleet.svc.workers
    before = {w: residency(h) if w not in skip else None for w, h in workers.items()}
    looks = {}
    for name in names:
        try:
            looks[name] = ray.get(ctl.lookup_adapter.remote(name), timeout=10)
        except (ray.exceptions.GetTimeoutError, *DEAD):
            continue  # the controller is restarting: it says nothing, so nothing wrong
    after = {w: residency(h) if w not in skip else None for w, h in workers.items()}
    wrong = 0
    for name, found in looks.items():
        want = (name, found["version"], "ready")
        for replica in found["ready"]:
            for wid in ranks(fleet, replica):
                seen = [r for r in (before[wid], after[wid]) if r is not None]
                if seen and not any(want in r for r in seen):
                    wrong += 1
    return wrong


def consistent(fleet: Fleet, versions: dict[str, str]) -> int:
    """Data lost after recovery: registered adapters missing or at another version, and adapters the controller
    counts READY on a replica whose ranks do not all hold them (or the reverse), once settled."""
    ctl = fleet.svc.controller
    lost = 0
    for name, version in versions.items():
        try:
            lost += ray.get(ctl.lookup_adapter.remote(name), timeout=30)["version"] != version
        except ray.exceptions.RayTaskError:
            lost += 1

    def agree() -> bool:
        reports = {w: residency(h, 10) or set() for w, h in fleet.svc.workers.items()}
        for name, version in versions.items():
            ready = set(ray.get(ctl.lookup_adapter.remote(name), timeout=10)["ready"])
            held = {r for r in REPLICAS if all((name, version, "ready") in reports[w] for w in ranks(fleet, r))}
            if ready != held:
                return False
        return True

    try:
        wait_for(agree, "the controller's readiness to equal the workers' reports", timeout=30)
    except (AssertionError, TimeoutError):
        lost += 1
    return lost


def versions_now(fleet: Fleet) -> dict[str, str]:
    return {n: ray.get(fleet.svc.controller.lookup_adapter.remote(n))["version"] for n in NAMES}


def queue(fleet: Fleet, replica: str, names: list[str]) -> None:
    ray.get(fleet.svc.controller.report_queue.remote(replica, [(n, time.time()) for n in names]))


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def audits(fleet: Fleet, seconds: float, skip: frozenset[WorkerId] = frozenset()) -> tuple[int, int]:
    """(wrong READYs, samples) over ``seconds`` of back-to-back audits."""
    end, wrong, samples = time.monotonic() + seconds, 0, 0
    while time.monotonic() < end:
        wrong += audit(fleet, skip=skip)
        samples += 1
    return wrong, samples


# -- the faults -----------------------------------------------------------------------------------------------


def test_a_file_changed_mid_read_fails_that_read_and_the_worker_lives(fleet: Fleet) -> None:
    """Before issue 35 a CPU worker's reader thread copied from a mapped file: cutting the file short raised
    SIGBUS in the worker actor itself, which died. Now the read fails with AdapterChangedError, the worker keeps
    its slots, and re-registering the restored file loads it."""
    ctl, svc = fleet.svc.controller, fleet.svc
    worker = svc.workers[WorkerId("replica-0", 0)]
    queue(fleet, "replica-0", ["adapter-001"])
    wait_ready(ctl, "adapter-001", "replica-0", 60)
    before_ready = {(a, v) for a, v, s in residency(worker) or set() if s == "ready"}
    failures = ray.get(worker.stats.remote())["load_failures"]
    pid = pid_of(worker)
    target = "adapter-004"
    weights = fleet.root / target / "adapter_model.safetensors"
    pristine = weights.read_bytes()
    gate = ray.remote(Gate).remote()
    ray.get(worker.arm_fault.remote("mid_read", target, gate))
    queue(fleet, "replica-0", ["adapter-001", target])
    assert ray.get(gate.wait_arrived.remote(60)).startswith(f"{target}@")
    with open(weights, "r+b") as f:
        f.truncate(len(pristine) // 2)
    ray.get(gate.release.remote())
    wait_for(lambda: ray.get(worker.stats.remote())["load_failures"] > failures, "the changed read to fail", timeout=30)
    alive = pid_of(worker) == pid
    kept = before_ready <= {(a, v) for a, v, s in residency(worker) or set() if s == "ready"}
    wrong = audit(fleet)
    weights.write_bytes(pristine)  # the file back: a new identity, the same bytes (checked in full, then taken)
    queue(fleet, "replica-0", ["adapter-001", target])
    wait_ready(ctl, target, "replica-0", 60)
    # the operator registers the restored file again: its identity moved, so a restarted controller would restore
    # it as a new version (known issues); registered now, the later tests' versions are the files' own
    version, _ = ray.get(ctl.register_adapter_info.remote(target, str(fleet.root / target)))
    assert ray.get(ctl.lookup_adapter.remote(target))["version"] == version
    fleet.tally.record("adapter file cut short mid-read in a worker", alive and kept, wrong)
    assert alive, "the worker's process died (SIGBUS?)"
    assert kept, "the worker lost the adapters it held"
    assert wrong == 0


def test_a_rank_killed_mid_load_and_after_its_loads(fleet: Fleet) -> None:
    """Mid-load: stopped at ``before_copy`` and killed there; after: killed holding READY adapters. Each time the
    replica is sampled back to back while the rank restarts: never ready for what the dead rank lacks; ready
    again once the restarted rank has reloaded."""
    ctl, svc = fleet.svc.controller, fleet.svc
    versions = versions_now(fleet)
    victim = svc.workers[WorkerId("replica-1", 1)]
    queue(fleet, "replica-1", ["adapter-002", "adapter-003"])
    for name in ("adapter-002", "adapter-003"):
        wait_ready(ctl, name, "replica-1", 60)
    gate = ray.remote(Gate).remote()
    ray.get(victim.arm_fault.remote("before_copy", "adapter-005", gate))
    queue(fleet, "replica-1", ["adapter-005", "adapter-002", "adapter-003"])
    ray.get(gate.wait_arrived.remote(60))
    ray.kill(victim, no_restart=False)  # mid-load
    wrong, samples = audits(fleet, 3.0)
    queue(fleet, "replica-1", ["adapter-005", "adapter-002"])
    wait_ready(ctl, "adapter-005", "replica-1", 90)
    fleet.tally.record(f"rank killed mid-load ({samples} audits)", True, wrong)
    wait_ready(ctl, "adapter-002", "replica-1", 60)
    ray.kill(victim, no_restart=False)  # after its loads: it held adapter-002 and adapter-005 READY
    wrong_after, samples = audits(fleet, 3.0)
    queue(fleet, "replica-1", ["adapter-005", "adapter-002"])
    for name in ("adapter-005", "adapter-002"):
        wait_ready(ctl, name, "replica-1", 90)
    lost = consistent(fleet, versions)
    fleet.tally.record(f"rank killed after its loads ({samples} audits)", lost == 0, wrong_after, lost)
    assert wrong == wrong_after == 0 and lost == 0


def test_a_stopped_worker_stalls_nothing_and_recovers(fleet: Fleet) -> None:
    """SIGSTOP one rank: status and lookups answer, the other replica still loads what it is asked (plans go
    on), an UnregisterAdapter with a 2 s drain returns in about 2 s (it waited 9.4 s before, and forever here
    on a worker that holds the adapter); SIGCONT: the worker answers again, and its replica is whole."""
    ctl, svc = fleet.svc.controller, fleet.svc
    versions = versions_now(fleet)
    stopped_id = WorkerId("replica-0", 1)
    queue(fleet, "replica-0", ["adapter-000"])
    wait_ready(ctl, "adapter-000", "replica-0", 60)
    pid = pid_of(svc.workers[stopped_id])
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        ray.get(ctl.status.remote(), timeout=5)
        status_s = time.monotonic() - t0
        queue(fleet, "replica-1", ["adapter-000", "adapter-001"])
        for name in ("adapter-000", "adapter-001"):
            wait_ready(ctl, name, "replica-1", 60)  # plans and the other workers' loads go on
        wrong = audit(fleet, skip=frozenset({stopped_id}))
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match=r"did not answer|still hold"):
            ray.get(ctl.unregister_adapter.remote("adapter-000", 2.0), timeout=30)
        drain_s = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert residency(svc.workers[stopped_id], 30) is not None, "the worker did not answer after SIGCONT"
    ray.get(ctl.unregister_adapter.remote("adapter-000", 30.0), timeout=60)  # resumed: it drains now
    ray.get(ctl.register_adapter.remote("adapter-000", str(fleet.root / "adapter-000")))  # the same bytes again
    queue(fleet, "replica-0", ["adapter-000", "adapter-001"])
    for name in ("adapter-000", "adapter-001"):
        wait_ready(ctl, name, "replica-0", 60)
    lost = consistent(fleet, versions)
    ok = status_s < 2.0 and drain_s < 5.0
    fleet.tally.record(
        f"worker SIGSTOP (status {status_s:.2f} s, 2 s drain {drain_s:.1f} s)", ok and lost == 0, wrong, lost
    )
    assert status_s < 2.0 and drain_s < 5.0, (status_s, drain_s)
    assert wrong == 0 and lost == 0


def test_a_killed_controller_comes_back_with_its_catalog_and_residency(fleet: Fleet) -> None:
    ctl = fleet.svc.controller
    versions = versions_now(fleet)
    before = ray.get(ctl.status.remote())
    ray.kill(ctl, no_restart=False)
    wrong, samples = audits(fleet, 2.0)
    wait_for(lambda: _started_after(ctl, before["started_at"]), "the controller to restart", timeout=60)
    wrong += audit(fleet)
    lost = consistent(fleet, versions)  # the catalog restored, the residency rebuilt from the workers' reports
    fleet.tally.record(f"controller killed ({samples} audits while it restarted)", lost == 0, wrong, lost)
    assert wrong == 0 and lost == 0


def _started_after(ctl: Any, then: float) -> bool:
    try:
        return ray.get(ctl.status.remote(), timeout=5)["started_at"] > then
    except (ray.exceptions.GetTimeoutError, *DEAD):
        return False


def test_the_second_node_lost_and_a_new_one_added(fleet: Fleet) -> None:
    """Every replica has a rank on the second node: with it gone, no replica may be ready for anything; the
    controller answers throughout (or, when it was on the lost node, once Ray restarted it on the head: its
    rebuild does not wait for the lost node's workers, the fresh-clone CI failure of 2026-11-26); a new node takes
    the lost ranks and the replicas load again."""
    ctl = fleet.svc.controller
    versions = versions_now(fleet)
    for replica in REPLICAS:
        queue(fleet, replica, ["adapter-001"])
        wait_ready(ctl, "adapter-001", replica, 60)
    node = next(n for n in fleet.cluster.list_all_nodes() if n is not fleet.cluster.head_node)
    if node.node_id == ray.get_runtime_context().get_node_id():  # cluster_utils refuses to remove the driver's node
        pytest.skip(f"Ray {ray.__version__} joined this driver to the second node, not the head (both on this host: "
                    "Ray < 2.54 picks either; 2.54+ the head)")
    with_controller = node_of(ctl) == node.node_id
    fleet.cluster.remove_node(node, allow_graceful=False)
    wrong, samples = audits(fleet, 3.0)
    quiet = wait_for_quiet(ctl, 30 + (RESTART_S if with_controller else 0))
    fleet.cluster.add_node(num_cpus=2)
    fleet.cluster.wait_for_nodes()
    wait_for(lambda: _started_after(ctl, 0), "the controller to answer", timeout=RESTART_S)
    for replica in REPLICAS:
        queue(fleet, replica, ["adapter-001"])
        wait_ready(ctl, "adapter-001", replica, 120)
    lost = consistent(fleet, versions)
    where = "the controller's node" if with_controller else "a node without the controller"
    fleet.tally.record(f"{where} lost, then a new node ({samples} audits)", quiet == "quiet" and lost == 0, wrong, lost)
    assert quiet == "quiet", f"{where} lost: {quiet}"
    assert wrong == 0 and lost == 0


def node_of(actor: Any) -> str:
    return str(ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=30))


def wait_for_quiet(ctl: Any, timeout_s: float) -> str:
    """Whether ("quiet") within ``timeout_s`` of the node's loss no replica is ready for anything; else what was seen
    last. A controller that does not answer (restarting: it was on the lost node) says nothing wrong meanwhile."""
    deadline, seen = time.monotonic() + timeout_s, "the controller never answered a lookup"
    while time.monotonic() < deadline:
        try:  # the controller may have been on the lost node: it restarts on the head
            ready = {n: r for n in NAMES if (r := ray.get(ctl.lookup.remote(n), timeout=10)["ready"])}
            if not ready:
                return "quiet"
            seen = f"a replica stayed ready with a rank on the lost node: {ready}"
        except (ray.exceptions.GetTimeoutError, *DEAD) as e:
            seen = f"the controller did not answer a lookup ({type(e).__name__})"
        time.sleep(0.2)
    return seen
