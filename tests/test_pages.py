"""Issue 43: adapter memory in pages. A slot holds a run of contiguous pages, as many as its own rank needs; the
pool's bytes hold more small adapters than slots of the largest rank did; a load into pages that held several
adapters waits for every batch that read any of them and for each one's write-back; no page is ever shared by two
live adapters (a state machine of reserve / ready / fail / acquire / release / evict / lend / reclaim against a
brute-force model); bad settings are clear errors before anything is allocated. A pool that breathes (item 3): pages
lent to the engine are never placed under a load, never taken from a loading or in-use adapter, and the engine's
writes follow the last batch that read them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.errors import CapacityError, ConfigError
from lora_cache.vocab import AdapterKey
from tests.test_exclusive_tiers import drain_until
from tests.test_worker_cache import assert_host_holds, assert_slot_holds, current
from tests.worker_queries import use_streams
from workers.cache import WorkerCache, WorkerConfig
from workers.gpu.slots import SlotPhase, SlotTable
from workers.gpu.streams import CpuStreams
from workers.kernels.meta import BatchMeta
from workers.kernels.reference import lora_apply_ref
from workers.staging.host_config import HostTierConfig

SMALL, LARGE = 16, 64  # the mix: most tenants at rank 16, a few at 64


@pytest.fixture
def mixed(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    """Six rank-16 adapters (000-002, 004-006) and two rank-64 ones (003, 007); max_rank 64."""
    return make_catalog(tiny_adapters(count=8, rank=f"{SMALL},{SMALL},{SMALL},{LARGE}")[0].parent, max_rank=LARGE)


def rank_of(catalog: AdapterCatalog, name: str) -> int:
    return max(m.rank for m in catalog.get(name).modules)


def small_and_large(catalog: AdapterCatalog) -> tuple[list[str], list[str]]:
    names = catalog.names()
    return [n for n in names if rank_of(catalog, n) == SMALL], [n for n in names if rank_of(catalog, n) == LARGE]


def test_a_paged_pool_holds_four_times_the_small_adapters_in_the_bytes_of_the_slots(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """The 16/64 mix at equal GPU bytes: two slots of the largest rank hold two rank-16 adapters; the same bytes
    in pages of rank 16 hold eight of them (or a rank-64 one and four rank-16 ones), each serving its own bytes."""
    small, large = small_and_large(mixed)
    slots = make_cache(mixed, num_slots=2, host_bytes=8 << 20)
    paged = make_cache(mixed, num_slots=8, page_rank=SMALL, pool_pages=8, host_bytes=8 << 20)
    assert paged.pool_bytes == slots.pool_bytes and paged.page_numel * 4 == slots.slot_numel
    for cache in (slots, paged):
        for name in small:
            cache.prefetch(name).result(timeout=30)
        cache.settle()
    assert len(slots.ready_keys()) == 2 and len(paged.ready_keys()) == len(small) == 6
    for r in paged.residency():
        assert_slot_holds(paged, r["slot"], *current(paged, r["adapter"]))  # type: ignore[arg-type]
    # 4 contiguous pages: the run whose newest evicted adapter was least recently used (pages 0-3: the four oldest),
    # not the one with fewest (pages 4-7: the two newest, beside the two free pages)
    paged.prefetch(large[0]).result(timeout=30)
    paged.settle()
    held = {r["adapter"]: r["slot"] for r in paged.residency()}
    assert set(held) == {large[0], *small[4:]} and paged.book.table.free_pages() == 2
    for name, slot in held.items():
        assert_slot_holds(paged, slot, *current(paged, name))
    paged.check_integrity()


def test_a_load_over_several_evicted_adapters_waits_for_each_ones_last_batch_and_write_back(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """Invariant 2 in pages: a rank-64 load into the pages of four rank-16 adapters issues its first copy after the
    event of every batch that read any of them, and each copy after the write-back pieces of the range it
    overwrites; the evicted shards reach the host tier intact, and the new one serves its own bytes."""
    small, large = small_and_large(mixed)
    cache = make_cache(mixed, num_slots=4, page_rank=SMALL, pool_pages=4, chunk_bytes=0, host_bytes=8 << 20)
    streams = CpuStreams(cache.device, deferred=True)
    streams.trace = deque(maxlen=4096)
    use_streams(cache, streams)
    for name in small[:4]:
        batch = cache.acquire([name])
        cache.release(batch)
    drain_until(cache, lambda: len(cache.ready_keys()) == 4, "four rank-16 adapters READY")
    releases = [op[2] for op in streams.trace if op[0] == "compute"]
    assert len(releases) == 4
    streams.trace.clear()
    future = cache.prefetch(large[0])
    drain_until(cache, future.done, "the rank-64 adapter READY")
    record = future.result()
    ops = list(streams.trace)
    backs = [(op[1][1], op[3]) for op in ops if op[0] == "copy" and op[1][0] == "write-back"]
    ins = [op for op in ops if op[0] == "copy" and op[1][0] != "write-back"]
    assert {slot for slot, _ in backs} == {0, 1, 2, 3}, "each evicted adapter is written back"
    first = ins[0][2] if isinstance(ins[0][2], tuple) else (ins[0][2],)
    assert all(any(e is r for e in first) for r in releases), "the first copy waits for every page's last batch"
    assert ops.index(ins[0]) > max(ops.index(op) for op in ops if op[0] == "copy" and op[1][0] == "write-back")
    assert_slot_holds(cache, record.slot, *current(cache, large[0]))
    for name in small[:4]:
        drain_until(cache, lambda n=name: cache.host.contains(AdapterKey(n, mixed.get(n).version)), f"{name} back")
        assert_host_holds(cache.host._entries[AdapterKey(name, mixed.get(name).version)].tensor,
                          *current(cache, name))
    assert not cache.book.vacating, "the write-backs over its pages completed before it was READY"
    cache.check_integrity()


def test_a_held_page_blocks_the_run_through_it_and_nothing_changes(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """A rank-64 load finds every run of four pages crossing a page a batch holds: it fails clearly, naming the
    pages, and the resident adapters (held or not) stay as they were."""
    small, large = small_and_large(mixed)
    cache = make_cache(mixed, num_slots=4, page_rank=SMALL, pool_pages=4, host_bytes=8 << 20)
    for name in small[:4]:
        cache.prefetch(name).result(timeout=30)
    cache.settle()
    batch = cache.acquire([small[2]])  # one page held: no run of four is free or idle
    before = sorted((r["adapter"], r["slot"]) for r in cache.residency())
    with pytest.raises(CapacityError, match=r"no run of 4 of the 4 pages is free or idle"):
        cache.acquire([large[0]])
    assert sorted((r["adapter"], r["slot"]) for r in cache.residency()) == before
    cache.release(batch)
    cache.prefetch(large[0]).result(timeout=30)  # released: the run is idle now
    cache.check_integrity()


def test_the_kernels_read_each_adapter_at_its_own_rank_from_its_pages(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """The LoRA delta the kernels' twin computes from a paged pool is each adapter's own ``x @ A.T @ B.T * scale``,
    for a batch mixing rank-16 and rank-64 adapters in runs of pages (the kernels read the same offsets)."""
    small, large = small_and_large(mixed)
    cache = make_cache(mixed, num_slots=4, page_rank=SMALL, pool_pages=8, dtype="float32", host_bytes=8 << 20)
    chosen = [small[0], large[0], small[1]]
    batch = cache.acquire(chosen)
    gen = torch.Generator().manual_seed(0)
    module, layer = "q_proj", 1
    d_in, d_out = cache.meta.dims[module]
    x = torch.randn(6, d_in, generator=gen)
    y = torch.zeros(6, d_out)
    meta = BatchMeta(6, 6, cache.device, num_slots=4)
    meta.set_segments([2, 2, 2], batch.slots)
    lora_apply_ref(x, y, cache.pool, cache.meta, meta, layer, [module])
    for i, (name, slot) in enumerate(zip(chosen, batch.slots, strict=True)):
        _, want = current(cache, name)
        a, b = want[(layer, module, "A")].float(), want[(layer, module, "B")].float()
        scale = next(m.scaling for m in mixed.get(name).modules if (m.layer, m.module) == (layer, module))
        expect = (x[2 * i : 2 * i + 2] @ a.T) @ b.T * scale
        torch.testing.assert_close(y[2 * i : 2 * i + 2], expect, rtol=1e-5, atol=1e-5)
        assert cache.book.table.slots[slot].pages == (4 if name in large else 1)
    cache.release(batch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["sgmv", "bgmv"])
def test_the_triton_kernels_read_a_paged_pool_as_their_twin_does(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache], mode: str) -> None:
    """On a GPU: the Triton kernels over a paged pool (a row stride of 0, each adapter's offsets from its pages,
    rank-16 and rank-64 adapters side by side) compute what the torch twin computes from the same pool."""
    from workers.kernels import lora_apply

    small, large = small_and_large(mixed)
    config = WorkerConfig(num_slots=4, page_rank=SMALL, pool_pages=8, device="cuda",
                          host=HostTierConfig(host_bytes=8 << 20, read_threads=2, pin=False))
    cache = WorkerCache(config, mixed)
    chosen = [small[0], large[0], small[1], large[1]]
    for name in chosen[:3]:
        cache.prefetch(name).result(timeout=60)
    batch = cache.acquire(chosen[:3])
    torch.cuda.synchronize()
    modules = ["q_proj", "k_proj", "v_proj"]
    d_in = cache.meta.dims["q_proj"][0]
    width = sum(cache.meta.dims[m][1] for m in modules)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(12, d_in, generator=gen, device="cuda").to(cache.dtype)
    meta = BatchMeta(12, 12, cache.device, num_slots=4)
    if mode == "sgmv":
        meta.set_segments([4, 4, 4], batch.slots)
    else:
        meta.set_tokens([batch.slots[i % 3] for i in range(12)])
    for layer in range(mixed.shape.num_layers):
        got, want = torch.zeros(12, width, device="cuda", dtype=cache.dtype), torch.zeros(12, width, device="cuda",
                                                                                           dtype=cache.dtype)
        lora_apply(x, got, cache.pool, cache.meta, meta, layer, modules, mode)
        lora_apply_ref(x, want, cache.pool, cache.meta, meta, layer, modules)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert want.abs().sum() > 0
    cache.release(batch)
    cache.close()


@pytest.mark.parametrize(("setting", "match"), [
    ({"page_rank": 65}, r"page_rank 65 is above the catalog's max_rank 64"),
    ({"page_rank": SMALL, "pool_pages": 3}, r"pool_pages 3 cannot hold one adapter of rank 64 \(4 pages of rank 16\)"),
    ({"page_rank": -1}, r"page_rank \(-1\) and pool_pages \(0\) must be >= 0"),
])
def test_bad_page_settings_are_refused_before_anything_is_allocated(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache], setting: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_cache(mixed, num_slots=4, host_bytes=8 << 20, **setting)


# -- the page table against a brute-force model ---------------------------------------------------------------
NAMES = tuple("abcdefg")
SIZES = {"a": 1, "b": 1, "c": 2, "d": 1, "e": 3, "f": 1, "g": 2}  # pages each adapter's shard takes


def k(name: str) -> AdapterKey:
    return AdapterKey(name, "v1")


class PageMachine(RuleBasedStateMachine):
    """``SlotTable`` with runs of pages: 4 slots over 6 pages. The model keeps each adapter's state, references and
    pages; a reservation must succeed exactly when some run of its pages is free or idle (with a slot to spare, or
    an idle adapter to give one up), evict only idle adapters, and among the runs pick the one whose newest victim
    was least recently used (ties: fewer victims, fewer pages evicted, then single pages from the pool's start and
    runs from its end)."""

    SLOTS, PAGES, SIZES = 4, 6, SIZES

    def __init__(self) -> None:
        super().__init__()
        self.slots, self.pages = self.SLOTS, self.PAGES
        self.table = SlotTable(self.slots, self.pages)
        self.slot_of: dict[str, int] = {}
        self.state: dict[str, str] = {}
        self.refs: dict[str, int] = {}
        self.run: dict[str, range] = {}
        self.lru: list[str] = []  # idle adapters, least recently used first
        self.lent: set[int] = set()  # pages lent to the engine

    def idle(self, name: str) -> None:
        if self.state[name] == "ready" and self.refs[name] == 0:
            self.lru.append(name)

    def drop(self, name: str) -> None:
        del self.state[name], self.refs[name], self.run[name], self.slot_of[name]
        if name in self.lru:
            self.lru.remove(name)

    def best(self, size: int) -> tuple[int, int, int] | None:
        """(newest victim's LRU position or -1, victims, first page) of the best run, by brute force."""
        owner = {p: n for n, r in self.run.items() for p in r}
        choices = []
        for first in range(self.pages - size + 1):
            names = {owner[p] for p in range(first, first + size) if p in owner}
            if any(n not in self.lru for n in names) or self.lent & set(range(first, first + size)):
                continue
            if not names and len(self.state) == self.slots:
                if not self.lru:
                    continue
                names = {self.lru[0]}
            # ties: fewer pages evicted, then single pages from the pool's start, runs from its end
            choices.append((max((self.lru.index(n) for n in names), default=-1), len(names),
                            sum(len(self.run[n]) for n in names), first if size == 1 else -first))
        if not choices:
            return None
        newest, count, _, first = min(choices)
        return newest, count, abs(first)

    @rule(name=st.sampled_from(NAMES))
    def reserve(self, name: str) -> None:
        if name in self.state:
            return
        size, best = self.SIZES[name], self.best(self.SIZES[name])
        if best is None:
            with pytest.raises(CapacityError):
                self.table.reserve(k(name), size)
            return
        index, evicted = self.table.reserve(k(name), size)
        gone = {e.key.name for e in evicted}
        assert all(n in self.lru for n in gone), f"evicted {gone}, not all idle ({self.lru})"
        assert self.table.slots[index].first_page == best[2] and len(gone) == best[1]
        assert [e.key.name for e in evicted] == sorted(gone, key=self.lru.index), "evicted oldest first"
        assert not evicted or index == self.slot_of[evicted[0].key.name], "the oldest evicted adapter's slot is reused"
        for n in gone:
            self.drop(n)
        self.state[name], self.refs[name], self.run[name] = "loading", 0, range(best[2], best[2] + size)
        self.slot_of[name] = index

    @rule(name=st.sampled_from(NAMES))
    def mark_ready(self, name: str) -> None:
        if self.state.get(name) != "loading":
            return
        self.table.mark_ready(self.table._by_key[k(name)])
        self.state[name] = "ready"
        self.idle(name)

    @rule(name=st.sampled_from(NAMES))
    def fail(self, name: str) -> None:
        if self.state.get(name) != "loading" or self.refs[name]:
            return
        self.table.fail(self.table._by_key[k(name)])
        self.drop(name)

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        if name not in self.state:
            return
        self.table.incref(self.table._by_key[k(name)])
        self.refs[name] += 1
        if name in self.lru:
            self.lru.remove(name)

    @rule(name=st.sampled_from(NAMES))
    def release(self, name: str) -> None:
        if name not in self.state:
            return
        if self.refs[name] == 0:  # a release without an acquire is refused, refs stay at zero
            with pytest.raises(AssertionError):
                self.table.decref(self.table._by_key[k(name)])
            return
        self.table.decref(self.table._by_key[k(name)])
        self.refs[name] -= 1
        self.idle(name)

    @rule(name=st.sampled_from(NAMES))
    def evict(self, name: str) -> None:
        expected = self.state.get(name) == "ready" and self.refs[name] == 0
        assert self.table.evict(k(name)) == expected
        if expected:
            self.drop(name)

    def free(self) -> list[int]:
        held = {p for r in self.run.values() for p in r}
        return [p for p in range(self.pages) if p not in held and p not in self.lent]

    @rule(count=st.integers(1, 4), keep=st.sets(st.sampled_from(NAMES), max_size=2))
    def lend(self, count: int, keep: set[str]) -> None:
        """Free pages first, from the shortest free stretches (each from its end); then idle adapters, least
        recently used first, those kept last; never a loading or in-use one; too many: refused, nothing changes."""
        free, idle_pages = self.free(), sum(len(self.run[n]) for n in self.lru)
        if count > len(free) + idle_pages:
            before = list(self.table.owner)
            with pytest.raises(CapacityError, match=f"cannot give back {count} GPU pages"):
                self.table.lend(count, {k(n) for n in keep})
            assert self.table.owner == before
            return
        pages, evicted = self.table.lend(count, {k(n) for n in keep})
        gone: list[str] = []
        for n in sorted(self.lru, key=lambda n: n in keep):
            if len(free) >= count:
                break
            free += list(self.run[n])
            gone.append(n)
        assert [e.key.name for e in evicted] == gone
        for n in gone:
            self.drop(n)
        stretches: list[list[int]] = []
        for p in sorted(free):
            if stretches and stretches[-1][-1] == p - 1:
                stretches[-1].append(p)
            else:
                stretches.append([p])
        want: list[int] = []
        for stretch in sorted(stretches, key=len):
            want += stretch[-(count - len(want)):]
            if len(want) == count:
                break
        assert pages == tuple(sorted(want)), (pages, want)
        self.lent |= set(pages)

    @rule(page=st.integers(0, 5))
    def reclaim(self, page: int) -> None:
        if page not in self.lent:  # never lent, or taken back already: refused, nothing changes
            before = list(self.table.owner)
            with pytest.raises(ConfigError, match="cannot take back pages"):
                self.table.reclaim([page])
            assert self.table.owner == before
            return
        self.table.reclaim([page])
        self.lent.discard(page)

    @invariant()
    def no_page_is_shared_and_the_table_matches_the_model(self) -> None:
        self.table.check_integrity()
        owners = [-2 if p in self.lent else -1 for p in range(self.pages)]
        for name, run in self.run.items():
            slot = self.table.lookup(k(name))
            assert slot is not None and slot.page_range == run and slot.state.value == self.state[name]
            assert slot.refs == self.refs[name]
            for p in run:
                assert owners[p] == -1, f"page {p} held by two live adapters, or held and lent"
                owners[p] = slot.index
        assert owners == self.table.owner
        assert self.table.count(SlotPhase.FREE) == self.slots - len(self.state)
        assert [self.table.slots[i].key for i in self.table._idle] == [k(n) for n in self.lru]


PageMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPageMachine = PageMachine.TestCase


class OnePagePerSlot(PageMachine):
    """The default pool (pages of the max rank, one per slot): the plain LRU of slots, the evicted slot reused."""

    SLOTS, PAGES, SIZES = 3, 3, dict.fromkeys(NAMES, 1)


OnePagePerSlot.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestOnePagePerSlot = OnePagePerSlot.TestCase


def test_the_planner_values_a_shard_per_page_rounded_byte() -> None:
    """Issue 43 item 2: an adapter's value is weighed per GPU byte it takes, whole pages where the pool has them. A
    shard one byte over a page takes two: a little more traffic does not make it worth more per byte than a
    one-page shard (per its own bytes it would), and the ranking (Fagin's bound over the page-rounded smallest shard)
    agrees with the scores."""
    from lora_cache.planner import AdapterInfo, Capacity
    from lora_cache.planner.popularity import Popularity

    catalog = {"one": AdapterInfo("one", "v1", 100), "two": AdapterInfo("two", "v1", 101),
               "big": AdapterInfo("big", "v1", 400)}
    popularity = Popularity(60.0, 100)
    for name, count in (("one", 10.0), ("two", 10.5), ("big", 30.0)):
        popularity.observe(name, "r0", 0.0, weight=count)
    plain = popularity.scorer("r0", 1, 0.5, catalog, 100, 0.0)
    paged = popularity.scorer("r0", 1, 0.5, catalog, 100, 0.0, Capacity(4, 400, None, 100).gpu_bytes)
    assert plain.score("two") > plain.score("one") and paged.score("two") < paged.score("one")
    assert paged.score("two") == pytest.approx(plain.score("two") * 101 / 200)
    assert [name for _, name in plain.ranked()] == ["two", "one", "big"]
    assert [name for _, name in paged.ranked()] == ["one", "big", "two"]  # 0.1, 0.075, 0.0525 per byte
    assert all(score == paged.score(name) for score, name in paged.ranked())
