"""The host tier: hits/misses, eviction by bytes (read-once entries first, then LRU), references, capacity,
single-flight reads, failures."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import workers.staging.tier_reads as tier_reads_module
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shapes import SHAPES
from lora_cache.adapters.shards import ShardLayout, shard_layout
from lora_cache.errors import AdapterChangedError, AdapterFormatError, CapacityError, ConfigError
from lora_cache.vocab import AdapterKey
from tests.waiting import wait_for
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostEntry, HostTier

TINY = SHAPES["tiny"]
MiB = 1 << 20
F32 = torch.float32  # rank 16 in float32: 128 KiB per shard, 8 fill the 1 MiB tier; rank 8: 64 KiB


@pytest.fixture
def catalog(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> AdapterCatalog:
    paths = tiny_adapters(count=10, rank="16", prefix="big")
    tiny_adapters(count=16, rank="8", prefix="small", seed=1)
    return make_catalog(paths[0].parent)


@contextlib.contextmanager
def open_tier(reads: str, threads: int, parallel: int = 0, eviction: str = "lru",
              recent_s: float = 10.0) -> Iterator[HostTier]:
    """A 1 MiB unpinned tier reading on its threads or in reader processes that share its arena, each read
    split over ``parallel`` threads (0: the default); closed on the way out."""
    tier = HostTier(HostTierConfig(host_bytes=MiB, read_threads=threads, pin=False, reads=reads,
                                   read_parallel=parallel, eviction=eviction, recent_s=recent_s))
    try:
        assert tier.reads == reads
        if reads == "process":  # every reader process up first (a bound, not a timing: they start slowly on a
            # loaded 2-core CI; a first read given 10 s once timed out there), so the tests' bounds are the reads'
            wait_for(lambda: all(p.warm() for p in tier._reader._all), "the reader processes to start", 120)
        yield tier
    finally:
        tier.close()


@pytest.fixture(params=["thread", "process"])
def tier(request: pytest.FixtureRequest) -> Iterator[HostTier]:
    with open_tier(request.param, 4 if request.param == "thread" else 2) as tier:
        yield tier


@pytest.fixture
def thread_tier() -> Iterator[HostTier]:
    """For the tests that gate ``read_shard`` in this process."""
    with open_tier("thread", 4) as tier:
        yield tier


def big(catalog: AdapterCatalog, i: int) -> AdapterSpec:
    return catalog.get(f"big-{i:03d}")


def small(catalog: AdapterCatalog, i: int) -> AdapterSpec:
    return catalog.get(f"small-{i:03d}")


def layout(spec: AdapterSpec, dtype: torch.dtype = F32) -> ShardLayout:
    return shard_layout(spec, TINY, 1, 0, dtype)


def key(spec: AdapterSpec) -> AdapterKey:
    return AdapterKey(spec.name, spec.version)


def staged(tier: HostTier, spec: AdapterSpec, release: bool = True) -> HostEntry:
    future, _ = tier.fetch(spec, layout(spec))
    entry = future.result(timeout=120)  # a bound, not a timing: reader processes start slowly on a loaded 2-core CI
    if release:
        tier.release(key(spec))
    return entry


def assert_holds(entry: HostEntry, spec: AdapterSpec, file_slices: Callable) -> None:
    for e in entry.layout.entries:
        got = entry.tensor[e.offset : e.offset + e.numel].view(e.shape)
        assert torch.equal(got, file_slices(spec, entry.layout)[(e.layer, e.module, e.ab)]), e.key


def resident(tier: HostTier) -> list[str]:
    return [k.name for k in tier._entries]


def test_miss_then_hit(catalog: AdapterCatalog, tier: HostTier, file_slices: Callable) -> None:
    spec = big(catalog, 0)
    future, hit = tier.fetch(spec, layout(spec))
    assert not hit
    entry = future.result(timeout=10)
    assert entry.key == key(spec) and entry.refs == 1 and entry.tensor.numel() == layout(spec).numel
    assert entry.tensor.dtype == F32 and entry.bytes_read == sum(e.numel for e in entry.layout.entries) * 2
    assert (tier.hits, tier.misses, tier.bytes_read) == (0, 1, entry.bytes_read)
    assert tier.contains(key(spec)) and not tier.contains(key(big(catalog, 1)))
    assert_holds(entry, spec, file_slices)
    tier.release(key(spec))
    assert entry.refs == 0
    again, hit = tier.fetch(spec, layout(spec))
    assert hit and again.result(timeout=10) is entry and entry.refs == 1
    assert (tier.hits, tier.misses, tier.bytes_read) == (1, 1, entry.bytes_read)  # a hit reads nothing
    assert tier.arena.used_bytes == entry.block.nbytes == 128 << 10
    tier.check_integrity()


def test_lru_eviction_order(catalog: AdapterCatalog, tier: HostTier) -> None:
    for i in range(8):
        staged(tier, big(catalog, i))
    assert tier.arena.used_bytes == MiB
    staged(tier, big(catalog, 0))  # a hit makes big-000 the most recently used
    assert resident(tier) == [f"big-{i:03d}" for i in (1, 2, 3, 4, 5, 6, 7, 0)]
    staged(tier, big(catalog, 8))
    assert resident(tier) == [f"big-{i:03d}" for i in (2, 3, 4, 5, 6, 7, 0, 8)]  # big-001, the LRU, went
    staged(tier, big(catalog, 9))
    assert not tier.contains(key(big(catalog, 2))) and tier.contains(key(big(catalog, 0)))
    assert (tier.misses, tier.hits) == (10, 1)
    tier.check_integrity()


@pytest.fixture
def segmented() -> Iterator[HostTier]:
    with open_tier("thread", 4, eviction="segmented") as tier:
        yield tier


def test_a_shard_read_once_goes_before_one_used_again_or_warmed_then_the_oldest_protected(
    catalog: AdapterCatalog, segmented: HostTier
) -> None:
    """Scan resistance (``eviction="segmented"``): tail reads never push out a copy used twice or a warm stage's
    copy while a read-once copy is idle; with none left, the oldest protected copy goes (nothing is kept forever)."""
    tier = segmented
    staged(tier, big(catalog, 0))
    with tier.demand.speculative():
        staged(tier, big(catalog, 1))  # a warm stage's copy
    for i in range(2, 8):
        staged(tier, big(catalog, i))
    staged(tier, big(catalog, 0))  # used again
    assert [tier._entries[key(big(catalog, i))].protected for i in range(8)] == [True, True] + [False] * 6
    for i in (8, 9):  # two tail reads: each pushes out the oldest read-once copy, not the older protected ones
        staged(tier, big(catalog, i))
    assert resident(tier) == [f"big-{i:03d}" for i in (1, 4, 5, 6, 7, 0, 8, 9)]
    assert tier.order.ghosts() == [key(big(catalog, 2)), key(big(catalog, 3))]
    for i in range(10, 16):  # small ones, read once: the oldest read-once big ones (4, 5, 6) make room
        staged(tier, small(catalog, i))
    assert resident(tier) == ["big-001", "big-007", "big-000", "big-008", "big-009"] + \
        [f"small-{i:03d}" for i in range(10, 16)]
    for name in resident(tier)[1:]:  # all used again: every copy is protected now
        staged(tier, catalog.get(name))
    protected = [k for k, e in tier._entries.items() if e.protected]
    assert len(protected) == len(tier._entries) and protected[0] == key(big(catalog, 1))
    staged(tier, big(catalog, 2))  # came back: the ghost history makes it protected, and room is made from the oldest
    assert tier._entries[key(big(catalog, 2))].protected and tier.order.returned == 1
    assert not tier.contains(protected[0]) and key(big(catalog, 2)) not in tier.order.ghosts()
    tier.check_integrity()


def test_an_unregistered_adapter_leaves_the_ghost_history(catalog: AdapterCatalog, segmented: HostTier) -> None:
    tier = segmented
    for i in range(9):
        staged(tier, big(catalog, i))
    assert tier.order.ghosts() == [key(big(catalog, 0))]
    tier.drop_adapter("big-000")
    assert tier.order.ghosts() == []
    staged(tier, big(catalog, 0))  # registered again, it starts read-once
    assert not tier._entries[key(big(catalog, 0))].protected and tier.order.returned == 0
    tier.check_integrity()


@pytest.mark.parametrize("recent_s", [0.0, 3600.0])
def test_popular_lets_go_of_the_least_asked_for_shard_first_and_is_lru_until_ranked(
    catalog: AdapterCatalog, recent_s: float
) -> None:
    """``eviction="popular"``: with no ranking the LRU's order; ranked, the unranked and then the lowest ranked idle
    shard go first, a fetch refreshing nothing; a referenced one never. With the window (an hour: every entry
    touched lately) the ranking still orders them; with none (0) a new read is unranked until ranked. The same
    sequence as tests/test_eviction_order.py's simulator test."""
    with open_tier("thread", 4, eviction="popular", recent_s=recent_s) as tier:
        names = lambda *ix: [f"big-{i:03d}" for i in ix]  # noqa: E731
        for i in range(9):  # unranked: the LRU's victim (big-000) makes room for the ninth
            staged(tier, big(catalog, i))
        assert resident(tier) == names(*range(1, 9))
        tier.order.ranked(names(3, 1, 8, 6, 2))  # 4, 5, 7 not ranked
        for i in (9, 0):  # the unranked go first, oldest first
            staged(tier, big(catalog, i))
        assert resident(tier) == names(1, 2, 3, 6, 7, 8, 9, 0)
        entry = staged(tier, big(catalog, 9), release=False)  # a hit, and referenced: never a victim
        tier.order.ranked(names(3, 1, 6, 8, 0, 2))  # 7 and 9 not ranked
        staged(tier, big(catalog, 4))  # 7 goes
        staged(tier, big(catalog, 5))  # a new read is unranked until ranked: 4 goes
        assert resident(tier) == names(1, 2, 3, 6, 8, 0, 9, 5)
        tier.order.ranked(names(3, 1, 6, 8, 0, 5, 2))
        staged(tier, big(catalog, 4))  # 9 is not ranked but held: the lowest ranked idle one (2) goes
        assert resident(tier) == names(1, 3, 6, 8, 0, 9, 5, 4)
        tier.release(entry.key)
        assert tier.order.ranking() == names(3, 1, 6, 8, 0, 5, 2) and tier.order.rankings == 3
        tier.check_integrity()


def test_eviction_is_by_bytes(catalog: AdapterCatalog, tier: HostTier) -> None:
    """A 128 KiB shard into a full tier of 64 KiB shards evicts LRU entries until a range fits."""
    for i in range(16):
        staged(tier, small(catalog, i))
    assert tier.arena.used_bytes == MiB
    staged(tier, small(catalog, 0))  # small-000 (offset 0) is now the most recent
    entry = staged(tier, big(catalog, 0))
    gone = [f"small-{i:03d}" for i in range(16) if not tier.contains(key(small(catalog, i)))]
    assert gone == ["small-001", "small-002"]  # exactly the two oldest, adjacent: 128 KiB
    assert entry.block.offset == 64 << 10 and tier.arena.used_bytes == MiB
    staged(tier, small(catalog, 4))  # LRU now small-003, small-005, small-006, ...
    entry = staged(tier, big(catalog, 1))
    gone = [f"small-{i:03d}" for i in range(16) if not tier.contains(key(small(catalog, i)))]
    # small-003 alone leaves a 64 KiB hole between small-004 and small-005: LRU order goes on to 005 and 006
    assert gone == ["small-001", "small-002", "small-003", "small-005", "small-006"]
    assert entry.block.offset == 5 * (64 << 10) and tier.arena.used_bytes == MiB - (64 << 10)
    tier.check_integrity()


def test_referenced_entries_are_never_evicted(
    catalog: AdapterCatalog, tier: HostTier, file_slices: Callable
) -> None:
    held = [staged(tier, big(catalog, i), release=False) for i in range(4)]  # the oldest four keep refs
    for i in range(4, 8):
        staged(tier, big(catalog, i))
    staged(tier, big(catalog, 8))
    staged(tier, big(catalog, 9))
    assert resident(tier) == [
        "big-000",
        "big-001",
        "big-002",
        "big-003",
        "big-006",
        "big-007",
        "big-008",
        "big-009",
    ]
    for i, entry in enumerate(held):
        assert entry.refs == 1
        assert_holds(entry, big(catalog, i), file_slices)  # their bytes were not reused
    tier.check_integrity()


def test_capacity_error_when_everything_is_referenced(catalog: AdapterCatalog, tier: HostTier) -> None:
    for i in range(8):
        staged(tier, big(catalog, i), release=False)
    before = (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.misses, tier.hits)
    spec = big(catalog, 8)
    with pytest.raises(CapacityError) as e:
        tier.fetch(spec, layout(spec))
    msg = str(e.value)
    assert f"host tier ({MiB} bytes)" in msg and str(key(spec)) in msg and "(131072 bytes)" in msg
    assert f"{MiB} bytes are held" in msg and "raise host_bytes" in msg
    assert (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.misses, tier.hits) == before
    tier.release(key(big(catalog, 3)))  # one reference dropped: now it fits, evicting exactly that one
    staged(tier, spec)
    assert not tier.contains(key(big(catalog, 3))) and tier.contains(key(spec))
    tier.check_integrity()


def test_waiting_fetches_are_admitted_oldest_first_as_references_are_dropped(
    catalog: AdapterCatalog, tier: HostTier, file_slices: Callable
) -> None:
    """``wait``: a miss that finds every byte held waits (FIFO) instead of raising; the head of the line is
    not passed by a smaller shard behind it, nor by a fetch that does not wait (a stage)."""
    held = [big(catalog, i) for i in range(7)] + [small(catalog, i) for i in range(2)]  # 7 x 128 + 2 x 64 KiB
    for spec in held:
        staged(tier, spec, release=False)
    head, behind = big(catalog, 8), small(catalog, 2)
    first, hit = tier.fetch(head, layout(head), wait=True)
    assert not hit and not first.done() and (tier.waits, tier.misses) == (1, 10)
    again, hit = tier.fetch(head, layout(head))  # single flight: joins the waiting fetch
    assert hit and again is first and tier.hits == 1
    second, _ = tier.fetch(behind, layout(behind), wait=True)
    assert list(tier._waiting) == [key(head), key(behind)] and tier.waits == 2
    tier.check_integrity()
    tier.release(key(held[7]))  # 64 KiB idle: not enough for the head, and the small shard does not pass it
    assert list(tier._waiting) == [key(head), key(behind)] and not second.done()
    spare = small(catalog, 3)
    with pytest.raises(CapacityError, match="held by loads in flight"):  # nor does a fetch that does not wait
        tier.fetch(spare, layout(spare))
    assert tier.contains(key(held[7])) and tier.waits == 2  # the refused fetch evicted nothing
    tier.release(key(held[8]))  # 128 KiB idle: the head's room
    entry = first.result(timeout=10)
    assert entry.refs == 2 and not second.done() and list(tier._waiting) == [key(behind)]
    assert_holds(entry, head, file_slices)
    assert not tier.contains(key(held[7])) and not tier.contains(key(held[8]))
    tier.release(key(held[0]))  # the oldest idle entry makes the next one's room
    assert_holds(second.result(timeout=10), behind, file_slices)
    assert not tier._waiting and not tier.contains(key(held[0])) and tier.misses == 11
    for spec in [*held[1:7], head, head, behind]:
        tier.release(key(spec))
    tier.check_integrity()


def test_a_shard_larger_than_the_tier_fails_at_once(
    tmp_path: Path, catalog: AdapterCatalog, tier: HostTier, tiny_adapters: Callable[..., list[Path]],
    make_catalog: Callable[..., AdapterCatalog]
) -> None:
    """Waiting could never help: the error names the adapter, its bytes, the tier's, and the fix."""
    root = tiny_adapters(count=1, rank="256", prefix="huge", root=tmp_path / "huge")[0].parent
    spec = make_catalog(root, max_rank=256).get("huge-000")  # rank 256 in float32: 2 MiB
    staged(tier, big(catalog, 0), release=False)
    before = (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.misses, tier.hits)
    for wait in (False, True):
        with pytest.raises(CapacityError) as e:
            tier.fetch(spec, layout(spec), wait=wait)
        msg = str(e.value)
        assert f"host tier ({MiB} bytes) can never stage {key(spec)}" in msg
        assert f"its shard ({2 * MiB} bytes) is larger than the whole tier" in msg
        assert f"raise host_bytes to at least {2 * MiB} bytes" in msg
    assert (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.misses, tier.hits) == before
    assert not tier._waiting and tier.waits == 0
    tier.release(key(big(catalog, 0)))
    tier.check_integrity()


def test_cancelled_waits_fail_and_hold_nothing(catalog: AdapterCatalog, tier: HostTier) -> None:
    """Closing: every waiting fetch fails (it holds no block), and no new fetch waits."""
    for i in range(8):
        staged(tier, big(catalog, i), release=False)
    before = (resident(tier), list(tier.arena._free), dict(tier.arena._used))
    waiting, _ = tier.fetch(big(catalog, 8), layout(big(catalog, 8)), wait=True)
    tier.cancel_waits()
    with pytest.raises(CapacityError, match=f"the host tier closed while {key(big(catalog, 8))} waited for room"):
        waiting.result(timeout=10)
    with pytest.raises(CapacityError, match="held by loads in flight"):
        tier.fetch(big(catalog, 9), layout(big(catalog, 9)), wait=True)
    assert (resident(tier), list(tier.arena._free), dict(tier.arena._used)) == before and not tier._waiting
    for i in range(8):
        tier.release(key(big(catalog, i)))
    tier.check_integrity()


@pytest.mark.parametrize("threads", [2, 8])
def test_single_flight(
    catalog: AdapterCatalog, thread_tier: HostTier, gated_reads: tuple[threading.Event, list[str]], threads: int
) -> None:
    tier = thread_tier
    gate, reads = gated_reads
    spec = big(catalog, 0)
    barrier = threading.Barrier(threads)
    results: list[tuple[Future[HostEntry], bool]] = []
    lock = threading.Lock()

    def fetch() -> None:
        barrier.wait(timeout=10)
        got = tier.fetch(spec, layout(spec))
        with lock:
            results.append(got)

    workers = [threading.Thread(target=fetch) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=10)
    assert len(results) == threads
    assert not tier.contains(key(spec))  # the read is still in flight
    gate.set()
    entries = {id(f.result(timeout=10)) for f, _ in results}
    assert len({id(f) for f, _ in results}) == 1 and len(entries) == 1  # one future, one entry
    assert sorted(hit for _, hit in results) == [False] + [True] * (threads - 1)
    assert reads == [spec.name]  # exactly one read
    assert (tier.misses, tier.hits) == (1, threads - 1)
    entry = results[0][0].result()
    assert tier.bytes_read == entry.bytes_read == sum(e.numel for e in entry.layout.entries) * 2
    assert entry.refs == threads
    for _ in range(threads):
        tier.release(key(spec))
    assert entry.refs == 0 and tier.contains(key(spec))
    tier.check_integrity()


@pytest.mark.parametrize("damage", ["truncate", "same-size", "delete"])
def test_failed_read_leaves_the_arena_as_it_was(catalog: AdapterCatalog, tier: HostTier, damage: str) -> None:
    for i in range(3):
        staged(tier, big(catalog, i))
    staged(tier, big(catalog, 1), release=False)
    spec = big(catalog, 5)
    data = spec.weights.read_bytes()
    if damage == "truncate":
        spec.weights.write_bytes(data[: len(data) // 2])
    elif damage == "same-size":
        spec.weights.write_bytes(b"\xff" * len(data))
    else:
        spec.weights.unlink()
    before = (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read)
    future, hit = tier.fetch(spec, layout(spec))
    assert not hit
    with pytest.raises(AdapterChangedError) as e:  # the class survives the reader process's boundary
        future.result(timeout=10)
    assert str(spec.weights) in str(e.value)
    assert {"truncate": "changed size", "same-size": "its bytes are not the ones registered", "delete": "is gone"}[
        damage
    ] in str(e.value)
    assert (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read) == before
    assert not tier.contains(key(spec)) and tier.misses == 4
    tier.check_integrity()
    spec.weights.write_bytes(data)  # repaired (same bytes, a new mtime): the next fetch is a fresh miss and succeeds
    assert staged(tier, spec).bytes_read > 0 and tier.contains(key(spec)) and tier.misses == 5
    tier.check_integrity()


def test_failed_read_fails_every_waiter(
    catalog: AdapterCatalog, thread_tier: HostTier, gated_reads: tuple[threading.Event, list[str]]
) -> None:
    tier = thread_tier
    gate, reads = gated_reads
    spec = big(catalog, 0)
    used = tier.arena.used_bytes
    futures = [tier.fetch(spec, layout(spec))[0] for _ in range(3)]
    spec.weights.write_bytes(b"")  # the file shrinks while the read is queued
    gate.set()
    for f in futures:
        with pytest.raises(AdapterFormatError, match="changed size"):
            f.result(timeout=10)
    assert reads == [spec.name] and tier.arena.used_bytes == used and not tier._entries
    tier.check_integrity()


def test_release_errors(catalog: AdapterCatalog, thread_tier: HostTier) -> None:
    tier = thread_tier
    spec = big(catalog, 0)
    staged(tier, spec)
    with pytest.raises(AssertionError, match="released more often than fetched"):
        tier.release(key(spec))
    with pytest.raises(KeyError):
        tier.release(AdapterKey("nope", "0"))
    assert tier._entries[key(spec)].refs == 0


def test_the_default_order_is_lru_even_for_warm_stages(catalog: AdapterCatalog, thread_tier: HostTier) -> None:
    with thread_tier.demand.speculative():
        staged(thread_tier, big(catalog, 0))  # a warm stage's copy
    for i in range(1, 9):
        staged(thread_tier, big(catalog, i))
    assert not thread_tier.contains(key(big(catalog, 0))) and thread_tier.order.ghosts() == []
    assert not any(e.protected for e in thread_tier._entries.values())


def test_host_tier_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"host_bytes \(1000\) must be at least 1 MiB"):
        HostTierConfig(host_bytes=1000)
    with pytest.raises(ConfigError, match=r"read_threads must be in 1\.\.64, got 0"):
        HostTierConfig(read_threads=0)
    with pytest.raises(ConfigError, match=r"reads 'fork' is not one of auto, thread, process"):
        HostTierConfig(reads="fork")
    with pytest.raises(ConfigError, match=r"eviction 'lfu' is not one of lru, popular, segmented"):
        HostTierConfig(eviction="lfu")
    assert HostTierConfig().reads_for(pinned=True) == "process" and HostTierConfig().reads_for(pinned=False) == "thread"
    assert HostTierConfig(reads="thread").reads_for(pinned=True) == "thread"


# -- reader processes ------------------------------------------------------------------------------
@pytest.fixture(params=[1, 4], ids=["one-reader", "four-readers"])
def process_tier(request: pytest.FixtureRequest) -> Iterator[HostTier]:
    """One reader process; a read in one thread of it, or split over four."""
    with open_tier("process", 1, request.param) as tier:
        assert tier.parallel == request.param
        yield tier


@pytest.mark.parametrize("tp", [1, 2])
def test_process_reads_convert_and_slice_like_thread_reads(
    catalog: AdapterCatalog, process_tier: HostTier, file_slices: Callable, tp: int
) -> None:
    """A reader process writes into the arena the worker maps: the same values a thread reads, at each TP
    rank, the bf16 file converted to an fp32 shard, and only this rank's slices counted as read."""
    spec = big(catalog, 0)
    for rank in range(tp):
        lay = shard_layout(spec, TINY, tp, rank, F32)
        with open_tier("process", 1, process_tier.parallel) as tier:
            entry = tier.fetch(spec, lay)[0].result(timeout=120)
            expected = torch.zeros(lay.numel, dtype=F32)
            assert tier_reads_module.read_shard(spec, lay, expected) == entry.bytes_read
            assert torch.equal(entry.tensor, expected)
            assert entry.bytes_read == sum(e.numel for e in lay.entries) * 2  # a bf16 file
            for e in lay.entries:
                want = file_slices(spec, lay)[(e.layer, e.module, e.ab)]
                assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape), want), e.key
            tier.check_integrity()


def test_a_reader_process_that_dies_mid_read_fails_only_that_read(
    catalog: AdapterCatalog, process_tier: HostTier
) -> None:
    """The process is stopped, the job sent (a barrier on the send), then it is killed: the read fails
    with an error naming the file and the signal, the tier is as it was, and the next read starts a
    new process and succeeds."""
    tier = process_tier
    staged(tier, big(catalog, 0))  # the process is up
    (proc,) = tier._reader._all
    pid = proc.pid
    assert pid is not None
    before = (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read)
    sent = threading.Event()
    conn = proc._conn
    assert conn is not None
    real_send = conn.send

    def send(obj: object) -> None:
        real_send(obj)
        sent.set()

    conn.send = send  # type: ignore[method-assign]
    os.kill(pid, signal.SIGSTOP)
    spec = big(catalog, 1)
    future, hit = tier.fetch(spec, layout(spec))
    assert not hit and sent.wait(timeout=10)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(AdapterFormatError) as e:
        future.result(timeout=30)
    assert str(spec.weights) in str(e.value) and "killed by SIGKILL" in str(e.value)
    assert "re-copy it and register again" in str(e.value)
    assert (resident(tier), list(tier.arena._free), dict(tier.arena._used), tier.bytes_read) == before
    tier.check_integrity()
    assert staged(tier, spec).bytes_read > 0 and proc.pid not in (None, pid) and proc.restarts == 1
    tier.check_integrity()


def test_a_reader_process_that_died_idle_is_replaced_without_an_error(
    catalog: AdapterCatalog, process_tier: HostTier, file_slices: Callable
) -> None:
    tier = process_tier
    staged(tier, big(catalog, 0))
    (proc,) = tier._reader._all
    pid = proc.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert proc._proc is not None and proc._proc.wait(timeout=10) == -signal.SIGKILL  # dead before the next read
    entry = staged(tier, big(catalog, 1))
    assert_holds(entry, big(catalog, 1), file_slices)
    assert proc.restarts == 1 and proc.pid != pid


def test_closing_the_tier_ends_its_reader_processes(catalog: AdapterCatalog) -> None:
    with open_tier("process", 2) as tier:
        staged(tier, big(catalog, 0))
        procs = [p._proc for p in tier._reader._all]
    assert all(p is not None and p.poll() is not None for p in procs)
    assert tier.arena.fd is None
