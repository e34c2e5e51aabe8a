"""Pushes from a trainer's memory on a real local Ray cluster (issue 44 item 2): one replica at TP 2, its two ranks
each loading only its own shard of what was pushed, over the gRPC gateway's ``PushAdapter`` stream and over a Ray
object reference; a refused push, a stream cut short and a reused tag leave the current version serving, and
versions the catalog no longer keeps leave node memory."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ray = pytest.importorskip("ray")

import grpc  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load  # noqa: E402

from bench.version_check import check_steps  # noqa: E402
from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, read_adapter  # noqa: E402
from lora_cache.adapters.serialize import image_and_head  # noqa: E402
from lora_cache.adapters.shapes import SHAPES  # noqa: E402
from lora_cache.adapters.shards import shard_layout  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.api import client_values as msg  # noqa: E402
from lora_cache.api.client import ClientError, LoraCacheClient  # noqa: E402
from lora_cache.api.client_values import push_config  # noqa: E402
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.errors import (  # noqa: E402
    AdapterFormatError,
    ConflictError,
    NonFiniteWeightsError,
    NotFoundError,
)
from lora_cache.integrations.device_push import DevicePusher  # noqa: E402
from lora_cache.integrations.ray_push import push_in_ray  # noqa: E402
from lora_cache.link.bell import Bell, ring_all  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.vocab import WorkerId  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.engine import EngineConfig, Request  # noqa: E402
from workers.engine.rank import slot_digest  # noqa: E402
from workers.reads.shard import read_shard  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
TOKEN = "push-token"
SERVICE = "lora-cache"  # the namespace the cluster runs in: the push area's service directory
# older versions kept past those in use: 1, the tightest bound a trainer would set. A version pushed over stays
# loadable for the requests admitted on it while a rank holds it, however many are pushed after it (by use)
KEEP = 1
LAND_S = 8.0  # a device push not landed this long is given up (its test waits for that)


class World(NamedTuple):
    root: Path  # the adapters registered at start
    service: Any
    client: LoraCacheClient
    target: str
    area: Path  # this service's push area
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=2, rank="8"))
    src = root / "adapter-001"
    tensors = load((src / WEIGHTS_FILE).read_bytes())
    config = json.loads((src / CONFIG_FILE).read_text())
    push_dir = tmp_path_factory.mktemp("push")
    init_local(num_cpus=2, namespace=SERVICE, include_dashboard=False, log_to_driver=False)
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=1, tp=2),
                    CatalogConfig(model="tiny", max_rank=16, keep_versions=KEEP, push_dir=str(push_dir),
                                  push_land_s=LAND_S),
                    PlannerConfig(), WorkerConfig(num_slots=4, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        gw = start_gateway_thread(GatewayConfig(grpc_port=0, token=TOKEN), svc.controller)
        client = LoraCacheClient(gw.target, token=TOKEN, timeout_s=60)
        yield World(root, svc, client, gw.target, push_dir / SERVICE, tensors, config)
        client.close()
        gw.stop()
        svc.stop()
    finally:
        ray.shutdown()


def wait_until(done: Any, what: str, timeout_s: float) -> None:
    """Until ``done()`` (the controller's health rounds act on their own clock), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def scaled(tensors: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: (v.float() * by).to(v.dtype) for k, v in tensors.items()}


def current(world: World, name: str) -> str:
    return str(ray.get(world.service.controller.lookup_adapter.remote(name), timeout=30)["version"])


def served_on_every_rank(world: World, name: str, pushed: dict[str, torch.Tensor], version: str) -> None:
    """Each rank loads ``name`` (its current version, ``version``) and holds exactly its own shard of the
    pushed tensors: the slot's bytes equal its slices of the version's file, and that file's tensors equal what
    the trainer pushed; each rank's shard is a part of the adapter, not all of it."""
    spec_dir = next(p for p in world.area.glob(f"{name}/*") if (p / WEIGHTS_FILE).is_file()
                    and _same(load((p / WEIGHTS_FILE).read_bytes()), pushed))
    total = sum(t.numel() * t.element_size() for t in pushed.values())
    ranks = []
    for handle in world.service.workers.values():
        (record,) = ray.get(handle.preload.remote([name]), timeout=60)
        assert record.version == version
        check = ray.get(handle.verify.remote(name, version), timeout=60)
        assert check["max_abs_diff"] == 0.0, check
        assert 0 < check["nbytes"] < total, (check, total)  # its shard only
        ranks.append(check["rank"])
    assert sorted(ranks) == [0, 1] and spec_dir.parent.name == name


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hashed(world: World) -> list[int]:
    return [ray.get(h.stats.remote())["registrations_hashed"] for h in world.service.workers.values()]


def test_a_push_over_grpc_serves_on_both_ranks_and_a_new_one_replaces_it(world: World) -> None:
    before = hashed(world)
    first = world.client.push("trained", world.tensors, world.config, tag=1)
    assert hashed(world) == before  # each rank took the controller's version on its proof: no second hash
    assert (first.name, first.tag, first.previous_version) == ("trained", "1", "")
    assert current(world, "trained") == first.version
    served_on_every_rank(world, "trained", world.tensors, first.version)

    second_tensors = scaled(world.tensors, 2.0)
    second = world.client.push("trained", second_tensors, world.config, tag=2)
    assert second.previous_version == first.version != second.version
    served_on_every_rank(world, "trained", second_tensors, second.version)
    assert world.client.push("trained", second_tensors, world.config, tag=2).version == second.version  # again


def test_the_asyncio_client_pushes_the_same_wire_form(world: World) -> None:
    """``AsyncLoraCacheClient.push`` sends the push on the wire as the sync client does (``push_wire``, through
    ``push_call`` on an asyncio channel): the version serves on both ranks, each its own shard."""
    import asyncio

    from lora_cache.api.client import AsyncLoraCacheClient

    tensors = scaled(world.tensors, 7.0)

    async def push() -> Any:
        client = AsyncLoraCacheClient(world.target, token=TOKEN, timeout_s=60)
        try:
            return await client.push("async-trained", tensors, world.config, tag="a1")
        finally:
            await client.close()

    done = asyncio.run(push())
    assert (done.name, done.tag) == ("async-trained", "a1") and current(world, "async-trained") == done.version
    served_on_every_rank(world, "async-trained", tensors, done.version)


def test_a_refused_a_cut_and_a_conflicting_push_leave_the_current_version(world: World) -> None:
    base = world.client.push("steady", world.tensors, world.config, tag="step-1")
    before = sorted(p.name for p in (world.area / "steady").iterdir())

    bad = dict(world.tensors)
    key = next(k for k in sorted(bad) if k.endswith("lora_A.weight"))
    bad[key] = torch.zeros(bad[key].shape[0] + 1, bad[key].shape[1], dtype=bad[key].dtype)  # a rank the B's lack
    with pytest.raises(ClientError) as refused:
        world.client.push("steady", bad, world.config, tag="step-2")
    assert refused.value.code == "INVALID_ARGUMENT" and "lora_A has shape [9" in refused.value.message, refused.value

    config_bytes, weights = msg.push_payload(scaled(world.tensors, 3.0), world.config)
    messages = list(msg.push_messages("steady", "step-3", config_bytes, weights, chunk_bytes=4096))
    with grpc.insecure_channel(world.target) as channel:  # a trainer that dies after the first half
        stub = pb_grpc.LoraCacheServiceStub(channel)
        with pytest.raises(grpc.RpcError) as cut:
            next(iter(stub.PushAdapter(iter(messages[: len(messages) // 2]),
                                       metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)))
    assert cut.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended after" in cut.value.details()

    with pytest.raises(ClientError) as conflict:  # the tag already names other bytes
        world.client.push("steady", scaled(world.tensors, 5.0), world.config, tag="step-1")
    assert conflict.value.code == "FAILED_PRECONDITION" and "new tag" in conflict.value.message

    assert current(world, "steady") == base.version
    assert sorted(p.name for p in (world.area / "steady").iterdir()) == before
    served_on_every_rank(world, "steady", world.tensors, base.version)


def held_by_ranks(world: World, name: str) -> set[str]:
    """The versions of ``name`` some rank holds (a slot in any state), as the ranks describe themselves."""
    return {str(v) for h in world.service.workers.values() for a, v, *_ in ray.get(h.describe.remote())["residency"]
            if a == name}


def test_a_push_by_ray_reference_and_older_versions_retire(world: World) -> None:
    """Pushed versions retire by use past ``keep_versions``: a version some rank holds stays in node memory,
    and once no rank does (the planner evicts what nothing asks for) only the current one and the ``KEEP``
    newest older ones are left."""
    versions = []
    steps = list(range(10, 13 + KEEP))
    for step in steps:
        tensors = scaled(world.tensors, 1.0 + step / 10)
        done = push_in_ray("by-ref", tensors, world.config, tag=step)
        versions.append(done.version)
        served_on_every_rank(world, "by-ref", tensors, done.version)
        kept = {int(p.name) for p in (world.area / "by-ref").iterdir()}
        held = {steps[versions.index(v)] for v in held_by_ranks(world, "by-ref") if v in versions}
        assert step in kept and held <= kept, f"a version a rank holds left node memory: {held - kept}"
    wait_until(lambda: sorted(int(p.name) for p in (world.area / "by-ref").iterdir()) == steps[-1 - KEEP:],
               "the older versions no rank holds retired", 60)
    ray.get(world.service.controller.unregister_adapter.remote("by-ref"), timeout=60)
    assert not (world.area / "by-ref").exists()


def test_a_lookup_and_a_route_name_a_pushed_version_by_its_tag_or_its_version(world: World) -> None:
    """Issue 44 item 3: ``Lookup("NAME@TAG")`` answers for the version pushed under that tag (where it is READY or
    loading), as ``NAME@VERSION`` does; a tag no longer kept is NOT_FOUND naming those kept, a malformed one
    INVALID_ARGUMENT. ``Route`` ranks each item by where the version it names is."""
    name, versions = "tagged", {}
    for step in (30, 31):
        tensors = scaled(world.tensors, 1.0 + step / 10)
        versions[step] = world.client.push(name, tensors, world.config, tag=step).version
    served_on_every_rank(world, name, tensors, versions[31])
    wait_until(lambda: "replica-0" in world.client.lookup(f"{name}@31").ready, f"{name}@31 READY on replica-0", 30)
    assert world.client.lookup(f"{name}@31").version == versions[31] == world.client.lookup(name).version
    old = world.client.lookup(f"{name}@30")
    assert old.version == versions[30] and old == world.client.lookup(f"{name}@{versions[30]}")._replace(
        adapter=f"{name}@30")
    assert "replica-0" not in old.ready, "only the current version was loaded"
    with pytest.raises(ClientError) as e:
        world.client.lookup(f"{name}@29")
    assert e.value.code == "NOT_FOUND" and "tags ['30', '31']" in str(e.value)
    with pytest.raises(ClientError) as e:
        world.client.lookup(f"{name}@")
    assert e.value.code == "INVALID_ARGUMENT"
    # Route takes the same references: each item is ranked by where its own version is (the current one READY on
    # replica-0, the older one nowhere), and a bad reference fails alone
    routed = world.client.route([f"{name}@31", f"{name}@30", (name, versions[30]), f"{name}@29",
                                 (f"{name}@30", versions[30]), name])
    assert [(r.adapter, r.version, r.error is None) for r in routed] == [
        (name, versions[31], True), (name, versions[30], True), (name, versions[30], True),
        (f"{name}@29", "", False), (f"{name}@30", versions[30], False), (name, versions[31], True)]
    reasons = {r.replica: r.reason for r in routed[0].replicas}
    assert reasons["replica-0"] == "ready" and {r.replica: r.reason for r in routed[1].replicas}["replica-0"] != "ready"
    assert routed[3].error.code == "NOT_FOUND" and "tags ['30', '31']" in routed[3].error.message
    assert routed[4].error.code == "INVALID_ARGUMENT" and "names a version twice" in routed[4].error.message
    # a hint naming the older version has it prefetched there (and kept while the hint is active); one naming a
    # version not kept is rejected alone
    taken = world.client.hint([(f"old-{name}", f"{name}@30", "replica-0"), (f"gone-{name}", f"{name}@29", "replica-0")])
    assert taken.accepted == 1 and [r.index for r in taken.rejections] == [1], taken
    wait_until(lambda: "replica-0" in world.client.lookup(f"{name}@30").ready, f"{name}@30 prefetched by its hint", 30)
    (again,) = world.client.route([f"{name}@30"])
    assert {r.replica: r.reason for r in again.replicas}["replica-0"] == "ready"
    # the readiness stream filtered on one version: only that version's events (the current one's were READY too)
    from lora_cache.api.client_values import ReadinessEvent, Resync

    seen: list[ReadinessEvent] = []
    for event in world.client.watch(adapter=f"{name}@30", after_seq=0, duration_s=30):
        if isinstance(event, Resync):
            assert all(k[2] == versions[30] for k in event.ready if k[1] == name), event
            continue
        seen.append(event)
        if event.ready and event.replica == "replica-0":
            break
    assert seen and all(e.adapter == name and e.version == versions[30] for e in seen), seen
    with pytest.raises(ClientError) as gone:
        next(iter(world.client.watch(adapter=f"{name}@29", duration_s=5)))
    assert gone.value.code == "NOT_FOUND"
    ray.get(world.service.controller.unregister_adapter.remote(name), timeout=60)


def test_each_rank_takes_its_shard_from_a_trainers_open_image(world: World) -> None:
    """Issue 44 item 5, the ranks' side of a device push (``WorkerActor.open_image`` / ``load_image``), each step by
    hand: the version registered device-only (``push_device``: no rank may load it but from an image, and the planner
    commands no load of it, so what each rank does here is only what the trainer asks); each rank opens the trainer's
    buffer once (on the CPU the image travels by value; on a GPU by CUDA IPC) and a push then names it; each rank's
    slot holds exactly its own shard (checked against the file once landed), with no host read. A buffer not open, or
    an image with a NaN, is refused on every rank and loads nothing. The next version comes by each rank's doorbell (a
    UNIX socket on the node, no Ray call) and is proven the same way."""
    ctl, config = world.service.controller, push_config(world.config)
    ranks = list(world.service.workers.values())

    def declared(scale: float, tag: int) -> tuple[str, torch.Tensor, bytes]:
        image, head = image_and_head(scaled(world.tensors, scale), {"format": "pt"})
        pushed = ray.get(ctl.push_device.remote("imaged", tag, config, head, image.numel()), timeout=30)
        return pushed.version, image, head

    version, image, head = declared(1.7, 1)
    bad = image.clone()
    bad[len(head):].view(torch.int16).fill_(0x7FC0)  # every weight a bf16 NaN (each rank proves its own slice)
    before = [ray.get(h.stats.remote(), timeout=30) for h in ranks]
    assert not any(r[0] == "imaged" for h in ranks for r in ray.get(h.describe.remote())["residency"])
    with pytest.raises(NotFoundError, match="not open on this rank"):
        ray.get(ranks[0].load_image.remote("imaged", version, "trainer-0", head), timeout=30)
    assert ray.get([h.open_image.remote("nan", bad) for h in ranks]) == [image.numel()] * 2
    for h in ranks:
        with pytest.raises(NonFiniteWeightsError):
            ray.get(h.load_image.remote("imaged", version, "nan", head), timeout=60)
    assert ray.get([h.open_image.remote("trainer-0", image) for h in ranks]) == [image.numel()] * 2
    records = ray.get([h.load_image.remote("imaged", version, "trainer-0", head) for h in ranks], timeout=60)
    assert sorted(r.tp_rank for r in records) == [0, 1] and {r.version for r in records} == {version}
    after = [ray.get(h.stats.remote(), timeout=30) for h in ranks]  # before it lands (then the planner may stage it)
    for h in ranks:  # nothing of it in the host tier: no host read of its file (the counters are every adapter's)
        assert ["imaged", version] not in [list(k) for k in ray.get(h.describe.remote(), timeout=30)["host"]]
    ray.get(ctl.land_device.remote("imaged", version, config, image.numpy()), timeout=60)  # checked against its file
    total = image.numel() - len(head)
    for h, was, now in zip(ranks, before, after, strict=True):
        check = ray.get(h.verify.remote("imaged", version), timeout=60)
        assert check["max_abs_diff"] == 0.0 and 0 < check["nbytes"] < total, check
        assert now["image_loads"] - was["image_loads"] == 2 and now["load_failures"] - was["load_failures"] == 1
        assert now["bytes_from_images"] - was["bytes_from_images"] == check["nbytes"]
    # the next version by the doorbell (no Ray call on the push's path): the same proof, its own slots
    second, image, head = declared(1.9, 2)
    assert ray.get([h.open_image.remote("trainer-0", image, None, head) for h in ranks])
    bells = [Bell(path) for path in ray.get([h.open_doorbell.remote() for h in ranks])]
    answers = ring_all(bells, [{"buffer": "trainer-0", "name": "imaged", "version": second}] * 2)
    assert sorted(a["record"]["tp_rank"] for a in answers) == [0, 1]
    assert {a["record"]["version"] for a in answers} == {second}
    ray.get(ctl.land_device.remote("imaged", second, config, image.numpy()), timeout=60)
    for h in ranks:
        assert ray.get(h.verify.remote("imaged", second), timeout=60)["max_abs_diff"] == 0.0
    with pytest.raises(NotFoundError, match="not open on this rank"):
        bells[0].ring({"buffer": "closed", "name": "imaged", "version": second})
    for bell in bells:
        bell.close()
    assert ray.get([h.close_image.remote(b) for h in ranks for b in ("trainer-0", "nan")]) == [True] * 4
    ray.get(world.service.controller.unregister_adapter.remote("imaged"), timeout=60)


def test_a_push_of_unknown_name_syntax_or_tag_is_refused_before_anything_is_kept(world: World) -> None:
    for name, tag, fragment in (("bad name", 1, "name"), ("ok", "../x", "tag")):
        with pytest.raises(ClientError) as e:
            world.client.push(name, world.tensors, world.config, tag=tag)
        assert e.value.code == "INVALID_ARGUMENT" and fragment in e.value.message.lower()
    assert not (world.area / "ok").exists()


def expected_digest(directory: Path, name: str, rank: int) -> str:
    """The digest of rank ``rank``'s shard of the version in ``directory`` (a push area directory, or the root's)."""
    spec = read_adapter(name, directory, SHAPES["tiny"], 16)
    layout = shard_layout(spec, SHAPES["tiny"], 2, rank, torch.bfloat16)  # the workers' slot dtype (WorkerConfig)
    staged = torch.empty(layout.numel, dtype=layout.dtype)
    read_shard(spec, layout, staged)
    return slot_digest(staged)


def test_pushes_under_traffic_keep_one_version_per_step_on_every_rank(world: World, tmp_path: Path) -> None:
    """Invariant 1 while a trainer pushes: a hosted TP-2 engine serves a stream of requests for ``live`` while new
    versions are pushed under it (alternately over gRPC and by Ray reference). Every request is served; both ranks
    computed each item with the same version, the one its request was admitted with; and each slot held exactly
    that version's bytes (a digest of the rank's shard of what the trainer pushed, from the test's own copy: the
    push area retires versions past ``keep_versions`` meanwhile)."""
    hot = "live"
    ranks = [world.service.workers[WorkerId("replica-0", k)] for k in (0, 1)]
    copies: dict[str, Path] = {}  # version -> the test's copy of what was pushed

    def push(step: int) -> None:
        tensors = scaled(world.tensors, 1.0 + step / 10)
        done = (world.client.push(hot, tensors, world.config, tag=step) if step % 2 == 0
                else push_in_ray(hot, tensors, world.config, tag=step))
        assert done.version not in copies
        copies[done.version] = tmp_path / str(step)
        copies[done.version].mkdir()
        config_bytes, weights = msg.push_payload(tensors, world.config)
        (copies[done.version] / CONFIG_FILE).write_bytes(config_bytes)
        (copies[done.version] / WEIGHTS_FILE).write_bytes(weights)

    push(0)
    engine = EngineConfig(adapters=str(world.root), model="tiny", device="cpu", tp=2, num_slots=4, max_adapters=2,
                          max_running=4, max_prefill_tokens=24, max_seq_len=32, max_rank=16, audit_steps=True,
                          host=HostTierConfig(host_bytes=1 << 22, pin=False))
    meet = ray.get(ranks[0].engine_rendezvous.remote(2), timeout=60)
    ray.get([h.engine_build.remote(engine, meet) for h in ranks], timeout=300)
    requests = [Request(i, hot if i % 3 else "adapter-000", 3 + i % 4, 2 + i % 3, 0.04 * i) for i in range(90)]
    start_wall = time.time() + 1.0
    runs = [ranks[0].engine_run.remote(requests, start_wall, 0, True), ranks[1].engine_run.remote(requests, start_wall)]
    step = 0
    while ray.wait(runs, num_returns=2, timeout=0.0)[1]:  # push while the engine serves
        step += 1
        push(step)
        ray.wait(runs, num_returns=2, timeout=0.5)  # pacing only: every check below is per step
    result = ray.get(runs[0])
    assert step >= 3, "the run ended before the adapter was pushed under it"
    checked, served = check_steps(result.records, [stats.audit for stats in result.ranks], hot,
                                  lambda name, v: copies[v] if name == hot else world.root / name, expected_digest)
    print(f"{step} pushes under traffic, {checked} slot digests checked, versions served {served}")
    assert ray.get(world.service.controller.check_integrity.remote())


def test_the_hosted_engine_serves_a_request_at_the_version_it_names(world: World) -> None:
    """Issue 44 item 3 on the reference engine: a streaming run takes requests naming a pushed version by its tag
    (``A@40``) or by its version, beside requests naming the adapter alone (the newest READY everywhere); each runs
    on both ranks at exactly the version it named. A tag no longer kept, or a malformed one, refuses its whole
    submit, naming the request, and the run goes on."""
    name, versions = "named", {}
    for step in (39, 40, 41, 42):
        versions[step] = world.client.push(name, scaled(world.tensors, 1.0 + step / 10), world.config,
                                           tag=step).version
    ranks = [world.service.workers[WorkerId("replica-0", k)] for k in (0, 1)]
    engine = EngineConfig(adapters=str(world.root), model="tiny", device="cpu", tp=2, num_slots=4, max_adapters=2,
                          max_running=4, max_prefill_tokens=24, max_seq_len=32, max_rank=16, audit_steps=True,
                          host=HostTierConfig(host_bytes=1 << 22, pin=False))
    meet = ray.get(ranks[0].engine_rendezvous.remote(2), timeout=60)
    ray.get([h.engine_build.remote(engine, meet) for h in ranks], timeout=300)
    start_wall = time.time()
    runs = [ranks[0].engine_run.remote([], start_wall, 0, True, True), ranks[1].engine_run.remote([], start_wall)]
    wanted = {0: (name, versions[42]), 1: (f"{name}@41", versions[41]), 2: (f"{name}@{versions[42]}", versions[42]),
              3: (f"{name}@41", versions[41]), 4: (name, versions[42])}
    ray.get(ranks[0].engine_submit.remote([Request(rid, a, 3, 2) for rid, (a, _) in wanted.items()]), timeout=60)
    with pytest.raises(NotFoundError, match=r"request 5 \(nothing of this call was submitted\).*no version or pushed"):
        ray.get(ranks[0].engine_submit.remote([Request(5, f"{name}@39", 3, 1), Request(6, name, 3, 1)]), timeout=60)
    with pytest.raises(AdapterFormatError, match="request 7"):
        ray.get(ranks[0].engine_submit.remote([Request(7, f"{name}@../x", 3, 1)]), timeout=60)
    ray.get(ranks[0].engine_end_stream.remote(), timeout=60)
    result = ray.get(runs[0], timeout=300)
    ray.get(runs[1], timeout=60)
    records = {r.rid: r for r in result.records}
    assert sorted(records) == sorted(wanted), "a refused submit's request ran, or an accepted one did not"
    for rid, (_, version) in wanted.items():
        assert records[rid].ok and records[rid].version == version, records[rid]
        for rank in result.ranks:  # both ranks computed it at exactly that version, never another
            keys = {key for audit in rank.audit for r, key in zip(audit.rids, audit.keys) if r == rid}
            assert keys == {f"{name}@{version}"}, (rank.rank, rid, keys)
    ray.get(world.service.controller.unregister_adapter.remote(name), timeout=60)


def _status_or_none(ctl: Any) -> dict[str, Any] | None:
    try:
        return dict(ray.get(ctl.status.remote(), timeout=5))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        return None


def test_a_device_push_is_ready_on_both_ranks_from_the_buffer_then_lands_under_its_id(world: World) -> None:
    """Issue 44 item 5 end to end (``DevicePusher``; on the CPU the image travels by value): the version is
    registered from the trainer's declaration alone, both ranks of the TP 2 replica take their shards from the
    trainer's buffer by their doorbells (no host read), and its node copy then lands under the same id: each rank's
    slot equals its slices of that file, whose tensors are the trainer's. The next step replaces it, registered ahead
    while the trainer trained (``reserve_device``: the push is the doorbells and the commit); where the controller
    gave that one up meanwhile, the push registers itself again. A tag used already, or tensors of the wrong shapes,
    are refused before anything changes."""
    ranks = list(world.service.workers.values())
    before = [ray.get(h.stats.remote(), timeout=30) for h in ranks]
    pusher = DevicePusher("devpush", world.config)
    try:
        for step, scale in ((1, 1.3), (2, 1.6)):
            tensors = scaled(world.tensors, scale)
            pushed = pusher.push(tensors, tag=step)
            assert ("commit" in pushed.split_s) == (step == 2), pushed.split_s  # step 2 registered ahead
            assert sorted(r["tp_rank"] for r in pushed.records) == [0, 1]
            assert {r["version"] for r in pushed.records} == {pushed.version} and pushed.tag == str(step)
            assert current(world, "devpush") == pushed.version
            wait_until(lambda ref=f"devpush@{step}": ray.get(world.service.controller.lookup_adapter.remote(ref),
                                                              timeout=30)["ready"] == ["replica-0"],
                       "the controller believes the replica READY on the pushed version", 30)
            landed = ray.get(pushed.landing, timeout=60)
            assert (landed.version, landed.tag) == (pushed.version, str(step)) and landed.content != pushed.version
            assert _same(load((world.area / "devpush" / str(step) / WEIGHTS_FILE).read_bytes()), tensors)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            for h in ranks:
                check = ray.get(h.verify.remote("devpush", pushed.version), timeout=60)  # against the landed file
                assert check["max_abs_diff"] == 0.0 and 0 < check["nbytes"] < total, check
        assert pusher._next is not None
        ahead = pusher._next[1].result(timeout=30).version  # step 3's, registered ahead: given up behind its back
        assert ray.get(world.service.controller.withdraw_device.remote("devpush", ahead), timeout=30)
        third = pusher.push(scaled(world.tensors, 1.8), tag=3)
        assert third.version != ahead and "commit" not in third.split_s and current(world, "devpush") == third.version
        assert third.previous == pushed.version
        ray.get(third.landing, timeout=60)
        for h in ranks:
            check = ray.get(h.verify.remote("devpush", third.version), timeout=60)
            assert check["max_abs_diff"] == 0.0, check
        pushed = third
        with pytest.raises(ConflictError, match="tagged '3' already"):
            pusher.push(scaled(world.tensors, 1.9), tag=3)
        poisoned = scaled(world.tensors, 1.7)
        first = next(iter(poisoned))
        poisoned[first].view(-1)[0] = float("nan")
        with pytest.raises(NonFiniteWeightsError):  # a rank refuses it: withdrawn at once, the step before current
            pusher.push(poisoned, tag=5)
        assert current(world, "devpush") == pushed.version
        wrong = dict(world.tensors)
        key = next(k for k in wrong if "lora_B" in k)
        wrong[key] = torch.cat([wrong[key], wrong[key]])
        with pytest.raises(AdapterFormatError, match=key.rsplit(".lora_B", 1)[0].rsplit(".", 1)[-1]):
            pusher.push(wrong, tag=6)
        assert current(world, "devpush") == pushed.version
        for h, was in zip(ranks, before, strict=True):  # steps 1 and 2, 3 twice (given up, then again), the NaN
            now = ray.get(h.stats.remote(), timeout=30)
            assert now["image_loads"] - was["image_loads"] == 5, "a rank did not take each step from the buffer"
        with pytest.raises(NotFoundError, match="waiting for its node copy"):
            ray.get(world.service.controller.land_device.remote("devpush", pushed.version, b"{}", b""), timeout=30)
    finally:
        pusher.close()
    ray.get(world.service.controller.unregister_adapter.remote("devpush"), timeout=60)


def test_a_device_push_never_landed_gives_way_to_the_version_before_it(world: World) -> None:
    """A trainer that dies after its push registered (before any rank took it, or before its node copy) leaves a
    version no rank can read: after ``push_land_s`` the version before it is current again on the controller and on
    both ranks, served from its own file, and the late landing is refused by name."""
    base = push_in_ray("devgone", world.tensors, world.config, tag=0).version
    tensors = scaled(world.tensors, 2.2)
    image, head = image_and_head(tensors, {"format": "pt"})
    ctl = world.service.controller
    config = push_config(world.config)
    dead = ray.get(ctl.push_device.remote("devgone", 1, config, head, image.numel()), timeout=30)
    assert dead.previous == base and current(world, "devgone") == dead.version
    for h in world.service.workers.values():  # no rank can load it: nothing reads a file that is not there
        with pytest.raises(ConflictError, match="node copy has not landed"):
            ray.get(h.preload.remote(["devgone"]), timeout=60)
    wait_until(lambda: current(world, "devgone") == base, "the version before the dead push current again",
               LAND_S + 30)
    served_on_every_rank(world, "devgone", world.tensors, base)
    with pytest.raises(NotFoundError, match="given up"):
        ray.get(ctl.land_device.remote("devgone", dead.version, config, image.numpy()), timeout=30)
    ray.get(ctl.unregister_adapter.remote("devgone"), timeout=60)


def test_a_restarted_controller_keeps_a_pushed_version_and_takes_new_pushes(world: World) -> None:
    """Last in the module (it restarts the controller): the pushed version outlives the controller's process (its
    files are in node memory, its registration in the durable catalog), is still the current one and served from
    its own bytes on both ranks; a push after the restart is taken as before."""
    pushed = world.client.push("durable", world.tensors, world.config, tag=1)
    ctl = world.service.controller
    epoch = int(ray.get(ctl.status.remote(), timeout=30)["epoch"])
    seen: list[dict[str, Any]] = []
    ray.kill(ctl, no_restart=False)  # asynchronous: the old process may still answer the first calls
    deadline = time.monotonic() + 60
    while not (seen and seen[-1].get("epoch", epoch) > epoch):
        assert time.monotonic() < deadline, "the controller did not restart with a larger epoch"
        seen.append(_status_or_none(ctl) or {})
        time.sleep(0.2)
    assert current(world, "durable") == pushed.version
    served_on_every_rank(world, "durable", world.tensors, pushed.version)
    again = world.client.push("durable", scaled(world.tensors, 2.0), world.config, tag=2)
    assert again.previous_version == pushed.version
    served_on_every_rank(world, "durable", scaled(world.tensors, 2.0), again.version)
