"""Exclusive tiers (``HostTierConfig.tiers``, the default since issue 42's tenth session): a GPU load lets go of its
host copy once READY, and a slot's eviction writes the shard back into the host tier from the slot (a device-to-host
copy in pieces on a stream of its own, no store read). Pinned here: the write-back is issued before any later copy into
that slot, the host entry is served only once its copy completed and holds the evicted version's own bytes, a
write-back that cannot be issued or whose adapter is unregistered meanwhile leaves nothing behind, a load that asks for
the shard meanwhile joins it, and a copy into the slot is reported as following the write-back (the pipelined
admission's landing estimate, the calibration fit)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import workers.gpu.loads as loads_module
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.errors import ConfigError
from lora_cache.vocab import AdapterKey, Delta
from tests.test_worker_cache import assert_host_holds, assert_serves, current, slot_of
from tests.waiting import wait_for
from tests.worker_queries import use_streams
from workers.cache import WorkerCache, WorkerConfig
from workers.gpu.streams import CpuStreams
from workers.staging.host_config import HostTierConfig

A, B, C = "adapter-000", "adapter-001", "adapter-002"


@pytest.fixture
def catalog(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    return make_catalog(tiny_adapters(count=3, rank="8,16")[0].parent)


@pytest.fixture
def make() -> Iterator[Callable[..., WorkerCache]]:
    """``make(catalog, num_slots, tiers="exclusive", deferred=False)``: a CPU cache, its deltas in ``.deltas``;
    ``deferred``: its copy stream runs copies only when a test drains it (``CpuStreams``), traced."""
    caches: list[WorkerCache] = []

    def build(catalog: AdapterCatalog, num_slots: int = 2, tiers: str = "exclusive",
              deferred: bool = False) -> WorkerCache:
        config = WorkerConfig(num_slots=num_slots, device="cpu", chunk_bytes=0,
                              host=HostTierConfig(host_bytes=1 << 20, read_threads=2, pin=False, tiers=tiers))
        cache = WorkerCache(config, catalog)
        caches.append(cache)
        deltas: list[Delta] = []
        cache.on_change = deltas.append
        cache.deltas = deltas  # type: ignore[attr-defined]
        if deferred:
            streams = CpuStreams(cache.device, deferred=True)
            streams.trace = deque(maxlen=4096)
            use_streams(cache, streams)
        return cache

    yield build
    for cache in caches:
        cache.streams.run_copies()  # a deferred stream's queued copies run (a failed test's too): close waits for them
        cache.close()


def key(cache: WorkerCache, name: str) -> AdapterKey:
    return AdapterKey(name, cache.catalog.get(name).version)


def ready(cache: WorkerCache, name: str) -> None:
    """Load ``name`` and wait until it is READY (draining a deferred copy stream meanwhile)."""
    future = cache.prefetch(name)
    drain_until(cache, future.done, f"{name} READY")
    future.result()


def drain_until(cache: WorkerCache, condition: Callable[[], Any], what: str) -> None:
    def step() -> Any:
        cache.streams.run_copies()
        return condition()

    wait_for(step, what)


def landed(cache: WorkerCache, name: str) -> None:
    drain_until(cache, lambda: cache.host.contains(key(cache, name)), f"{name} written back")


def test_a_ready_load_lets_go_of_its_host_copy_and_an_eviction_writes_the_slot_back(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache]) -> None:
    cache = make(catalog)
    ready(cache, A)
    assert not cache.host.contains(key(cache, A)), "a READY shard kept its host copy"
    assert Delta(A, key(cache, A).version, "unstaged") in cache.deltas  # type: ignore[attr-defined]
    assert cache.host.arena.used_bytes == 0
    read = cache.host.bytes_read
    assert cache.evict(A)
    landed(cache, A)
    assert cache.host.written_back == 1 and cache.stats()["host_written_back"] == 1
    assert cache.host.bytes_read == read, "a write-back read the store"
    layout, want = current(cache, A)
    assert_host_holds(cache.host._entries[key(cache, A)].tensor, layout, want)
    assert Delta(A, key(cache, A).version, "staged") in cache.deltas  # type: ignore[attr-defined]
    record = cache.prefetch(A).result(timeout=30)  # from the written-back copy: a host hit, no read
    assert record.host_hit and cache.host.bytes_read == read
    assert_serves(cache, A, record.slot)
    assert not cache.host.contains(key(cache, A))
    cache.check_integrity()


def test_the_write_back_is_issued_before_the_next_load_into_its_slot_and_served_only_once_it_completed(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache]) -> None:
    """One slot, a deferred copy stream: B's load evicts A; A's copy out of the slot must be queued before B's copies
    into it (one stream runs them in order), and A's host entry is not served while that copy has not run. Had the
    write-back been issued after B's first copy, A's entry would hold B's bytes."""
    cache = make(catalog, num_slots=1, deferred=True)
    ready(cache, A)
    assert not cache.prefetch(A).result().after_write_back  # a fresh slot: nothing to follow
    streams = cache.streams
    assert streams.trace is not None
    streams.trace.clear()
    future = cache.prefetch(B)
    wait_for(lambda: len(streams.trace) >= 2, "the write-back and B's first copy issued")  # type: ignore[arg-type]
    assert not cache.host.contains(key(cache, A)), "a write-back served before its copy ran"
    assert cache.host.reading() == 1  # in flight: a warm stage waits for it, a fetch joins it
    labels = [op[1] for op in streams.trace if op[0] == "copy"]
    assert labels[0] == ("write-back", 0, 0), f"copies issued in the order {labels}"
    assert all(label[0] == 0 for label in labels[1:])  # B's chunks, into slot 0
    # the pipelined admission's landing estimate counts the copy out that B's copies follow (CopyClock.in_time)
    wait_for(lambda: key(cache, B) in cache.issued_copies(), "every copy of B issued")
    # B's range (rank 16) covers A's (rank 8): the whole copy out, none of it run yet
    assert cache.issued_copies()[key(cache, B)][2] == cache.layout_of(A).nbytes
    drain_until(cache, future.done, "B READY")
    assert_serves(cache, B, future.result().slot)
    assert future.result().after_write_back  # its h2d_ms holds the wait: the calibration fit knows
    landed(cache, A)
    assert_host_holds(cache.host._entries[key(cache, A)].tensor, *current(cache, A))
    cache.check_integrity()


def test_each_copy_into_the_slot_waits_for_the_write_back_pieces_of_the_range_it_overwrites(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache], monkeypatch: pytest.MonkeyPatch) -> None:
    """The write-back is copied out in pieces (on a GPU: its own stream, beside the copies in), an event each; every
    chunk of the next load into that slot names, among the events it waits for, the last piece that overlaps the
    range it overwrites, so no byte of the evicted shard is overwritten before it is copied out."""
    monkeypatch.setattr(loads_module, "WRITE_BACK_PIECE_BYTES", 1)  # as many pieces as allowed, even for tiny shards
    cache = make(catalog, num_slots=1, deferred=True)
    ready(cache, A)
    streams = cache.streams
    assert streams.trace is not None
    streams.trace.clear()
    a_numel = cache.layout_of(A).numel
    future = cache.prefetch(B)
    drain_until(cache, future.done, "B READY")
    copies = [op for op in streams.trace if op[0] == "copy"]
    pieces = [(op[1][2], op[3]) for op in copies if op[1][0] == "write-back"]  # (start, event)
    assert len(pieces) == loads_module.WRITE_BACK_PIECES and pieces[0][0] == 0
    ends = [start for start, _ in pieces[1:]] + [a_numel]
    plan = cache.plan_of(B)
    ins = copies[len(pieces):]  # B's copies, each from its first chunk to the next copy's (staged chunks join)
    firsts = [op[1][1] for op in ins]
    for op, following in zip(ins, [*firsts[1:], len(plan.chunks)], strict=True):
        after, seq = op[2], op[1][1]
        stop = plan.chunks[following - 1].stop
        waited = after if isinstance(after, tuple) else (after,)
        start = plan.chunks[seq].start
        if start >= a_numel:  # past A's shard: nothing of A's to wait for (issue 43: pages A never held)
            assert not [ev for _, ev in pieces if ev in waited], f"B's copy {seq} waits for A's write-back"
            continue
        want = next((ev for end, (_, ev) in zip(ends, pieces, strict=True) if end >= stop), pieces[-1][1])
        assert want in waited, f"B's copy {seq} (to element {stop}) does not wait for the piece that covers it"
    assert_serves(cache, B, future.result().slot)
    landed(cache, A)
    assert_host_holds(cache.host._entries[key(cache, A)].tensor, *current(cache, A))
    assert not cache.book.vacating, "a READY load left its slot's write-back pieces behind"


def test_a_copys_landing_counts_the_write_back_bytes_ahead_of_its_range_and_no_others() -> None:
    """``write_back_ahead`` (what ``CopyClock`` counts a copy's landing from): the pieces being written back from the
    pool range a copy overwrites, up to the last one issued over it, and every piece issued before that still running
    (one stream, in order), none complete, none issued after; 0 once its range is out. Issue 43: a range may span
    the pages of several evicted adapters, and waits for the last of their write-backs."""
    done: set[str] = set()
    base = {3: 300, 1: 100, 0: 0, 2: 200}  # where each slot's pages start (pool elements)
    vacating = [(300, 310, "a0"), (310, 320, "a1"),  # slot 3's write-back, issued first
                (100, 110, "b0"), (110, 120, "b1"), (120, 130, "b2"), (130, 140, "b3"),  # slot 1's, then
                (0, 40, "c0")]  # issued after slot 1's: it does not hold a copy into slot 1

    def ahead(slot: int, numel: int) -> int:
        return loads_module.write_back_ahead(vacating, base[slot], base[slot] + numel, 2, done.__contains__)

    assert ahead(1, 15) == (20 + 20) * 2  # slot 3's whole write-back, then slot 1's first two pieces
    assert ahead(1, 40) == ahead(1, 99) == (20 + 40) * 2  # the whole copy out, no more
    assert ahead(3, 5) == 10 * 2 and ahead(2, 40) == 0  # slot 2: nothing to follow
    # a copy into pages that held two evicted adapters (slot 3's tail, then pages written back last) waits for both
    vacating.append((320, 330, "d0"))
    assert loads_module.write_back_ahead(vacating, 315, 325, 2, done.__contains__) == (20 + 40 + 40 + 10) * 2
    vacating.pop()
    done.update({"a0", "b0"})
    assert ahead(1, 15) == (10 + 10) * 2  # complete pieces are not counted
    done.update({"a1", "b1"})
    assert ahead(1, 15) == 0 and ahead(1, 40) == 20 * 2  # its range is out; a longer copy still waits
    done.update({"b2", "b3"})
    assert ahead(1, 40) == 0 and ahead(0, 40) == 40 * 2


def test_a_load_that_asks_for_a_shard_being_written_back_joins_the_copy(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache]) -> None:
    cache = make(catalog, deferred=True)
    ready(cache, A)
    read, hits = cache.host.bytes_read, cache.host.hits
    assert cache.evict(A)
    assert not cache.host.contains(key(cache, A))
    future = cache.prefetch(A)  # the write-back is queued, not run: the load waits for it, with no read of its own
    assert cache.host.hits == hits + 1
    drain_until(cache, future.done, "A READY again")
    record = future.result()
    assert record.host_hit and cache.host.bytes_read == read
    assert_serves(cache, A, record.slot)
    cache.check_integrity()


@pytest.mark.parametrize("fails_at", [0, 1])
def test_a_write_back_that_cannot_be_issued_leaves_the_host_tier_as_it_was(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache], monkeypatch: pytest.MonkeyPatch,
        fails_at: int) -> None:
    """The copy out refused at its first piece, or after one was issued (that one is waited for before the tier
    frees the block it wrote into)."""
    monkeypatch.setattr(loads_module, "WRITE_BACK_PIECE_BYTES", 1)
    cache = make(catalog)
    ready(cache, A)
    ready(cache, B)
    cache.stage(C).result(timeout=30)  # an idle entry the write-back would not need to displace
    before = (cache.host.contents(), cache.host.arena.used_bytes)
    real_copy = cache.streams.copy_back
    issued: list[object] = []

    def failing(dst: Any, src: Any, label: object = None) -> Any:
        if len(issued) == fails_at:
            raise RuntimeError("copy refused (the test's fault)")
        issued.append(label)
        return real_copy(dst, src, label=label)

    monkeypatch.setattr(cache.streams, "copy_back", failing)
    assert cache.evict(A)  # the eviction itself goes ahead, as it would without exclusive tiers
    assert (cache.host.contents(), cache.host.arena.used_bytes) == before
    assert cache.host.written_back == 0 and slot_of(cache, A) is None and len(issued) == fails_at
    assert not cache.book.vacating  # nothing for the next load into the slot to wait for
    monkeypatch.undo()
    record = cache.prefetch(A).result(timeout=30)  # read from its file again: right bytes
    assert not record.host_hit
    assert_serves(cache, A, record.slot)
    cache.check_integrity()


def test_an_adapter_unregistered_while_its_shard_is_written_back_is_never_served(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache]) -> None:
    cache = make(catalog, deferred=True)
    ready(cache, A)
    assert cache.evict(A)
    k = key(cache, A)
    catalog.unregister(A)
    assert cache.host.drop_adapter(A) == 0  # in flight: its block is freed once the copy completed
    drain_until(cache, lambda: cache.host.arena.used_bytes == 0, "the write-back's block freed once its copy ran")
    assert not cache.host.contains(k) and k not in cache.host.contents()
    cache.check_integrity()
    ready(cache, B)
    b = key(cache, B)
    catalog.unregister(B)
    assert cache.evict(B, b.version)  # a slot of an adapter no longer registered is not written back at all
    assert cache.host.written_back == 1 and cache.host.arena.used_bytes == 0
    cache.check_integrity()


def test_inclusive_tiers_keep_the_host_copy_and_write_nothing_back(
        catalog: AdapterCatalog, make: Callable[..., WorkerCache]) -> None:
    cache = make(catalog, tiers="inclusive")
    ready(cache, A)
    assert cache.host.contains(key(cache, A))
    assert cache.evict(A)
    assert cache.host.written_back == 0 and cache.host.contains(key(cache, A))


def test_tiers_must_be_named() -> None:
    with pytest.raises(ConfigError, match="tiers 'both' is not one of inclusive, exclusive"):
        HostTierConfig(tiers="both")
