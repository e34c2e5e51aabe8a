"""The engine seam on a real local Ray: engine processes of their own attach as the ranks of a replica.

Two spawned processes (not actors of ``lora-cache serve``, which here runs the controller alone) attach
as ranks 0 and 1 of ``replica-0``; the controller prefetches into them from hints; the reference engine
steps through them; a killed rank and a detached rank leave the replica ready for nothing, and attaching
again restores it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.app.serve import wait_ready as serve_wait_ready  # noqa: E402
from lora_cache.errors import ConfigError, ConflictError  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.runtime.ports import free_port  # noqa: E402
from tests import waiting  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from workers.attach.attachment import AttachConfig, EndpointStaleError, attach  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.hosted import Rendezvous  # noqa: E402
from workers.engine.process import EngineProcess, start_ranks  # noqa: E402
from workers.engine.workload import Request  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

CATALOG = CatalogConfig(model="tiny", max_rank=16)  # the controller's; ranks take it from there
HOST = HostTierConfig(host_bytes=1 << 22, pin=False)


def worker(rank: int, tp: int = 2, slots: int = 3) -> WorkerConfig:
    return WorkerConfig(num_slots=slots, tp=tp, tp_rank=rank, device="cpu", dtype="float32", host=HOST)


def wait_ready(controller, adapter: str, replica: str, timeout_s: float = 60.0) -> None:
    """``serve.wait_ready``, saying what the controller saw if it times out."""
    try:
        serve_wait_ready(controller, adapter, replica, timeout_s)
    except TimeoutError as e:
        raise AssertionError(f"{e}; {_controller_view()}") from e


def _controller_view() -> str:
    ctl = ray.get_actor("lora-cache-controller", namespace="lora-cache")
    status = ray.get(ctl.status.remote(), timeout=30)
    return f"controller status: {status}"


def wait_for(condition, what: str) -> object:
    """``waiting.wait_for`` with this module's 60 s, saying what the controller saw if it times out."""
    return waiting.wait_for(condition, what, timeout=60.0, detail=_controller_view)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The controller alone (``serve --replicas 0``) and the Ray cluster's address for engine processes."""
    root: Path = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=6, rank="8,16"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False)
    try:
        service = start(ServeConfig(adapters=str(root), replicas=0), CATALOG, PlannerConfig(policy="global"),
                        worker(0, tp=1))
        try:
            yield service, ray.get_runtime_context().gcs_address, root
        finally:
            service.stop()
    finally:
        ray.shutdown()


def ready_on(controller, adapter: str) -> list[str]:
    return ray.get(controller.lookup.remote(adapter))["ready"]


def test_engine_processes_attach_serve_and_recover(fleet) -> None:
    service, gcs, _ = fleet
    ctl = service.controller

    def config(rank: int) -> AttachConfig:
        return AttachConfig(replica="replica-0", address=gcs, poll_s=0.5, liveness_s=10.0)  # a loaded 2-core CI machine

    ranks = start_ranks(config, [worker(0), worker(1)])
    try:
        status = ray.get(ctl.status.remote())
        assert status["replicas"] == ["replica-0"] and status["workers"] == 2
        # the controller prefetches into both processes from a hint; the replica is ready only once both are
        assert ray.get(ctl.hint.remote([("h-1", "adapter-001", "replica-0", 0.5)])) == 1
        wait_ready(ctl, "adapter-001", "replica-0", 60)
        for proc in ranks:
            assert ("adapter-001", "ready") in {(r["adapter"], r["state"]) for r in proc.call("residency")}
            assert len(proc.call("step", ["adapter-001", "adapter-001"])) == 2  # acquire + release, a hit
            stats = proc.call("stats")
            assert stats["gpu_hits"] == 1 and stats["gpu_misses"] == 0 and stats["commands_accepted"] >= 1
            assert stats["prefetches"] >= 1
            seam = proc.call("seam")  # describe, the registrations replayed, the commands
            assert seam["calls"] >= 3 and seam["errors"] == 0 and seam["lost"] is None

        # the reference engine (TP 2 over gloo) runs through the seam; rank 0 reports its queue
        engine = EngineConfig(model="tiny", tp=2, device="cpu", dtype="float32", num_slots=3, max_rank=16,
                              max_adapters=2, max_running=4, max_prefill_tokens=32, max_seq_len=32, host=HOST)
        requests = [Request(i, f"adapter-00{i % 4}", 4 + i % 3, 2, 0.01 * i) for i in range(6)]
        meet = Rendezvous("127.0.0.1", free_port(), 2)
        for f in [p.submit("build", engine, meet) for p in ranks]:
            f.result(timeout=300)
        start_wall = time.time() + 0.5
        runs = [ranks[0].submit("run", requests, start_wall, 0, True), ranks[1].submit("run", requests, start_wall)]
        result = runs[0].result(timeout=300)
        runs[1].result(timeout=300)
        assert sorted(r.rid for r in result.records) == list(range(6))
        assert all(r.error is None and len(r.token_s) == r.output_len for r in result.records)
        assert ray.get(ctl.status.remote())["queue_depths"]["replica-0"] == 0  # its last report: nothing waits
        assert ray.get(ctl.check_integrity.remote())

        # a killed rank: the replica is ready for nothing, though rank 0 still holds its shards. The run's
        # on-demand loads decided which 3 of its 4 adapters stay (CI once kept adapter-001 out, and with no
        # hint left nothing brought it back): a new hint makes it a need again
        assert ray.get(ctl.hint.remote([("h-1b", "adapter-001", "replica-0", 0.5)])) == 1
        wait_ready(ctl, "adapter-001", "replica-0", 60)
        ranks[1].kill()
        wait_for(lambda: "replica-0" not in ready_on(ctl, "adapter-001"), what="the killed rank dropped")
        wait_for(lambda: not _named("lora-cache-worker:replica-0:1"), what="the endpoint dead with its owner")
        assert ("adapter-001", "ready") in {(r["adapter"], r["state"]) for r in ranks[0].call("residency")}
        assert all("replica-0" not in ready_on(ctl, f"adapter-00{i}") for i in range(6))

        # attaching again restores it: the new process is adopted, registrations replayed, the hint replanned
        ranks[1] = EngineProcess(config(1), worker(1))
        assert ray.get(ctl.hint.remote([("h-2", "adapter-001", "replica-0", 0.5)])) == 1
        wait_ready(ctl, "adapter-001", "replica-0", 60)
        assert ranks[1].call("stats")["loads"] >= 1

        # a detached rank is handled the same way
        ranks[0].close()
        wait_for(lambda: "replica-0" not in ready_on(ctl, "adapter-001"), what="the detached rank dropped")
        ranks[0] = EngineProcess(config(0), worker(0))
        assert ray.get(ctl.hint.remote([("h-3", "adapter-001", "replica-0", 0.5)])) == 1
        wait_ready(ctl, "adapter-001", "replica-0", 60)
        assert ray.get(ctl.check_integrity.remote())
    finally:
        for proc in ranks:
            proc.close()


def test_attach_refuses_a_taken_rank_and_a_mismatched_replica(fleet) -> None:
    """The test process itself attaches (any Ray driver may): a second attach of its rank is a conflict; a
    rank that disagrees with its replica's TP size or slot count is refused, and leaves nothing behind; a
    replica whose ranks all detached leaves the fleet."""
    service, gcs, _ = fleet
    config = AttachConfig(replica="replica-x", address=gcs, poll_s=0.5, liveness_s=10.0, name_wait_s=0)
    with attach(config, worker(0, tp=1, slots=2)) as rank:
        with pytest.raises(ConflictError, match=r"rank 0 of replica 'replica-x' is already attached"):
            attach(config, worker(0, tp=1, slots=2))
        batch = rank.acquire(["adapter-002"])  # a miss loads on demand; the controller hears of it (held meanwhile:
        # the planner may evict it for the adapters an earlier test made popular once it is released)
        wait_for(lambda: "replica-x" in ready_on(service.controller, "adapter-002"), what="the demand load seen")
        rank.release(batch)
        rank.cache.check_integrity()
        with pytest.raises(ConfigError, match=r"replica 'replica-x' already exists with workers"):
            attach(config, worker(1, tp=2, slots=2))
        with pytest.raises(ValueError):  # nothing named after a refused rank is left behind
            ray.get_actor("lora-cache-worker:replica-x:1", namespace="lora-cache")
    wait_for(lambda: "replica-x" not in ready_on(service.controller, "adapter-002"), what="the detach seen")
    # issue 35: a replica whose ranks all detached leaves the fleet; attaching again adds it anew
    wait_for(lambda: "replica-x" not in ray.get(service.controller.status.remote())["replicas"],
             what="the detached replica gone")
    config_y = AttachConfig(replica="replica-y", address=gcs, poll_s=0.5, liveness_s=10.0, name_wait_s=0)
    with attach(config_y, worker(0, tp=2, slots=2)), pytest.raises(ConfigError, match=r"2 slots per worker, not 5"):
        attach(config_y, worker(1, tp=2, slots=5))
    wait_for(lambda: "replica-y" not in ray.get(service.controller.status.remote())["replicas"],
             what="the second detached replica gone")


def test_a_process_that_stops_serving_is_a_dead_rank(fleet) -> None:
    """A process alive but no longer polling its endpoint (a wedged serve thread): the controller's calls
    fail instead of waiting forever (its health loop resyncs through them), its ping fails, and the rank
    is dropped like a dead worker."""
    service, gcs, _ = fleet
    rank = attach(AttachConfig(replica="replica-w", address=gcs, poll_s=0.2, liveness_s=1.0), worker(0, tp=1, slots=2))
    try:
        batch = rank.acquire(["adapter-003"])
        wait_for(lambda: "replica-w" in ready_on(service.controller, "adapter-003"), what="the load seen")
        rank.release(batch)
        rank.served.stopping.set()  # stands in for a wedged serve thread: it stops polling, the endpoint stays
        rank.served.thread.join(timeout=30)
        endpoint = ray.get_actor(rank.name, namespace="lora-cache")
        with pytest.raises(EndpointStaleError, match="has not polled for calls"):
            ray.get(endpoint.describe.remote(), timeout=30)
        wait_for(lambda: "replica-w" not in ready_on(service.controller, "adapter-003"), what="the rank dropped")
    finally:
        rank.served.stopping.clear()
        rank.detach()


def test_an_attached_rank_resolves_a_new_adapter_under_a_root(fleet) -> None:
    """Issue 44 item 4: a rank attached through Ray (what the Ray Serve integration's replicas are) resolves a name
    nobody registered: the controller registers it from the adapter root, and ``resolve`` returns once this rank's
    catalog holds that version, which it then acquires; a name under no root raises the controller's
    ``NotFoundError`` itself. (Before: the seam had no call for it; ``CacheReplica`` refused the name.)"""
    import shutil

    from lora_cache.errors import NotFoundError

    service, gcs, root = fleet
    shutil.copytree(root / "adapter-002", root / "tenant-ray")
    rank = attach(AttachConfig(replica="replica-n", address=gcs), worker(0, tp=1, slots=2))
    try:
        assert "tenant-ray" not in rank.catalog
        version = rank.resolve("tenant-ray")
        assert rank.catalog.get("tenant-ray").version == version
        assert ray.get(service.controller.lookup_adapter.remote("tenant-ray"))["version"] == version
        batch = rank.acquire(["tenant-ray"])
        assert batch.keys[0].version == version
        rank.release(batch)
        with pytest.raises(NotFoundError, match="tenant-nowhere"):
            rank.resolve("tenant-nowhere")
    finally:
        rank.detach()
        shutil.rmtree(root / "tenant-ray", ignore_errors=True)


def test_a_serve_rank_waits_what_is_left_of_the_lease_for_a_slot(fleet) -> None:
    """Issue 46 (back-pressure): rank k of a Serve replica waits for a slot only what rank 0's wait left of the
    lease's ``slot_wait_s``, so one lease waits about ``slot_wait_s`` in all, not once per rank. Here the replica's
    config allows 30 s; rank 1, its one slot held, is given 0.2 s left and fails after it with the wait named."""
    from lora_cache.integrations.serve_replica import RankActor, ReplicaCacheConfig
    from lora_cache.vocab import AdapterKey

    service, _, _ = fleet
    config = ReplicaCacheConfig(tp=2, num_slots=1, slot_wait_s=30.0,
                                worker={"host": HostTierConfig(host_bytes=1 << 22, pin=False)})
    actor = RankActor.remote(config, "replica-l", 1)
    try:
        def key(name: str) -> AdapterKey:
            return AdapterKey(name, ray.get(service.controller.lookup_adapter.remote(name))["version"])

        assert ray.get(actor.acquire.remote("held", key("adapter-001")), timeout=60) == 0
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match=r"waited 0\.2 s \(slot_wait_s\)"):
            ray.get(actor.acquire.remote("late", key("adapter-002"), 0.2), timeout=60)
        assert time.monotonic() - started < 10  # not the config's 30 s
        ray.get(actor.release.remote("held"), timeout=30)
        assert ray.get(actor.acquire.remote("late", key("adapter-002"), 0.2), timeout=60) == 0  # room: no wait
    finally:
        ray.get(actor.detach.remote(), timeout=60)
        ray.kill(actor)


def test_a_call_longer_than_liveness_is_not_a_dead_process(fleet) -> None:
    """A controller call that runs past ``liveness_s`` (on a GPU, registering dozens of 8B adapters took 9.7 s
    in one batch and every call failed as stale) keeps its process alive: the heartbeat covers it, the call
    answers, and the rank stays in the fleet; a batch of calls is answered call by call."""
    service, gcs, _ = fleet
    rank = attach(AttachConfig(replica="replica-s", address=gcs, poll_s=0.2, liveness_s=1.0), worker(0, tp=1, slots=2))
    gate, entered = threading.Event(), threading.Event()
    real = rank.control.describe

    def held(node):  # the call runs until the test lets it go
        entered.set()
        assert gate.wait(60)
        return real(node)

    try:
        endpoint = ray.get_actor(rank.name, namespace="lora-cache")
        rank.control.describe = held
        slow = endpoint.describe.remote()
        assert entered.wait(30)
        done, _ = ray.wait([slow], timeout=3 * rank.config.liveness_s)  # three liveness periods inside the call
        assert not done, "the call ended while it was held: " + repr(ray.get(slow))
        assert ray.get(endpoint.ping.remote(), timeout=30)  # alive while busy
        rank.control.describe = real
        gate.set()
        assert ray.get(slow, timeout=30) is not None
        batch = rank.acquire(["adapter-004"])
        wait_for(lambda: "replica-s" in ready_on(service.controller, "adapter-004"), what="the rank still serving")
        rank.release(batch)
    finally:
        gate.set()
        rank.detach()


def test_a_call_that_ends_during_the_detach_ends_the_serve_thread_quietly(fleet) -> None:
    """A controller call still running when the rank detaches (the detach kills the endpoint and clears it, then
    waits for the serve thread) finishes with nobody to answer: the serve thread ends without an error escaping
    it and the rank is not counted lost. Before, its answer read the cleared endpoint and the thread died with
    ``'NoneType' object has no attribute 'answer'`` (seen in a full CI run, 2026-12-05)."""
    _, gcs, _ = fleet
    rank = attach(AttachConfig(replica="replica-d", address=gcs, poll_s=0.2, liveness_s=1.0), worker(0, tp=1, slots=2))
    gate, entered = threading.Event(), threading.Event()
    real = rank.control.describe
    escaped: list[BaseException | None] = []
    hook = threading.excepthook

    def held(node):  # the call runs until the test lets it go
        entered.set()
        assert gate.wait(60)
        return real(node)

    def caught(args) -> None:
        if args.thread is rank.served.thread:
            escaped.append(args.exc_value)
        else:
            hook(args)

    threading.excepthook = caught
    try:
        endpoint = ray.get_actor(rank.name, namespace="lora-cache")
        rank.control.describe = held
        endpoint.describe.remote()
        assert entered.wait(30)
        leaving = threading.Thread(target=rank.detach)
        leaving.start()
        waiting.wait_for(lambda: rank.transport.endpoint is None, "the detach closed the endpoint", timeout=60)
        gate.set()  # the call ends after its endpoint is gone
        leaving.join(timeout=120)
        assert not leaving.is_alive() and not rank.served.thread.is_alive()
        assert escaped == [] and rank.served.lost is None, (escaped, rank.served.lost)
    finally:
        gate.set()
        threading.excepthook = hook
        rank.detach()


def _named(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="lora-cache")
        return True
    except ValueError:
        return False


def test_the_benchmark_runs_its_engine_ranks_attached(tmp_path: Path) -> None:
    """``bench.run --quick --attach``: the quick real run (here one replica of TP 2) with every engine rank
    in its own attached process (its own Ray cluster, in a subprocess); every request is served, under a
    planning policy and under the oracle's preload."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--attach", "--policies", "global,oracle",
                           "--tp", "2", "--replicas", "1", "--out", str(tmp_path), "--no-plots"], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["bench"]["attach"] and doc["config"]["real"]["attach"] and doc["config"]["real"]["tp"] == 2
    ranks = doc["ranks"]["global"]  # both processes served and took the controller's commands
    assert {(r["replica"], r["rank"]) for r in ranks} == {("replica-0", 0), ("replica-0", 1)}
    assert all(r["commands_accepted"] > 0 for r in ranks)
    requests = doc["config"]["workload"]["requests"]
    for name in ("global", "oracle"):
        assert (doc["figures"][name]["completed"], doc["figures"][name]["failed"]) == (requests, 0), name
    assert doc["figures"]["global"]["prefetch_accuracy"] is not None  # the controller prefetched into them
    assert doc["figures"]["oracle"]["loads"] == 0  # every adapter preloaded into the processes before the clock


def test_an_endpoint_imports_what_it_unpickles_before_its_first_call(fleet) -> None:
    """The relay's values (commands and answers, ``lora_cache.vocab``) are unpickled on the endpoint's event
    loop. Imported lazily by the first answer, an import stalled every call and poll behind it: when the
    answer's module imported torch, the controller's next command reached the process 1.2-1.4 s late
    (bench.run --quick --attach: GPU hit 0.625 against 1.0 hosted). So the endpoint imports them when it is
    made; and since they are plain Python now, an endpoint (in the gateway's process too) never loads torch."""
    import sys

    from lora_cache.link.endpoint import Endpoint

    endpoint = Endpoint.remote("lora-cache-worker:probe:0", 5.0)
    try:
        loaded = ray.get(endpoint.__ray_call__.remote(
            lambda self: [m for m in ("lora_cache.vocab", "torch") if m in sys.modules]), timeout=60)
        assert loaded == ["lora_cache.vocab"]
    finally:
        ray.kill(endpoint, no_restart=True)


def test_an_attached_rank_off_the_controllers_push_area_serves_pushed_versions_from_its_own_copy(
        fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 item 2 on the attach seam: an engine's rank whose machine does not hold the controller's push area
    (here: its process names another, as another machine's memory is apart) takes each pushed version by fetching
    its bytes through its transport, proving them, and keeping a copy in its own area; its slot then holds that
    copy's slices of exactly what the trainer pushed. Versions the controller retires leave the copy too (the
    relayed ``drop_pushed``), and an unregistered name leaves nothing. (Before: its loads failed, naming a missing
    directory.)"""
    import json

    import torch
    from safetensors.torch import load

    from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE
    from lora_cache.adapters.pushed import ENV
    from lora_cache.integrations.ray_push import push_in_ray
    from workers.reads.shard import read_shard

    service, gcs, root = fleet
    name = "trained-attached"
    tensors = load((root / "adapter-001" / WEIGHTS_FILE).read_bytes())
    config = json.loads((root / "adapter-001" / CONFIG_FILE).read_text())
    area = tmp_path / "engine-machine-memory"
    monkeypatch.setenv(ENV, str(area))  # this process's push area; the controller's is its own
    rank = attach(AttachConfig(replica="replica-p", address=gcs), worker(0, tp=1, slots=2))
    kept = lambda: sorted(p.name for p in (area / "lora-cache" / name).glob("*") if not p.name.startswith("."))  # noqa: E731
    try:
        for step in (1, 2, 3, 4, 5, 6):
            pushed = {k: (v.float() * (1 + step / 10)).to(v.dtype) for k, v in tensors.items()}
            done = push_in_ray(name, pushed, config, tag=step, timeout_s=120)
            assert not done.rank_pending, done
            spec = rank.catalog.get(name)
            assert spec.version == done.version and Path(str(spec.path)).is_relative_to(area), spec.path
            held = load((Path(str(spec.path)) / WEIGHTS_FILE).read_bytes())
            assert held.keys() == pushed.keys() and all(torch.equal(held[k], pushed[k]) for k in held)
            batch = rank.acquire([name])
            try:
                layout = rank.cache.layout_of(name, done.version)
                staged = torch.empty(layout.numel, dtype=layout.dtype)
                read_shard(spec, layout, staged)
                resident = rank.cache.shard(batch.slots[0]).cpu()
                assert torch.equal(resident[:layout.numel], staged), f"step {step}: the slot is not the copy's slices"
            finally:
                rank.release(batch)
        assert rank.control.stats()["pushed_copied"] == 6
        # older versions no request holds retire from the controller's area, and then from this machine's copy
        waiting.wait_for(lambda: "1" not in kept() and "6" in kept(), f"version 1 dropped here ({kept()})", timeout=60)
        ray.get(service.controller.unregister_adapter.remote(name), timeout=60)
        waiting.wait_for(lambda: not kept(), f"no copy left after the unregistration ({kept()})", timeout=30)
    finally:
        rank.detach()
