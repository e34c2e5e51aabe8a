"""The worker cache on the CPU path (the same code as on the GPU): prefetch, acquire, release, evict."""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from safetensors import safe_open

import workers.staging.tier_reads as tier_reads_module
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import ShardLayout
from lora_cache.adapters.synth import SynthConfig, make_adapters, write_adapter
from lora_cache.errors import (
    AdapterFormatError,
    CapacityError,
    ConfigError,
    NotFoundError,
    ShardError,
    SlotsBusyError,
)
from lora_cache.vocab import AdapterKey, Delta, Prefetch, ReadinessRecord
from tests.waiting import wait_for
from tests.worker_queries import loads_without_slot, slot_waiters, slots_in, use_streams
from workers.cache import WorkerCache, WorkerConfig
from workers.control.commands import CommandGate
from workers.gpu.acquire import Batch
from workers.gpu.slots import SlotPhase
from workers.gpu.streams import CpuStreams
from workers.staging.host_config import HostTierConfig

TINY = SHAPES["tiny"]
Entries = dict[tuple[int, str, str], torch.Tensor]


def names(*idx: int) -> list[str]:
    return [f"adapter-{i:03d}" for i in idx]


A, B, C, D, E, F = names(0, 1, 2, 3, 4, 5)


@pytest.fixture
def catalog(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> AdapterCatalog:
    return make_catalog(tiny_adapters(count=6, rank="8,16")[0].parent)


def file_entries(spec_weights: Path, layout: ShardLayout) -> Entries:
    with safe_open(str(spec_weights), framework="pt") as f:
        return {
            (e.layer, e.module, e.ab): f.get_slice(e.key)[e.rows, e.cols].to(layout.dtype)
            for e in layout.entries
        }


def current(cache: WorkerCache, name: str) -> tuple[ShardLayout, Entries]:
    layout = cache.layout_of(name)
    return layout, file_entries(cache.catalog.get(name).weights, layout)


def assert_slot_holds(cache: WorkerCache, slot: int, layout: ShardLayout, want: Entries) -> None:
    for (layer, module, ab), tensor in want.items():
        assert torch.equal(cache.slot_view(slot, layout, layer, module, ab), tensor), (
            f"slot {slot} {layout.adapter}@{layout.version} layer {layer} {module}.lora_{ab}"
        )


def assert_host_holds(packed: torch.Tensor, layout: ShardLayout, want: Entries) -> None:
    """A packed shard (a host entry's ``tensor``, ``layout``'s 1-D order) holds ``want``'s matrices."""
    for (layer, module, ab), tensor in want.items():
        e = layout.entry(layer, module, ab)
        assert torch.equal(packed[e.offset : e.offset + e.numel].view(e.shape), tensor), (
            f"host copy of {layout.adapter}@{layout.version} layer {layer} {module}.lora_{ab}"
        )


def assert_serves(cache: WorkerCache, name: str, slot: int) -> None:
    assert_slot_holds(cache, slot, *current(cache, name))


def refs(cache: WorkerCache) -> dict[str, int]:
    return {r["adapter"]: r["refs"] for r in cache.residency()}  # type: ignore[misc]


def slot_of(cache: WorkerCache, name: str) -> int | None:
    version = cache.catalog.get(name).version
    return next(
        (r["slot"] for r in cache.residency() if (r["adapter"], r["version"]) == (name, version)), None
    )


def in_thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run ``fn`` on a daemon thread: a hang shows as a timeout of ``result``, not a stuck test run."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


# -- prefetch ---------------------------------------------------------------------------------------------


def test_prefetch_readiness_record(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    records: list[ReadinessRecord] = []
    cache = make_cache(catalog, on_ready=records.append)
    spec, layout = catalog.get(B), cache.layout_of(B)
    rec = cache.prefetch(B).result(timeout=10)
    assert isinstance(rec, ReadinessRecord) and records == [rec]
    assert (rec.adapter, rec.version, rec.tp_rank, rec.nbytes, rec.host_hit) == (
        B,
        spec.version,
        0,
        layout.nbytes,
        False,
    )
    assert 0 <= rec.slot < 3 and rec.disk_ms > 0 and rec.h2d_ms >= 0 and rec.ready_ms >= rec.disk_ms
    assert cache.residency() == [
        {"adapter": B, "version": spec.version, "slot": rec.slot, "state": "ready", "refs": 0, "acquired": True}
    ]  # not a controller's command: the rank's own load
    assert_serves(cache, B, rec.slot)
    stats = cache.stats()
    assert (stats["prefetches"], stats["loads"], stats["host_misses"], stats["host_hits"]) == (1, 1, 1, 0)
    assert stats["bytes_host_to_gpu"] == layout.nbytes
    assert stats["bytes_disk_to_host"] == sum(e.numel for e in layout.entries) * 2
    assert stats["slots_ready"] == 1 and stats["slots_loading"] == 0
    assert cache.evict(B)
    again = cache.prefetch(B).result(timeout=10)  # the host tier still holds the shard
    assert again.host_hit and again.disk_ms == 0.0 and again.version == spec.version
    assert_serves(cache, B, again.slot)
    stats = cache.stats()
    assert (stats["host_hits"], stats["host_misses"], stats["loads"], stats["evictions"]) == (1, 1, 2, 1)
    assert stats["bytes_disk_to_host"] == sum(e.numel for e in layout.entries) * 2  # no second disk read
    cache.check_integrity()


def test_prefetch_is_idempotent(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog)
    first = cache.prefetch(A)
    assert cache.prefetch(A) is first  # while staging or copying
    first.result(timeout=10)
    assert cache.prefetch(A) is first  # and once READY
    barrier, futures = threading.Barrier(6), []

    def go() -> None:
        barrier.wait(timeout=10)
        futures.append(cache.prefetch(B))

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(futures) == 6 and len({id(f) for f in futures}) == 1
    futures[0].result(timeout=10)
    stats = cache.stats()
    assert (stats["prefetches"], stats["loads"], stats["host_misses"]) == (2, 2, 2)
    assert len(cache.residency()) == 2
    cache.check_integrity()


def test_prefetch_unknown_adapter_or_version(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog)
    with pytest.raises(NotFoundError, match="'nope' is not registered"):
        cache.prefetch("nope")
    with pytest.raises(NotFoundError, match="re-registered"):
        cache.prefetch(A, "0123456789abcdef")
    assert cache.stats()["prefetches"] == 0 and cache.residency() == []


# -- acquire / release ------------------------------------------------------------------------------------


def test_acquire_maps_requests_to_slots_in_batch_order(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog)
    for name in (A, B):
        cache.prefetch(name).result(timeout=10)
    batch = cache.acquire([B, A, C, B, A])  # C: loaded on demand
    assert isinstance(batch, Batch) and batch.adapters == (B, A, C, B, A)
    s = batch.slots
    assert s[0] == s[3] and s[1] == s[4] and len({s[0], s[1], s[2]}) == 3
    assert batch.held == (s[0], s[1], s[2])  # distinct slots, first appearance order
    assert batch.slot_index.dtype == torch.int32 and batch.slot_index.tolist() == list(s)
    assert refs(cache) == {A: 1, B: 1, C: 1}
    cache.settle()
    for name, slot in zip(batch.adapters, batch.slots, strict=True):
        assert_serves(cache, name, slot)
    stats = cache.stats()
    assert (stats["gpu_hits"], stats["gpu_misses"]) == (2, 1)
    cache.release(batch)
    assert refs(cache) == {A: 0, B: 0, C: 0}
    again = cache.acquire([C])
    assert again.slots == (s[2],) and cache.stats()["gpu_hits"] == 3
    cache.release(again)
    cache.check_integrity()


def test_acquire_loads_on_demand(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog, num_slots=2)
    batch = cache.acquire([D, E, D])
    cache.settle()
    assert_serves(cache, D, batch.slots[0])
    assert_serves(cache, E, batch.slots[1])
    stats = cache.stats()
    assert (stats["gpu_misses"], stats["gpu_hits"], stats["loads"], stats["prefetches"], stats["demand_loads"]) == (
        2, 0, 2, 0, 2)
    cache.release(batch)
    cache.check_integrity()


def test_prefetch_accuracy_counts_prefetches_used_before_eviction(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """A prefetched adapter counts as used if a batch acquired it before its slot was freed; loads
    started by a miss are not prefetches and do not count either way."""
    cache = make_cache(catalog, num_slots=2)
    cache.prefetch(A).result(timeout=10)
    cache.prefetch(B).result(timeout=10)
    cache.release(cache.acquire([A]))
    assert cache.evict(A) and cache.evict(B)
    cache.release(cache.acquire([C]))  # on demand
    cache.settle()
    assert cache.evict(C)
    stats = cache.stats()
    assert (stats["prefetches"], stats["prefetch_used"], stats["prefetch_unused"], stats["evictions"]) == (2, 1, 1, 3)
    cache.check_integrity()


def test_on_miss_error(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog, on_miss="error")
    cache.prefetch(A).result(timeout=10)
    with pytest.raises(NotFoundError) as e:
        cache.acquire([A, B])
    msg = str(e.value)
    assert f"adapter {B}@{catalog.get(B).version} is not resident on TP rank 0" in msg
    assert "prefetch it first or set on_miss='load'" in msg
    assert refs(cache) == {A: 0}  # A's reference was dropped with the failed acquire
    assert cache.stats()["loads"] == 1  # and nothing was loaded for B
    batch = cache.acquire([A])
    assert_serves(cache, A, batch.slots[0])
    cache.release(batch)
    pending = cache.prefetch(C)  # a load in flight is waited for, not refused
    batch = cache.acquire([C])
    pending.result(timeout=10)
    assert_serves(cache, C, batch.slots[0])
    cache.release(batch)
    cache.check_integrity()


def test_release_twice_raises(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog)
    batch = cache.acquire([A, A])
    cache.release(batch)
    with pytest.raises(ValueError, match="batch released twice"):
        cache.release(batch)
    assert refs(cache) == {A: 0}
    cache.check_integrity()


def test_acquire_argument_errors(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog, max_batch=4)
    with pytest.raises(ValueError, match=r"acquire takes 1\.\.4 adapters \(max_batch\), got 0"):
        cache.acquire([])
    with pytest.raises(ValueError, match="got 5"):
        cache.acquire([A] * 5)
    cache.prefetch(A).result(timeout=10)
    with pytest.raises(NotFoundError, match="'nope' is not registered"):
        cache.acquire([A, "nope"])
    assert refs(cache) == {A: 0}
    cache.check_integrity()


# -- capacity and eviction --------------------------------------------------------------------------------


def test_eviction_never_touches_a_held_slot(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog, num_slots=3)
    held = cache.acquire([A])
    cache.settle()
    for name in (B, C, D, E, F):  # each prefetch evicts the least recently used idle adapter, never A
        rec = cache.prefetch(name).result(timeout=10)
        assert rec.slot != held.slots[0]
        assert refs(cache)[A] == 1
        assert_serves(cache, A, held.slots[0])
        cache.check_integrity()
    assert set(refs(cache)) == {A, E, F}
    assert cache.stats()["evictions"] == 3
    cache.release(held)


def test_full_cache_fails_the_load_not_the_holders(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog, num_slots=3)
    batch = cache.acquire([A, B, C])
    cache.settle()
    before = cache.residency()
    with pytest.raises(SlotsBusyError) as e:
        cache.prefetch(D).result(timeout=10)
    assert f"no GPU slot for {D}@" in str(e.value) and "all 3 slots are loading or in use" in str(e.value)
    # no room ahead of need is counted, not a failed load (no backoff at the controller, no warning)
    assert cache.residency() == before and cache.stats()["load_failures"] == 0
    assert cache.stats()["prefetch_no_room"] == 1
    for name, slot in zip(batch.adapters, batch.slots, strict=True):
        assert_serves(cache, name, slot)
    cache.check_integrity()
    assert cache.host.contains(AdapterKey(D, catalog.get(D).version))  # staged: the next try is a host hit
    cache.release(batch)
    rec = cache.prefetch(D).result(timeout=10)
    assert rec.host_hit and rec.slot == batch.slots[0]  # A was the least recently used
    cache.check_integrity()


def test_a_prefetch_without_room_is_counted_not_a_command_error(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    """Issue 46: a prefetch that finds every slot held by running batches is counted (``prefetch_no_room``, not
    ``load_failures``) and its command is no error for the controller to log; its "no_room" delta tells the
    controller the adapter is not there, and that no load failed (before: "failed", a failure's backoff)."""
    deltas: list[Delta] = []
    cache = make_cache(catalog, num_slots=1)
    cache.book.on_change = deltas.append
    held = cache.acquire([A])
    cache.settle()
    control = CommandGate(cache, deltas.append)
    version = catalog.get(B).version
    result = control.apply([Prefetch(B, version, priority=0, epoch=1)])
    wait_for(lambda: any(d.adapter == B and d.state == "no_room" for d in deltas), "B's no_room delta", 10)
    assert not any(d.state == "failed" for d in deltas)
    assert result.errors == () and result.accepted == 1
    stats = cache.stats()
    assert (stats["prefetch_no_room"], stats["load_failures"]) == (1, 0)
    assert refs(cache) == {A: 1}
    cache.release(held)
    cache.check_integrity()


def test_a_lease_waits_its_turn_for_a_slot_then_holds_it(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    """Issue 46 (back-pressure, not failure): a request whose adapter finds every slot held waits
    (``slot_wait_s``) until a running batch lets go of one, then holds its adapter at the exact version."""
    cache = make_cache(catalog, num_slots=1)
    held = cache.acquire([A])
    cache.settle()
    waiting = in_thread(lambda: cache.acquire([B], slot_wait_s=30.0))
    wait_for(lambda: cache.stats()["slot_waits"] == 1, "the lease's load waiting for a slot", 10)  # barrier
    assert not waiting.done() and refs(cache) == {A: 1}
    cache.release(held)  # the running batch lets go: the waiting load takes the slot
    batch = waiting.result(timeout=10)
    cache.settle()
    assert batch.keys == (AdapterKey(B, catalog.get(B).version),) and batch.slots == held.slots
    assert_serves(cache, B, batch.slots[0])
    assert cache.stats()["load_failures"] == 0
    cache.release(batch)
    cache.check_integrity()


def test_a_lease_wait_is_bounded_and_changes_nothing(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    """Past ``slot_wait_s`` the request fails with a clear error (what, how long, the fix) and the cache is as
    it was; an engine's step (no wait) still fails at once: its own batches hold the slots."""
    cache = make_cache(catalog, num_slots=1)
    held = cache.acquire([A])
    cache.settle()
    before = cache.residency()
    with pytest.raises(SlotsBusyError, match=r"waited 0\.2 s \(slot_wait_s\).*raise slot_wait_s"):
        in_thread(lambda: cache.acquire([B], slot_wait_s=0.2)).result(timeout=20)
    with pytest.raises(SlotsBusyError, match=f"no GPU slot for {B}@"):
        in_thread(lambda: cache.acquire([B])).result(timeout=10)
    assert cache.residency() == before and refs(cache) == {A: 1}
    assert_serves(cache, A, held.slots[0])
    cache.check_integrity()
    cache.release(held)
    batch = cache.acquire([B], slot_wait_s=0.2)  # room now: no wait at all
    cache.settle()
    assert_serves(cache, B, batch.slots[0])
    cache.release(batch)
    cache.check_integrity()


@pytest.mark.parametrize("staged", [True, False])
def test_acquire_with_every_slot_held_raises_promptly(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], staged: bool
) -> None:
    """Regression: an on-demand load whose shard was already on the host retried forever (one new load
    per pass of acquire's loop) instead of raising CapacityError when every slot was held."""
    cache = make_cache(catalog, num_slots=1)
    if staged:
        cache.prefetch(B).result(timeout=10)
    cache.prefetch(A).result(timeout=10)
    held = cache.acquire([A])
    failures = cache.stats()["load_failures"]
    with pytest.raises(CapacityError, match=f"no GPU slot for {B}@"):
        in_thread(lambda: cache.acquire([B])).result(timeout=10)
    assert cache.stats()["load_failures"] == failures + 1  # one attempt, not a retry loop
    with pytest.raises(CapacityError):
        in_thread(lambda: cache.acquire([A, B])).result(timeout=10)
    assert refs(cache) == {A: 1}  # only the held batch's reference is left
    assert_serves(cache, A, held.slots[0])
    cache.release(held)
    batch = cache.acquire([B])
    cache.settle()
    assert_serves(cache, B, batch.slots[0])
    cache.release(batch)
    cache.check_integrity()


def test_evict(catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    cache = make_cache(catalog)
    for name in (A, B):
        cache.prefetch(name).result(timeout=10)
    batch = cache.acquire([A])
    assert not cache.evict(A)  # in use
    assert not cache.evict(C)  # registered, not resident
    assert not cache.evict("nope", "0123")  # unknown adapter at an explicit version
    assert cache.evict(B)
    assert not cache.evict(B)  # idempotent
    assert set(refs(cache)) == {A} and cache.stats()["evictions"] == 1
    cache.release(batch)
    assert cache.evict(A) and cache.residency() == []
    cache.check_integrity()


# -- stage: a shard into the host tier, no slot -----------------------------------------------------------


def test_stage_reads_into_the_host_tier_and_the_load_after_it_is_a_host_hit(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog)
    deltas: list[object] = []
    cache.on_change = deltas.append
    layout, key = cache.layout_of(B), AdapterKey(B, catalog.get(B).version)
    staged = cache.stage(B)
    assert staged is not None and staged.result(timeout=10).key == key and cache.host.contains(key)
    assert cache.residency() == [] and deltas == [Delta(B, key.version, "staged")]  # no slot: the host tier's change
    stats = cache.stats()
    assert (stats["stages"], stats["host_hits"], stats["host_misses"], stats["loads"]) == (1, 0, 0, 0)
    assert stats["bytes_disk_to_host"] == layout.nbytes
    assert cache.host._entries[key].refs == 0  # the LRU's, like any idle entry
    again = cache.stage(B)  # idempotent: the staged entry, no second read
    assert again is not None and again.result(timeout=10).key == key and cache.stats()["stages"] == 1
    rec = cache.prefetch(B).result(timeout=10)
    assert rec.host_hit and rec.disk_ms == 0.0
    assert_serves(cache, B, rec.slot)
    stats = cache.stats()
    assert (stats["host_hits"], stats["host_misses"], stats["bytes_disk_to_host"]) == (1, 0, layout.nbytes)
    assert cache.stage(B) is None  # resident: nothing to stage
    with pytest.raises(NotFoundError):
        cache.stage("nope")
    cache.check_integrity()


def test_stage_without_host_room_changes_nothing(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    make_cache: Callable[..., WorkerCache]
) -> None:
    """Every host byte held by loads in flight (references taken as ``prefetch`` takes them): the stage is
    refused and counted, the tier and the slots are as they were."""
    catalog = make_catalog(tiny_adapters(count=40, rank="16")[0].parent)
    cache = make_cache(catalog)  # 1 MiB of host tier: about 16 tiny rank-16 shards
    held: list[AdapterKey] = []
    for name in sorted(catalog.names()):
        try:
            future, _ = cache.host.fetch(catalog.get(name), cache.layout_of(name))
        except CapacityError:
            break
        future.result(timeout=10)
        held.append(AdapterKey(name, catalog.get(name).version))
    assert 0 < len(held) < 40, "the host tier should fill before the catalog runs out"
    spare = next(n for n in sorted(catalog.names()) if n not in {k.name for k in held})
    before = (list(cache.host._entries), cache.host.arena.used_bytes, cache.residency())
    assert cache.stage(spare) is None
    assert (list(cache.host._entries), cache.host.arena.used_bytes, cache.residency()) == before
    assert cache.stats()["stage_failures"] == 1 and cache.stats()["stages"] == 0
    cache.host.release(held[0])
    staged = cache.stage(spare)  # an idle entry now: the LRU gives its room up
    assert staged is not None and staged.result(timeout=10).key.name == spare
    assert not cache.host.contains(held[0])
    for key in held[1:]:
        cache.host.release(key)
    cache.check_integrity()


def test_stage_of_a_damaged_file_is_counted_and_leaves_the_tier_as_it_was(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog)
    cache.prefetch(A).result(timeout=10)
    root = catalog.roots.roots[0]
    shutil.copytree(root / D, root / "bad")
    bad = catalog.register("bad", "bad")
    bad.weights.write_bytes(b"\x00" * len(bad.weights.read_bytes()))
    before = (cache.residency(), cache.host.arena.used_bytes, list(cache.host._entries))
    staged = cache.stage("bad")
    assert staged is not None
    with pytest.raises(AdapterFormatError, match="its bytes are not the ones registered"):
        staged.result(timeout=10)
    wait_for(lambda: cache.stats()["stage_failures"] == 1)  # counted by the read's done callback
    assert (cache.residency(), cache.host.arena.used_bytes, list(cache.host._entries)) == before
    assert cache.acquire([A]).slots == (slot_of(cache, A),)  # good traffic unaffected
    cache.check_integrity()


# -- failures ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "replace"])
def test_failed_load_leaves_everything_as_it_was(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], damage: str
) -> None:
    cache = make_cache(catalog, num_slots=3)
    for name in (A, B, C):
        cache.prefetch(name).result(timeout=10)
    root = catalog.roots.roots[0]
    shutil.copytree(root / D, root / "bad")
    bad = catalog.register("bad", "bad")
    data = bad.weights.read_bytes()
    if damage == "truncate":
        bad.weights.write_bytes(data[: len(data) // 2])
    else:
        bad.weights.write_bytes(b"\x00" * len(data))
    before = (cache.residency(), cache.host.arena.used_bytes, list(cache.host._entries), cache.stats())
    with pytest.raises(AdapterFormatError) as e:
        cache.prefetch("bad").result(timeout=10)
    msg = str(e.value)
    assert str(bad.weights) in msg
    if damage == "truncate":
        assert (
            "changed size since it was registered" in msg
            and bad.version in msg
            and "register it again" in msg
        )
    else:
        assert "its bytes are not the ones registered" in msg and "register it again for a new version" in msg
    with pytest.raises(AdapterFormatError):  # on demand: the same clear error, no hang, no retry loop
        in_thread(lambda: cache.acquire([A, "bad"])).result(timeout=10)
    after = cache.stats()
    assert cache.residency() == before[0]
    assert cache.host.arena.used_bytes == before[1] and list(cache.host._entries) == before[2]
    assert after["load_failures"] == before[3]["load_failures"] + 2  # type: ignore[operator]
    assert after["loads"] == before[3]["loads"] and after["evictions"] == before[3]["evictions"]
    cache.check_integrity()
    batch = cache.acquire([A, B, C])  # the good adapters are still served, from their slots
    assert dict(zip(batch.adapters, batch.slots, strict=True)) == {r["adapter"]: r["slot"] for r in before[0]}
    for name, slot in zip(batch.adapters, batch.slots, strict=True):
        assert_serves(cache, name, slot)
    cache.release(batch)
    assert cache.stats()["gpu_hits"] == 4  # A in the failed batch, then A, B, C


def test_readiness_callback_errors_do_not_break_loads(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def broken(record: ReadinessRecord) -> None:
        seen.append(record.adapter)
        raise RuntimeError("consumer is down")

    cache = make_cache(catalog, on_ready=broken)
    with caplog.at_level(logging.ERROR, logger="workers.gpu.loads"):
        for name in (A, B, C, D):
            rec = cache.prefetch(name).result(timeout=10)
            assert rec.adapter == name
        assert seen == [A, B, C, D] and cache.stats()["loads"] == 4
        batch = cache.acquire([C, D])  # both resident: no fifth load
        assert_serves(cache, D, batch.slots[1])
        cache.release(batch)
        cache.check_integrity()
        cache.close()  # joins the watcher: every handler error has been logged
    assert sum("readiness handler failed" in r.getMessage() for r in caplog.records) == 4


def test_a_load_is_logged_ready_before_any_report_of_it(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_ready`` (the rank's READY log, the time a test measures a reload from) precedes the READY delta:
    once the load's lock is released, another thread's ``report()`` may hand the queued READY over at once
    (the CI's stop 50: a Lookup answered READY before the worker's load log said so). That other thread is
    pinned here: a report runs inside the host tier's release, between the lock and the rest of ``_finish``."""
    order: list[tuple[str, str, str]] = []
    cache = make_cache(catalog, on_ready=lambda r: order.append(("logged", r.adapter, "ready")))
    cache.book.on_change = lambda d: order.append(("reported", d.adapter, d.state))
    release = cache.host.release

    def release_then_report(*args: Any) -> None:
        release(*args)
        cache.book.report()  # what any other thread that queued a change may do now

    monkeypatch.setattr(cache.host, "release", release_then_report)
    for name in (A, B):
        cache.prefetch(name).result(timeout=10)
    for name in (A, B):
        seen = [kind for kind, adapter, state in order if adapter == name and state == "ready"]
        assert seen == ["logged", "reported"], order
    cache.check_integrity()


# -- versions ---------------------------------------------------------------------------------------------


def test_reregistered_adapter_serves_the_new_weights(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    cache = make_cache(catalog, num_slots=3)
    old = catalog.get(A)
    old_layout, old_weights = current(cache, A)
    held_old = cache.acquire([A])
    cache.settle()
    write_adapter(
        old.path, TINY, 8, 32.0, list(MODULE_ORDER), torch.bfloat16, torch.Generator().manual_seed(99)
    )
    new = catalog.register(A, old.path)
    assert new.version != old.version and new.file_bytes == old.file_bytes
    new_layout, new_weights = current(cache, A)
    assert any(not torch.equal(new_weights[k], old_weights[k]) for k in new_weights)
    batch = cache.acquire([A])
    cache.settle()
    assert batch.slots != held_old.slots
    assert_slot_holds(cache, batch.slots[0], new_layout, new_weights)  # the new version...
    assert_slot_holds(cache, held_old.slots[0], old_layout, old_weights)  # ...beside the old one still in use
    versions = {r["version"]: r["refs"] for r in cache.residency()}
    assert versions == {old.version: 1, new.version: 1}
    with pytest.raises(NotFoundError, match="re-registered"):
        cache.prefetch(A, old.version)
    cache.release(held_old)
    cache.release(batch)
    assert cache.evict(A, old.version) and [r["version"] for r in cache.residency()] == [new.version]
    again = cache.acquire([A])  # never the stale weights again
    assert_slot_holds(cache, again.slots[0], new_layout, new_weights)
    cache.release(again)
    cache.check_integrity()


# -- counters, TP and config ------------------------------------------------------------------------------


def test_counters_are_consistent_and_refs_return_to_zero(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]
) -> None:
    records: list[ReadinessRecord] = []
    cache = make_cache(catalog, num_slots=2, on_ready=records.append)
    distinct = 0
    for batch_names in ([A], [A, B], [C], [A, C, C], [D], [B, D], [A]):
        batch = cache.acquire(batch_names)
        distinct += len(set(batch_names))
        cache.settle()
        cache.release(batch)
    cache.prefetch(E).result(timeout=10)
    s = cache.stats()
    assert s["gpu_hits"] + s["gpu_misses"] == distinct  # type: ignore[operator]
    started = s["prefetches"] + s["demand_loads"]  # type: ignore[operator]
    assert s["host_hits"] + s["host_misses"] == started and s["prefetches"] == 1  # type: ignore[operator]
    assert s["loads"] == len(records) == started and s["load_failures"] == 0
    assert s["bytes_host_to_gpu"] == sum(r.nbytes for r in records)
    misses = [r for r in records if not r.host_hit]
    assert len(misses) == s["host_misses"] and s["host_hits"] == len(records) - len(misses)
    assert s["bytes_disk_to_host"] == sum(r.nbytes for r in misses)  # tiny: no padding, bf16 file = bf16 slot
    assert s["disk_ms"]["count"] == len(misses) and s["h2d_ms"]["count"] == s["ready_ms"]["count"] == len(
        records
    )
    assert s["evictions"] == s["loads"] - 2  # type: ignore[operator]  # two slots, always full after the second
    assert all(r["refs"] == 0 and r["state"] == "ready" for r in cache.residency())
    assert all(e.refs == 0 for e in cache.host._entries.values())
    cache.check_integrity()


@pytest.mark.parametrize(("tp", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_tp_rank_cache_holds_its_slices(
    catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache], tp: int, rank: int
) -> None:
    cache = make_cache(catalog, tp=tp, tp_rank=rank)
    rec = cache.prefetch(B).result(timeout=10)
    layout = cache.layout_of(B)
    assert (layout.tp, layout.rank, rec.tp_rank) == (tp, rank, rank)
    assert_serves(cache, B, rec.slot)
    assert cache.slot_view(rec.slot, layout, 0, "q_proj", "B").shape == (64 // tp, 16)
    assert cache.slot_view(rec.slot, layout, 1, "down_proj", "A").shape == (16, 128 // tp)
    assert cache.slot_numel >= layout.numel
    assert cache.pool.shape == (3, 3 * cache.slot_numel) and cache.pool_bytes == 3 * cache.slot_numel * 2


def test_worker_config_errors(tmp_path: Path, catalog: AdapterCatalog) -> None:
    for kw, msg in (
        ({"num_slots": 0}, "num_slots must be >= 1, got 0"),
        ({"tp": 2, "tp_rank": 2}, "tp_rank 2 must be in 0..1 for tp 2"),
        ({"dtype": "int8"}, "dtype must be bfloat16, float16 or float32, got 'int8'"),
        ({"on_miss": "wait"}, "on_miss must be one of ('load', 'error'), got 'wait'"),
        ({"max_batch": 0}, "max_batch must be >= 1, got 0"),
    ):
        with pytest.raises(ConfigError) as e:
            WorkerConfig(**kw)  # type: ignore[arg-type]
        assert msg in str(e.value)
    big = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="llama-3.1-8b", max_rank=64))
    with pytest.raises(ConfigError) as e:
        WorkerCache(WorkerConfig(device="cpu", host=HostTierConfig(host_bytes=1 << 20)), big)
    assert "host_bytes (1.0 MiB) must hold at least one slot" in str(e.value) and "llama-3.1-8b" in str(
        e.value
    )
    assert "raise host_bytes or lower max_rank" in str(e.value)
    with pytest.raises(ShardError, match=r"q_proj\.lora_B"):
        WorkerCache(WorkerConfig(device="cpu", tp=3, host=HostTierConfig(host_bytes=1 << 20)), catalog)
    devices = [
        ("tpu", "device 'tpu' is not a device name; use cpu, cuda, cuda:N or auto"),
        ("meta", "device 'meta' is not supported; use cpu, cuda, cuda:N or auto"),
    ]
    if not torch.cuda.is_available():
        devices.append(("cuda", "this machine has no CUDA GPU; use --device cpu or auto"))
    for device, msg in devices:
        with pytest.raises(ConfigError) as e:
            WorkerCache(WorkerConfig(device=device, host=HostTierConfig(host_bytes=1 << 20)), catalog)
        assert msg in str(e.value)


# -- random steps against a model ---------------------------------------------------------------------------

NAMES = tuple(names(*range(6)))


class CacheMachine(RuleBasedStateMachine):
    """Random acquire / release / prefetch / evict / re-register with more adapters than slots.

    The model: the batches held (each request's slot, layout and expected weights), the current weights of
    every adapter. After every step: integrity, every held request still sees its own adapter's weights,
    references equal the held batches, counters add up.
    """

    TIERS = "inclusive"  # HostTierConfig.tiers

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lora-cache-sm-"))
        make_adapters(self.root, SynthConfig(model="tiny", count=len(NAMES), rank="8,16"))
        self.catalog = AdapterCatalog(
            CatalogConfig(adapter_roots=(str(self.root),), model="tiny", max_rank=16)
        )
        self.catalog.register_dir(self.root)
        self.records: list[ReadinessRecord] = []
        self.n = 3
        self.cache = WorkerCache(
            WorkerConfig(
                num_slots=self.n,
                device="cpu",
                host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, tiers=self.TIERS),
            ),
            self.catalog,
            on_ready=self.records.append,
        )
        self.weights = {n: current(self.cache, n) for n in NAMES}
        self.shards = {self.key(n): self.weights[n] for n in NAMES}  # every version's layout and weights
        self.held: list[tuple[Batch, list[tuple[AdapterKey, ShardLayout, Entries]]]] = []
        self.lookups = 0
        self.rewrites = 0

    def key(self, name: str) -> AdapterKey:
        return AdapterKey(name, self.catalog.get(name).version)

    def held_keys(self) -> set[AdapterKey]:
        return {k for _, reqs in self.held for k, _, _ in reqs}

    @rule(batch=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4))
    def acquire(self, batch: list[str]) -> None:
        held, counted = self.held_keys(), 0
        fails = False
        for name in dict.fromkeys(batch):  # predict: the first adapter needing a slot when all are held fails
            counted += 1
            if self.key(name) not in held:
                if len(held) == self.n:
                    fails = True
                    break
                held.add(self.key(name))
        self.lookups += counted
        event(f"acquire: {'capacity error' if fails else 'ok'}")
        if fails:
            with pytest.raises(CapacityError):
                in_thread(lambda: self.cache.acquire(batch)).result(timeout=10)
            self.cache.settle()
            return
        got = in_thread(lambda: self.cache.acquire(batch)).result(timeout=10)
        self.cache.settle()
        assert got.adapters == tuple(batch) and got.slot_index.tolist() == list(got.slots)
        assert len(set(got.slots)) == len(set(batch)) == len(got.held)
        reqs = [(self.key(n), *self.weights[n]) for n in batch]
        for (_, layout, want), slot in zip(reqs, got.slots, strict=True):
            assert_slot_holds(self.cache, slot, layout, want)
        self.held.append((got, reqs))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        batch, _ = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.release(batch)

    @rule(name=st.sampled_from(NAMES))
    def prefetch(self, name: str) -> None:
        resident = slot_of(self.cache, name) is not None
        future = self.cache.prefetch(name)
        event(f"prefetch: {'resident' if resident else 'load'}")
        if not resident and len(self.held_keys()) == self.n:
            event("prefetch: capacity error")
            with pytest.raises(CapacityError):
                future.result(timeout=10)
        else:
            rec = future.result(timeout=10)
            assert (rec.adapter, rec.version) == tuple(self.key(name))
            assert_slot_holds(self.cache, rec.slot, *self.weights[name])
        self.cache.settle()

    @rule(name=st.sampled_from(NAMES))
    def evict(self, name: str) -> None:
        expected = slot_of(self.cache, name) is not None and self.key(name) not in self.held_keys()
        assert self.cache.evict(name) == expected
        event(f"evict: {expected}")
        assert slot_of(self.cache, name) is None or self.key(name) in self.held_keys()

    @rule(name=st.sampled_from(NAMES))
    def reregister(self, name: str) -> None:
        self.rewrites += 1
        spec = self.catalog.get(name)
        if AdapterKey(name, spec.version) in self.held_keys():
            event("reregister: old version held")
        write_adapter(
            spec.path,
            TINY,
            spec.config.r,
            32.0,
            list(MODULE_ORDER),
            torch.bfloat16,
            torch.Generator().manual_seed(1000 + self.rewrites),
        )
        assert self.catalog.register(name, spec.path).version != spec.version
        self.weights[name] = current(self.cache, name)
        self.shards[self.key(name)] = self.weights[name]

    @invariant()
    def consistent(self) -> None:
        cache = self.cache
        cache.check_integrity()
        for batch, reqs in self.held:  # every held request still sees its own adapter's weights
            for (_, layout, want), slot in zip(reqs, batch.slots, strict=True):
                assert_slot_holds(cache, slot, layout, want)
        want_refs: dict[AdapterKey, int] = {}
        for _, reqs in self.held:
            for k in {k for k, _, _ in reqs}:
                want_refs[k] = want_refs.get(k, 0) + 1
        got_refs = {AdapterKey(r["adapter"], r["version"]): r["refs"] for r in cache.residency()}  # type: ignore
        assert all(v >= 0 for v in got_refs.values())
        assert {k: v for k, v in got_refs.items() if v} == want_refs
        s = cache.stats()
        assert s["slots_loading"] == 0
        assert s["gpu_hits"] + s["gpu_misses"] == self.lookups  # type: ignore[operator]
        started = s["prefetches"] + s["demand_loads"]  # type: ignore[operator]
        assert s["loads"] + s["load_failures"] + s["prefetch_no_room"] == started  # type: ignore[operator]
        assert s["host_hits"] + s["host_misses"] == started  # type: ignore[operator]
        assert s["prefetch_used"] + s["prefetch_unused"] <= s["prefetches"]  # type: ignore[operator]
        assert s["loads"] == len(self.records) and s["bytes_host_to_gpu"] == sum(
            r.nbytes for r in self.records
        )
        for key in cache.host.contents():  # a staged or written-back shard is its own version's bytes (invariant 1)
            assert_host_holds(cache.host._entries[key].tensor, *self.shards[key])

    def teardown(self) -> None:
        try:
            for batch, _ in self.held:
                self.cache.release(batch)
            assert all(r["refs"] == 0 for r in self.cache.residency())  # refcounts return to zero when idle
            assert all(e.refs == 0 for e in self.cache.host._entries.values())
            self.cache.check_integrity()
        finally:
            self.cache.close()
            shutil.rmtree(self.root, ignore_errors=True)


CacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestCacheMachine = CacheMachine.TestCase


class ExclusiveCacheMachine(CacheMachine):
    """The same steps with exclusive tiers: every evicted slot's shard written back into the host tier (the host
    tier's bytes checked against every version after each step), and no shard both READY in a slot and whole on
    the host once the rank is quiet."""

    TIERS = "exclusive"

    @invariant()
    def one_tier_each(self) -> None:
        self.cache.settle()
        wait_for(lambda: not self.cache.host.reading(), "write-backs landed")
        event(f"shards written back: {min(3, self.cache.host.written_back)}+")
        both = self.cache.ready_keys() & set(self.cache.host.contents())
        assert not both, f"{both} held READY in a slot and whole on the host"


ExclusiveCacheMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestExclusiveCacheMachine = ExclusiveCacheMachine.TestCase


class _GatedStreams(CpuStreams):
    """CPU streams whose copies 'complete' only when the test opens the gate."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.gate = threading.Event()

    def done(self, event: object) -> bool:
        return self.gate.is_set()


def test_load_waits_for_a_slot_held_by_loads_in_flight(tiny_adapters, make_catalog, make_cache) -> None:
    """Invariant 7: prefetches in flight cost a later load latency, never a CapacityError."""
    root = tiny_adapters(3)[0].parent
    cache = make_cache(make_catalog(root), num_slots=2)
    gated = _GatedStreams(cache.device)
    use_streams(cache, gated)
    first = [cache.prefetch(n) for n in ("adapter-000", "adapter-001")]
    wait_for(lambda: slots_in(cache, SlotPhase.LOADING) == 2)  # two copies issued, neither complete
    third = cache.prefetch("adapter-002")
    wait_for(lambda: slot_waiters(cache) == 1)  # staged, waiting for a slot instead of failing
    assert not third.done() and cache.counters.load_failures == 0
    gated.gate.set()
    record = third.result(timeout=30)
    assert all(f.result(timeout=30) for f in first)
    assert record.adapter == "adapter-002" and cache.counters.load_failures == 0
    cache.check_integrity()


# -- loads that wait for host-tier room ------------------------------------------------------------------
# float32 rank-16 tiny shards are 128 KiB: the 1 MiB host tier holds exactly HOST_SHARDS of them
HOST_SHARDS = 8


RoomCache = Callable[[AdapterCatalog, int], tuple[WorkerCache, _GatedStreams]]


@pytest.fixture
def room_cache(make_cache: Callable[..., WorkerCache]) -> Iterator[RoomCache]:
    """``room_cache(catalog, slots)``: a cache whose host tier holds exactly HOST_SHARDS shards, and copies
    that complete only when the test opens the streams' gate (so loads hold their host entries until
    then); every gate is opened before the caches close, so a failed test does not hang its teardown."""
    gates: list[threading.Event] = []

    def make(catalog: AdapterCatalog, slots: int) -> tuple[WorkerCache, _GatedStreams]:
        cache = make_cache(catalog, num_slots=slots, dtype="float32")
        assert {cache.layout_of(n).nbytes for n in catalog.names()} == {(1 << 20) // HOST_SHARDS}
        gated = _GatedStreams(cache.device)
        use_streams(cache, gated)
        gates.append(gated.gate)
        return cache, gated

    yield make
    for gate in gates:
        gate.set()


@pytest.mark.parametrize(("extra", "pipelined"), [(1, False), (3, False), (3, True)])
def test_concurrent_misses_wait_for_host_room_and_all_succeed(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    room_cache: RoomCache, extra: int, pipelined: bool
) -> None:
    """HOST_SHARDS + extra demand acquires at once: the extra ones find every host byte held by loads in
    flight and wait for them (host_waits) instead of failing their step (docs/known-issues.md); a
    pipelined acquire waits for its slot the same way."""
    total = HOST_SHARDS + extra
    catalog = make_catalog(tiny_adapters(count=total, rank="16")[0].parent)
    cache, gated = room_cache(catalog, total)
    wanted = sorted(catalog.names())
    start = threading.Barrier(total)

    def acquire(name: str) -> Batch:
        start.wait(timeout=10)
        return cache.acquire([name], pipelined=pipelined)

    batches = {name: in_thread(functools.partial(acquire, name)) for name in wanted}
    wait_for(lambda: slots_in(cache, SlotPhase.LOADING) == HOST_SHARDS and len(cache.host._waiting) == extra)
    waiting = [k.name for k in cache.host._waiting]
    assert all(not batches[n].done() for n in waiting) and cache.stats()["host_waits"] == extra
    assert not cache.evict(waiting[0])  # not resident: a waiting load is not evicted, and keeps waiting
    cache.check_integrity()
    gated.gate.set()  # the copies complete: each releases its entry, the waiting loads take the room in turn
    got = {name: future.result(timeout=30) for name, future in batches.items()}
    assert len({b.slots[0] for b in got.values()}) == total
    for name, batch in got.items():
        if batch.waits is not None:
            batch.waits.finish()
        assert_serves(cache, name, batch.slots[0])
        cache.release(batch)
    cache.settle()
    s = cache.stats()
    assert (s["demand_loads"], s["loads"], s["load_failures"], s["host_waits"]) == (total, total, 0, extra)
    assert (s["host_misses"], s["host_hits"]) == (total, 0)
    assert all(e.refs == 0 for e in cache.host._entries.values()) and not cache.host._waiting
    cache.check_integrity()


def test_a_failed_read_that_others_wait_on_lets_them_proceed(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    room_cache: RoomCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host tier is held by seven loads in flight and one whose read is stopped at a gate; two more wait.
    That read fails: its room goes to the first waiting load; the rest is as if it had never started."""
    root = tiny_adapters(count=HOST_SHARDS + 1, rank="16")[0].parent
    catalog = make_catalog(root)
    shutil.copytree(root / names(0)[0], root / "bad")
    bad = catalog.register("bad", "bad")
    bad.weights.write_bytes(bad.weights.read_bytes()[:100])  # changed size: the read fails
    arrived, go, real = threading.Event(), threading.Event(), tier_reads_module.read_shard

    def read(spec: AdapterSpec, *args: Any) -> int:
        if spec.name == "bad":
            arrived.set()
            assert go.wait(timeout=10), "test gate never opened"
        return real(spec, *args)

    monkeypatch.setattr(tier_reads_module, "read_shard", read)
    cache, gated = room_cache(catalog, HOST_SHARDS + 2)
    good = sorted(n for n in catalog.names() if n != "bad")
    loads = {n: cache.prefetch(n) for n in good[: HOST_SHARDS - 1]}
    wait_for(lambda: slots_in(cache, SlotPhase.LOADING) == HOST_SHARDS - 1)
    failed = cache.prefetch("bad")
    assert arrived.wait(timeout=10)  # its read holds the last 128 KiB
    first, second = good[HOST_SHARDS - 1 :]
    loads[first], loads[second] = cache.prefetch(first), cache.prefetch(second)
    assert [k.name for k in cache.host._waiting] == [first, second] and cache.stats()["host_waits"] == 2
    used = cache.host.arena.used_bytes
    go.set()
    with pytest.raises(AdapterFormatError, match="changed size"):
        failed.result(timeout=10)
    wait_for(lambda: slots_in(cache, SlotPhase.LOADING) == HOST_SHARDS)  # the first waiting load took the room
    assert [k.name for k in cache.host._waiting] == [second] and not loads[second].done()
    assert cache.host.arena.used_bytes == used and "bad" not in {k.name for k in cache.host._entries}
    cache.check_integrity()
    gated.gate.set()
    for name, future in loads.items():
        assert_serves(cache, name, future.result(timeout=30).slot)
    cache.settle()
    s = cache.stats()
    assert (s["loads"], s["load_failures"], s["host_waits"]) == (HOST_SHARDS + 1, 1, 2)
    assert all(e.refs == 0 for e in cache.host._entries.values())
    cache.check_integrity()


def test_closing_the_cache_fails_loads_waiting_for_host_room(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    room_cache: RoomCache
) -> None:
    """A load waiting for host room when its worker closes fails (an acquire waiting on it raises), holding
    no reference and no arena block; the loads in flight finish before the close returns."""
    catalog = make_catalog(tiny_adapters(count=HOST_SHARDS + 1, rank="16")[0].parent)
    cache, gated = room_cache(catalog, HOST_SHARDS + 1)
    wanted = sorted(catalog.names())
    loads = [cache.prefetch(n) for n in wanted[:HOST_SHARDS]]
    wait_for(lambda: slots_in(cache, SlotPhase.LOADING) == HOST_SHARDS)
    waiting = in_thread(lambda: cache.acquire([wanted[-1]]))
    wait_for(lambda: len(cache.host._waiting) == 1)
    used = cache.host.arena.used_bytes
    closed = in_thread(cache.close)
    with pytest.raises(CapacityError, match=f"the host tier closed while {wanted[-1]}@"):
        waiting.result(timeout=10)
    assert not cache.host._waiting and cache.host.arena.used_bytes == used and not loads_without_slot(cache)
    gated.gate.set()  # the watcher finishes the loads in flight, then the close returns
    closed.result(timeout=30)
    assert all(f.result(timeout=10) for f in loads)
    assert all(e.refs == 0 for e in cache.host._entries.values())
    assert cache.stats()["load_failures"] == 1 and refs(cache) == dict.fromkeys(wanted[:HOST_SHARDS], 0)
    cache.check_integrity()


def test_acquire_ready_pins_only_ready_adapters_atomically(
        catalog: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """An engine's pin: references on what is READY, nothing loaded, no hit counted; held, it stays."""
    cache = make_cache(catalog, num_slots=2)
    cache.prefetch(A).result(timeout=10)
    before = cache.stats()
    pinned = cache.acquire_ready([B, A, A])
    assert pinned is not None and pinned.adapters == (A,)
    after = cache.stats()
    assert (after["gpu_hits"], after["loads"], after["demand_loads"]) == (
        before["gpu_hits"], before["loads"], before["demand_loads"])
    assert refs(cache) == {A: 1} and not cache.evict(A)  # held: it cannot be evicted
    assert cache.acquire_ready([B]) is None
    cache.release(pinned)
    assert cache.evict(A)
    cache.check_integrity()
