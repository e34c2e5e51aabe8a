"""Registration on a real Ray controller (issue 29, items 1-3): the controller answers while it reads an
adapter, a batch's versions reach the workers with their proof (a worker on this machine does not hash
them again), and a large registration does not hold ``status`` up.

One module-scoped local cluster. The adapters are made before it starts and registered once their racy
window (``RACY_NS`` after their last change) has passed, as files on a server are.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.files import RACY_NS  # noqa: E402
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, register_directory, start  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run inside the controller
BIG = 4  # 8B-shaped adapters (84 MB each, one file linked four times) hashed in one batch


class World(NamedTuple):
    root: Path
    service: Any


def settle(root: Path) -> None:
    """Wait out the racy window of every file under ``root`` (a physical window, not a race with a thread)."""
    newest = max(p.stat().st_ctime_ns for p in root.rglob("*") if p.is_file())
    wait_for(lambda: time.time_ns() - newest >= RACY_NS, "the files' racy window", timeout=10, poll_s=0.1)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("adapters")
    make_adapters(root / "small", SynthConfig(model="llama-3.1-8b", count=6, rank="1", targets="q_proj"))
    big = make_adapters(root / "big", SynthConfig(model="llama-3.1-8b", count=1, rank="16", prefix="big"))[0]
    for i in range(1, BIG):  # the same file under other names: each one is hashed by itself
        (root / "big" / f"big-{i:03d}").mkdir()
        (root / "big" / f"big-{i:03d}" / CONFIG_FILE).write_bytes((big / CONFIG_FILE).read_bytes())
        os.symlink(big / WEIGHTS_FILE, root / "big" / f"big-{i:03d}" / WEIGHTS_FILE)
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    try:
        settle(root)
        svc = start(ServeConfig(adapters=str(root / "small"), replicas=1, tp=2),
                    # content versions: every registration hashes its file (the case where a Status could wait
                    # behind it); identity versions read no weights at registration (tests/test_identity_versions.py)
                    CatalogConfig(adapter_roots=(str(root),), model="llama-3.1-8b", max_rank=16,
                                  local_versions="content"),
                    PlannerConfig(), WorkerConfig(num_slots=1, host=HostTierConfig(host_bytes=1 << 28, pin=False)))
        yield World(root, svc)
        svc.stop()
    finally:
        ray.shutdown()


def _hold_reads(self: Any, name: str) -> None:
    """In the controller: the core's read of ``name`` waits at its start for ``self.release_read``."""
    self.read_held, self.release_read = threading.Event(), threading.Event()
    real = self.core.read_adapter

    def read(adapter: str, path: str, known: Any = None) -> Any:
        if adapter == name:
            self.read_held.set()
            assert self.release_read.wait(60)
        return real(adapter, path, known)

    self.core.read_adapter = read


def test_workers_take_the_controllers_versions_without_hashing(world: World) -> None:
    """The small adapters were registered by ``serve --adapters``: every rank took each version on the
    controller's proof (same machine, same file, settled), none hashed a file again."""
    for handle in world.service.workers.values():
        stats = ray.get(handle.stats.remote())
        assert (stats["registrations_taken"], stats["registrations_hashed"]) == (6, 0), stats
    versions = {name: ray.get(world.service.controller.lookup_adapter.remote(name))["version"]
                for name in (f"adapter-{i:03d}" for i in range(6))}
    for handle in world.service.workers.values():
        assert ray.get(handle.describe.remote())["adapters"].keys() == versions.keys()


def test_the_controller_answers_while_a_registration_reads(world: World) -> None:
    """The read is held inside the controller (a thread waiting on an event): status, lookups and a
    second registration of another name are answered meanwhile; the held one then completes."""
    ctl = world.service.controller
    ray.get(ctl.__ray_call__.remote(_hold_reads, "held"))
    pending = ctl.register_adapter.remote("held", str(world.root / "small" / "adapter-000"))
    wait_for(lambda: ray.get(ctl.__ray_call__.remote(lambda self: self.read_held.is_set()), timeout=10),
             "the held read started")
    for _ in range(5):
        assert ray.get(ctl.status.remote(), timeout=10)["adapters"] == 6
    other = ray.get(ctl.register_adapter.remote("other", str(world.root / "small" / "adapter-001")), timeout=30)
    assert other == ray.get(ctl.lookup_adapter.remote("adapter-001"), timeout=10)["version"]
    ready, _ = ray.wait([pending], timeout=0)
    assert not ready, "the held registration finished before its read was released"
    ray.get(ctl.__ray_call__.remote(lambda self: self.release_read.set()))
    assert ray.get(pending, timeout=30) == ray.get(ctl.lookup_adapter.remote("adapter-000"))["version"]


def test_status_is_not_held_up_by_a_large_registration(world: World) -> None:
    """Four 84 MB adapters hashed in one batch: ``status`` calls made meanwhile take a small fraction of one
    adapter's hash (on the event loop, one would wait for a whole hash); compared with status when idle."""
    ctl = world.service.controller

    def timed_status() -> float:
        t0 = time.perf_counter()
        ray.get(ctl.status.remote(), timeout=30)
        return time.perf_counter() - t0

    idle = [timed_status() for _ in range(30)]
    during: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            during.append(timed_status())

    thread = threading.Thread(target=probe, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        results = register_directory(ctl, world.root / "big")
    finally:
        done.set()
        thread.join(30)
    per_hash = (time.perf_counter() - t0) / BIG
    assert [r.error for r in results] == [None] * BIG and len({r.version for r in results}) == 1
    assert len(during) >= 3, f"only {len(during)} status calls during {per_hash * BIG:.2f} s"
    assert statistics.median(during) < per_hash / 4, (statistics.median(during), per_hash, statistics.median(idle))
    assert statistics.median(during) < 10 * statistics.median(idle) + per_hash / 10, (during, idle)


def test_serve_registers_a_directory_and_a_broken_adapter_fails_alone(world: World, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    mixed = world.root / "mixed"
    for name in ("good", "broken"):
        (mixed / name).mkdir(parents=True)
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            (mixed / name / f).write_bytes((world.root / "small" / "adapter-002" / f).read_bytes())
    (mixed / "broken" / WEIGHTS_FILE).write_bytes(b"\0" * 64)
    done = register_directory(world.service.controller, mixed)
    assert [(d.name, d.error is None) for d in done] == [("broken", False), ("good", True)]
    err = capsys.readouterr().err
    assert "lora-cache serve: adapter broken was not registered:" in err and "re-copy or re-save it" in err
    assert ray.get(world.service.controller.lookup_adapter.remote("good"))["version"] == done[1].version
