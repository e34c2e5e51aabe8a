"""Versions through the attached path (the public seam) on a local Ray (CPU): invariant 1 under change.

Two engine processes of their own attach as ranks 0 and 1 of a replica (``workers/attach/attachment.py``: the
``Attachment`` an integrator's engine gets, ``workers/attach/seam.py`` ``EngineCache``) and run the reference engine
(TP 2 over gloo) on a stream of requests while the adapter is re-registered again and again through the
controller. Every step, both ranks computed each item with the same version, the one its request was
admitted with, and the slot held exactly that version's bytes: ``tests/test_ray_versions.py``'s checks, for the
engine that runs on the attachment rather than inside a worker actor.
"""

from __future__ import annotations

import concurrent.futures
import itertools
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
from lora_cache.app.serve import ServeConfig, Service, start  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.runtime.ports import free_port  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from workers.attach.attachment import AttachConfig  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.hosted import Rendezvous  # noqa: E402
from workers.engine.process import start_ranks  # noqa: E402
from workers.engine.rank import slot_digest  # noqa: E402
from workers.engine.workload import Request  # noqa: E402
from workers.reads.shard import read_shard  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

TINY = SHAPES["tiny"]
HOT = "adapter-000"  # re-registered under traffic
VERSIONS = 4
HOST = HostTierConfig(host_bytes=1 << 22, pin=False)
CYCLE = itertools.count()  # HOT's versions in turn over the module: each registration differs from the last


class Fleet(NamedTuple):
    svc: Service
    gcs: str  # the cluster's address, for the engine processes
    root: Path  # the adapters registered at start (by directory name)
    versions: Path  # HOT's other versions, each in its own directory


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    root: Path = tmp_path_factory.mktemp("adapters")
    versions: Path = tmp_path_factory.mktemp("versions")  # not under root: not registered at start
    make_adapters(root, SynthConfig(model="tiny", count=4, rank="8,16"))
    for v in range(VERSIONS):
        write_adapter(
            versions / f"{HOT}-v{v}",
            TINY,
            16 if v % 2 else 8,
            16.0,
            list(MODULE_ORDER),
            torch.float32,
            torch.Generator().manual_seed(1000 + v),
        )
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False)
    try:
        svc = start(
            ServeConfig(adapters=str(root), replicas=0),
            CatalogConfig(adapter_roots=(str(root), str(versions)), model="tiny", max_rank=16),
            PlannerConfig(policy="global"),
            WorkerConfig(num_slots=3, host=HOST),
        )
        try:
            yield Fleet(svc, ray.get_runtime_context().gcs_address, root, versions)
        finally:
            svc.stop()
    finally:
        ray.shutdown()


def expected_digest(directory: Path, name: str, rank: int) -> str:
    spec = read_adapter(name, directory, TINY, 16)
    layout = shard_layout(spec, TINY, 2, rank, torch.float32)  # the attached ranks' slot dtype
    staged = torch.empty(layout.numel, dtype=layout.dtype)
    read_shard(spec, layout, staged)
    return slot_digest(staged)


@pytest.mark.parametrize("admission", ["ondemand", "overlap"])
def test_reregistration_under_traffic_through_the_attached_path(fleet: Fleet, admission: str) -> None:
    ctl, replica = fleet.svc.controller, f"attached-{admission}"

    def config(rank: int) -> AttachConfig:
        return AttachConfig(replica=replica, address=fleet.gcs, poll_s=0.5, liveness_s=10.0)

    def worker(rank: int) -> WorkerConfig:
        return WorkerConfig(num_slots=3, tp=2, tp_rank=rank, device="cpu", dtype="float32", host=HOST)

    # version -> its directory, as the controller registered it (an identity version names its file, so equal
    # bytes in two directories are two versions): the one current now, then each registration's
    current = ray.get(ctl.__ray_call__.remote(lambda self: self.core.paths.get(HOT, "")), timeout=30)
    dirs: dict[str, Path] = {}
    ranks = start_ranks(config, [worker(0), worker(1)])
    try:
        engine = EngineConfig(
            model="tiny",
            device="cpu",
            dtype="float32",
            tp=2,
            num_slots=3,
            max_adapters=2,
            max_running=4,
            max_prefill_tokens=24,
            max_seq_len=32,
            max_rank=16,
            admission=admission,
            audit_steps=True,
            host=HOST,
        )
        meet = Rendezvous("127.0.0.1", free_port(), 2)
        for f in [p.submit("build", engine, meet) for p in ranks]:
            f.result(timeout=300)
        requests = [Request(i, HOT if i % 3 else "adapter-001", 3 + i % 4, 2 + i % 3, 0.04 * i) for i in range(90)]
        start_wall = time.time() + 1.0
        runs = [ranks[0].submit("run", requests, start_wall, 0, True), ranks[1].submit("run", requests, start_wall)]
        registered = 0
        while not all(r.done() for r in runs):  # re-register while the engine serves
            path = fleet.versions / f"{HOT}-v{next(CYCLE) % VERSIONS}"
            version, previous = ray.get(ctl.register_adapter_info.remote(HOT, str(path)))
            assert version != previous
            dirs.setdefault(previous, Path(current) if current else fleet.root / HOT)
            dirs[version] = path
            current = str(path)
            registered += 1
            concurrent.futures.wait(runs, timeout=0.3)  # pacing only: every check below is per step
        results = [r.result(timeout=60) for r in runs]
        assert registered >= 3, "the run ended before the adapter was re-registered under it"

        records = results[0].records
        assert sorted(r.rid for r in records) == list(range(len(requests)))
        audits = [stats.audit for stats in results[0].ranks]  # gathered from both ranks by rank 0
        checked, served = check_steps(
            records, audits, HOT, lambda name, v: dirs[v] if name == HOT else fleet.root / name, expected_digest
        )
        print(
            f"attached, {admission}: {registered} re-registrations under traffic, {len(audits[0])} steps on 2 "
            f"ranks, {checked} slot digests checked, versions served {served}"
        )
        assert ray.get(ctl.check_integrity.remote())
    finally:
        for proc in ranks:
            proc.close()
