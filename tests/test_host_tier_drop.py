"""An unregistered adapter leaves the host tier (issue 46 item 4): every version's shard is dropped and its bytes
freed, one still read or copied from once it is let go; a registration again of the name is read afresh."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import workers.staging.tier_reads as tier_reads_module
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.shards import ShardLayout, shard_layout
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.errors import NotFoundError
from lora_cache.vocab import AdapterKey, Delta
from workers.cache import WorkerCache, WorkerConfig
from workers.control.outbox import Outbox
from workers.control.rank import WorkerControl
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostEntry, HostTier

TINY = SHAPES["tiny"]
MiB = 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_adapters(tmp_path / "adapters", SynthConfig(model="tiny", count=3, rank="8"))
    make_adapters(tmp_path / "other", SynthConfig(model="tiny", count=1, rank="8", seed=7))  # other weights
    return tmp_path


@pytest.fixture
def control(root: Path, make_catalog: Callable[..., AdapterCatalog]) -> Iterator[tuple[WorkerControl, list[Delta]]]:
    """A rank's control surface over an empty catalog (registrations as the controller sends them), its deltas."""
    catalog = make_catalog(root, register=False)
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=HostTierConfig(host_bytes=MiB, pin=False)),
                        catalog)
    deltas: list[Delta] = []
    cache.on_change = deltas.append
    outbox = Outbox("r/0", flush_s=60.0, send=lambda *_: None)
    try:
        yield WorkerControl("r", catalog, cache, outbox), deltas
    finally:
        outbox.close()
        cache.close()


def staged(control: WorkerControl, name: str) -> HostEntry:
    future = control.cache.stage(name)
    assert future is not None
    return future.result(timeout=60)


def held(tier: HostTier, name: str) -> list[AdapterKey]:
    return [k for k in tier.contents() if k.name == name]


def test_unregister_drops_every_version_from_the_host_tier_and_a_registration_again_reads_afresh(
        control: tuple[WorkerControl, list[Delta]], root: Path) -> None:
    rank, deltas = control
    tier = rank.cache.host
    src, other = root / "adapters" / "adapter-000", root / "other" / "adapter-000"
    path = root / "adapters" / "a"
    shutil.copytree(src, path)
    v1 = rank.register_adapter("a", str(path))
    rank.register_adapter("adapter-001", str(root / "adapters" / "adapter-001"))
    staged(rank, "a")
    staged(rank, "adapter-001")
    shutil.copy(other / "adapter_model.safetensors", path / "adapter_model.safetensors")  # new weights: version 2
    v2 = rank.register_adapter("a", str(path))
    assert v2 != v1
    block = staged(rank, "a").block.nbytes
    assert held(tier, "a") == [AdapterKey("a", v1), AdapterKey("a", v2)]
    used, reads = tier.arena.used_bytes, tier.bytes_read

    assert rank.unregister_adapter("a")
    assert held(tier, "a") == [] and not tier.contains(AdapterKey("a", v1)) and not tier.contains(AdapterKey("a", v2))
    assert tier.arena.used_bytes == used - 2 * block  # both versions' bytes freed
    assert held(tier, "adapter-001")  # the other adapter stays
    assert [d for d in deltas if d.state == "unstaged"] == [Delta("a", v1, "unstaged"), Delta("a", v2, "unstaged")]
    rank.cache.check_integrity()

    assert rank.register_adapter("a", str(path)) == v2  # the same file again: the same version, read afresh
    entry = staged(rank, "a")
    assert tier.bytes_read == reads + entry.bytes_read > reads and tier.contents()[-1] == AdapterKey("a", v2)
    full = load_file(str(other / "adapter_model.safetensors"))
    for e in entry.layout.entries:
        assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape),
                           full[e.key][e.rows, e.cols].to(entry.layout.dtype)), e.key
    assert not rank.unregister_adapter("b")  # never registered: False, nothing else changes
    rank.cache.check_integrity()


@pytest.fixture
def tier() -> Iterator[HostTier]:
    tier = HostTier(HostTierConfig(host_bytes=MiB, read_threads=2, pin=False, reads="thread"))
    try:
        yield tier
    finally:
        tier.close()


@pytest.fixture
def specs(root: Path, make_catalog: Callable[..., AdapterCatalog]) -> list[AdapterSpec]:
    catalog = make_catalog(root / "adapters")
    return [catalog.get(f"adapter-{i:03d}") for i in range(3)]


def layout(spec: AdapterSpec) -> ShardLayout:
    return shard_layout(spec, TINY, 1, 0, torch.float32)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Reads wait for the first event to be set once they have started (the second)."""
    release, started, real = threading.Event(), threading.Event(), tier_reads_module.read_shard

    def read(*args: Any) -> int:
        started.set()
        assert release.wait(timeout=30), "test gate never opened"
        return real(*args)

    monkeypatch.setattr(tier_reads_module, "read_shard", read)
    return release, started


def test_a_read_in_flight_is_dropped_when_it_ends_and_never_served(
        tier: HostTier, specs: list[AdapterSpec], gate: tuple[threading.Event, threading.Event]) -> None:
    release, started = gate
    spec = specs[0]
    key = AdapterKey(spec.name, spec.version)
    first, _ = tier.fetch(spec, layout(spec))
    assert started.wait(timeout=30)
    assert tier.drop_adapter(spec.name) == 0  # nothing freed yet: the read still writes into its block
    assert not tier.contains(key) and tier.arena.used_bytes > 0
    again, hit = tier.fetch(spec, layout(spec))  # registered again meanwhile: a fresh read, not the one in flight
    assert not hit and again is not first
    release.set()
    with pytest.raises(NotFoundError, match=f"adapter {spec.name} was unregistered while its shard"):
        first.result(timeout=30)
    entry = again.result(timeout=30)
    tier.release(key)
    assert tier.contents() == [key] and tier.arena.used_bytes == entry.block.nbytes  # the dropped read's bytes freed
    tier.check_integrity()


def test_a_shard_a_copy_reads_is_freed_once_let_go(tier: HostTier, specs: list[AdapterSpec]) -> None:
    spec = specs[0]
    key = AdapterKey(spec.name, spec.version)
    future, _ = tier.fetch(spec, layout(spec))
    entry = future.result(timeout=30)  # referenced: a copy to a GPU may read it
    assert tier.drop_adapter(spec.name) == 0 and not tier.contains(key)
    assert tier.arena.used_bytes == entry.block.nbytes
    _, hit = tier.fetch(spec, layout(spec))  # never served again: a miss, a block of its own
    assert not hit and tier.arena.used_bytes == 2 * entry.block.nbytes
    tier.release(key, entry)  # the copy is done: the dropped one's block frees
    assert tier.arena.used_bytes == entry.block.nbytes
    tier.check_integrity()


def test_a_fetch_waiting_for_room_for_a_dropped_adapter_fails_now(
        tier: HostTier, tmp_path: Path, make_catalog: Callable[..., AdapterCatalog]) -> None:
    make_adapters(tmp_path / "fill", SynthConfig(model="tiny", count=17, rank="8"))  # 64 KiB each: 16 fill 1 MiB
    catalog = make_catalog(tmp_path / "fill")
    fill = [catalog.get(f"adapter-{i:03d}") for i in range(17)]
    for spec in fill[:16]:
        tier.fetch(spec, layout(spec))[0].result(timeout=30)  # referenced: loads in flight hold every byte
    waiting, _ = tier.fetch(fill[16], layout(fill[16]), wait=True)
    assert tier.waits == 1 and not waiting.done()
    assert tier.drop_adapter(fill[16].name) == 0
    with pytest.raises(NotFoundError, match="waited for host room"):
        waiting.result(timeout=5)
    tier.check_integrity()
