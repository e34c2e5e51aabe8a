"""Issue 43 item 3: a pool that breathes. A rank's adapter pool lends whole pages to its engine and takes them back:
free pages first, then idle adapters least recently used first (those the engine needs soon last); never a page a
loading or in-use adapter holds; a request for more than is free or idle is refused, naming what holds the rest,
and nothing changes; the engine's writes follow the last batch that read each lent page and the write-backs copying
it out (invariant 2), and the first load into a page taken back follows the engine's last use of it; the evictions
and the new capacity reach the controller in order, and its planner counts the room that is left."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.api import relay_codec
from lora_cache.controller.core import ControllerConfig, ControllerCore
from lora_cache.errors import CapacityError, ConfigError
from lora_cache.vocab import AdapterKey, Delta, WorkerId, capacity_delta, capacity_of, delta_row
from tests.test_exclusive_tiers import drain_until
from tests.test_pages import LARGE, SMALL, small_and_large
from tests.test_worker_cache import assert_slot_holds, current
from tests.worker_queries import use_streams
from workers.cache import WorkerCache
from workers.gpu.streams import CpuStreams


@pytest.fixture
def mixed(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    """test_pages' 16/64 mix: six rank-16 adapters and two rank-64 ones."""
    return make_catalog(tiny_adapters(count=8, rank=f"{SMALL},{SMALL},{SMALL},{LARGE}")[0].parent, max_rank=LARGE)


def paged(mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache], changes: list[Delta]) -> WorkerCache:
    """Eight pages of rank 16 (two rank-64 adapters' bytes), every residency change into ``changes``."""
    cache = make_cache(mixed, num_slots=8, page_rank=SMALL, pool_pages=8, host_bytes=8 << 20)
    cache.on_change = changes.append
    return cache


def loaded(cache: WorkerCache, names: list[str]) -> None:
    """``names`` READY in ``cache``, in order (the least recently used first)."""
    for name in names:
        cache.prefetch(name).result(timeout=30)
    cache.settle()


def test_give_back_lends_free_pages_then_idle_adapters_oldest_first_and_reports_the_new_capacity(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    changes: list[Delta] = []
    cache = paged(mixed, make_cache, changes)
    small, large = small_and_large(mixed)
    loaded(cache, small[:6])
    page = cache.lender.page_bytes
    assert cache.lender.capacity_bytes() == cache.pool_bytes == 8 * page
    batch = cache.acquire([small[0]])  # the oldest, but in use: never lent
    changes.clear()
    lease = cache.lender.give_back(3 * page + 1, keep={small[1]})  # 4 pages: the 2 free, then 2 idle adapters
    assert len(lease.pages) == 4 and lease.nbytes == 4 * page
    gone = [d.adapter for d in changes if d.state == "gone"]
    assert gone == [small[2], small[3]], "idle adapters, least recently used first; the kept one and the held one stay"
    assert lease.evicted == tuple(f"{n}@{mixed.get(n).version}" for n in gone)
    slots_changes = [d for d in changes if d.state not in ("staged", "unstaged")]  # the host tier's apart
    assert slots_changes[-1] == capacity_delta(4 * page, page), "the new capacity, after the evictions that made it"
    assert cache.lender.capacity_bytes() == 4 * page
    held = {r["adapter"] for r in cache.residency()}
    assert held == {small[0], small[1], small[4], small[5]}
    for view, p in zip(lease.views, lease.pages, strict=True):  # the engine's own bytes: views of the pool's pages
        assert view.numel() == cache.page_numel and view.data_ptr() == cache.pool[0, p * cache.page_numel:].data_ptr()
    for r in cache.residency():  # lending moved no resident adapter
        assert_slot_holds(cache, r["slot"], *current(cache, r["adapter"]))  # type: ignore[arg-type]
    # no load lands on a lent page: a rank-64 adapter needs 4 contiguous pages; 4 are lent, 1 held, 3 idle
    with pytest.raises(CapacityError, match="4 lent to the engine"):
        cache.acquire([large[0]])
    cache.release(batch)
    changes.clear()
    cache.lender.take_back(lease)
    assert changes == [capacity_delta(8 * page, page)] and cache.lender.capacity_bytes() == 8 * page
    cache.prefetch(large[0]).result(timeout=30)  # the pages are the pool's again
    cache.settle()
    assert_slot_holds(cache, cache.book.table.lookup(AdapterKey(large[0], mixed.get(large[0]).version)).index,
                      *current(cache, large[0]))
    cache.check_integrity()


def test_give_back_beyond_what_is_free_or_idle_is_refused_and_changes_nothing(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    changes: list[Delta] = []
    cache = paged(mixed, make_cache, changes)
    small, _ = small_and_large(mixed)
    loaded(cache, small[:6])
    batch = cache.acquire(small[:3])  # 3 pages in use: 2 free + 3 idle = 5 may be lent, not 6
    before, changes[:] = sorted((r["adapter"], r["slot"], r["state"]) for r in cache.residency()), []
    page = cache.lender.page_bytes
    with pytest.raises(CapacityError, match=r"cannot give back 6 GPU pages: 2 are free and 3 held by idle adapters; "
                                            r"3 are held by loading or in-use adapters and 0 are lent already; "
                                            r"ask for at most 5 pages"):
        cache.lender.give_back(6 * page)
    with pytest.raises(ConfigError, match=r"give_back\(0\): ask for at least one byte"):
        cache.lender.give_back(0)
    assert sorted((r["adapter"], r["slot"], r["state"]) for r in cache.residency()) == before and not changes
    assert cache.lender.capacity_bytes() == 8 * page
    lease = cache.lender.give_back(5 * page)
    cache.lender.take_back(lease)
    with pytest.raises(ConfigError, match="cannot take back pages"):  # a lease taken back twice
        cache.lender.take_back(lease)
    assert cache.lender.capacity_bytes() == 8 * page
    cache.release(batch)
    cache.check_integrity()


def test_lent_pages_follow_their_last_batch_and_write_back_and_a_load_follows_the_engines_last_use(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    """Invariant 2 both ways: the engine's stream waits for the last batch that read an evicted adapter's page and
    for its write-back before it writes the page; a load into a page taken back waits for the engine's last use."""
    small, large = small_and_large(mixed)
    cache = make_cache(mixed, num_slots=4, page_rank=SMALL, pool_pages=4, chunk_bytes=0, host_bytes=8 << 20)
    streams = CpuStreams(cache.device, deferred=True)
    streams.trace = deque(maxlen=4096)
    use_streams(cache, streams)
    try:
        for name in small[:4]:
            cache.release(cache.acquire([name]))
        drain_until(cache, lambda: len(cache.ready_keys()) == 4, "four rank-16 adapters READY")
        releases = [op[2] for op in streams.trace if op[0] == "compute"]
        streams.trace.clear()
        lease = cache.lender.give_back(2 * cache.lender.page_bytes)  # no free page: the two oldest go
        assert len(lease.evicted) == 2
        backs = [op[3] for op in streams.trace if op[0] == "copy" and op[1][0] == "write-back"]
        assert backs, "the evicted shards are copied out first (exclusive tiers)"
        assert all(any(e is r for e in lease.after) for r in releases[:2]), "each lent page's last batch"
        assert any(e is backs[-1] for e in lease.after), "and the write-back copying it out"
        cache.lender.wait(lease)  # on the compute stream: here, the deferred copies run up to each event
        assert [op[1] for op in streams.trace if op[0] == "compute_wait"] == list(lease.after)
        assert all(e.done for e in lease.after)
        lease.views[0].fill_(7.0)  # the engine writes its page
        streams.trace.clear()
        cache.lender.take_back(lease)
        engine_done = next(op[2] for op in streams.trace if op[0] == "compute")
        future = cache.prefetch(large[0])  # a run of 4: the pages taken back and the two idle adapters'
        drain_until(cache, future.done, "the rank-64 adapter READY")
        first = next(op for op in streams.trace if op[0] == "copy" and op[1][0] != "write-back")
        waits = first[2] if isinstance(first[2], tuple) else (first[2],)
        assert any(e is engine_done for e in waits), "the first copy into a page taken back waits for the engine's use"
        assert_slot_holds(cache, future.result().slot, *current(cache, large[0]))
        cache.check_integrity()
    finally:  # a failure leaves no copy queued for the cache's close to wait on
        streams.run_copies()


def test_the_controller_plans_within_the_capacity_a_rank_reports(tmp_path: Path) -> None:
    make_adapters(tmp_path, SynthConfig(model="tiny", count=2, rank="8"))
    core = ControllerCore(ControllerConfig(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=8)), 1)
    core.add_replica("r0", 2, 4, gpu_bytes=4096, page_bytes=1024)
    row = delta_row(7, capacity_delta(2048, 1024))
    incarnation, rows = relay_codec.from_deltas(relay_codec.deltas(3, [row]))  # the gateway's transport too
    assert incarnation == 3 and rows == [row]
    core.worker_report(WorkerId("r0", 1), [row[1:5]], now=1.0)
    assert core.planner.view.capacity("r0/1") == (4, 2048, None, 1024, None)
    assert core.planner.view.capacity("r0/0") == (4, 4096, None, 1024, None), "each rank reports its own"
    core.worker_report(WorkerId("r0", 1), [("", "lots:of", "capacity", "")], now=2.0)  # malformed: ignored
    assert core.planner.view.capacity("r0/1") == (4, 2048, None, 1024, None)
    assert capacity_of("0:1024") == (0, 1024)
    with pytest.raises(ValueError, match="give gpu_bytes >= 0 and page_bytes > 0"):
        capacity_of("4096:0")
    core.check_integrity()


def test_a_rank_that_lent_pages_describes_its_capacity_to_a_restarted_controller(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache]) -> None:
    from workers.control.outbox import Outbox
    from workers.control.rank import WorkerControl

    cache = make_cache(mixed, num_slots=2, host_bytes=8 << 20)  # slots of the max rank: one page each
    sent: list[object] = []
    outbox = Outbox("w", 0.01, send=lambda name, inc, batch: sent.append(batch))
    try:
        rank = WorkerControl("r0", mixed, cache, outbox)
        assert "gpu_bytes" not in rank.describe("node")
        lease = cache.lender.give_back(1)
        info = rank.describe("node")
        assert (info["gpu_bytes"], info["page_bytes"]) == (cache.pool_bytes // 2, cache.lender.page_bytes)
        cache.lender.take_back(lease, last_use=cache.streams.record_compute())  # the engine's last use of them
    finally:
        outbox.close()


class _Rank:
    """A rank's control surface called as the controller calls a worker actor (``handle.method.remote(...)``,
    awaited), over a real ``WorkerControl`` in this process: the call runs on a thread, as the actor's would."""

    def __init__(self, control: object) -> None:
        self.control = control

    def __getattr__(self, method: str) -> object:
        import asyncio
        from types import SimpleNamespace

        return SimpleNamespace(remote=lambda *args: asyncio.to_thread(getattr(self.control, method), *args))


def test_a_replica_whose_rank_refuses_to_lend_is_put_back_as_it_was(
        mixed: AdapterCatalog, make_cache: Callable[..., WorkerCache], tmp_path: Path) -> None:
    """``WorkerFanout.resize_pool`` over a TP-2 replica: rank 0 lends, rank 1 cannot (a batch holds its pages); the
    error is rank 1's, and rank 0 is put back to what it lent before, so the replica's ranks stay alike."""
    import asyncio
    from types import SimpleNamespace

    from lora_cache.controller.fanout import WorkerFanout
    from workers.control.outbox import Outbox
    from workers.control.rank import WorkerControl

    small, _ = small_and_large(mixed)
    make_adapters(tmp_path, SynthConfig(model="tiny", count=1, rank="8"))
    core = ControllerCore(ControllerConfig(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=8)), 1)
    core.add_replica("r0", 2, 8)
    outboxes = [Outbox(f"w{k}", 0.01, send=lambda name, inc, batch: None) for k in range(2)]
    try:
        caches = [paged(mixed, make_cache, []) for _ in range(2)]
        for cache in caches:
            loaded(cache, small[:6])
        batch = caches[1].acquire(small[:4])  # rank 1: 4 pages in use, 4 free or idle; rank 0: all 8
        handles = {WorkerId("r0", k): _Rank(WorkerControl("r0", mixed, caches[k], outboxes[k])) for k in range(2)}
        links = SimpleNamespace(core=core, handles=handles, attached=set(), call_timeout_s=10.0)
        fanout = WorkerFanout(links)  # type: ignore[arg-type]
        page = caches[0].lender.page_bytes
        assert [r["lent_bytes"] for r in asyncio.run(fanout.resize_pool("r0", 2 * page, []))] == [2 * page] * 2
        with pytest.raises(CapacityError, match="cannot give back 4 GPU pages"):
            asyncio.run(fanout.resize_pool("r0", 6 * page, []))
        assert [c.lender.capacity_bytes() for c in caches] == [6 * page] * 2, "rank 0 put back to 2 pages lent"
        links.attached = {WorkerId("r0", 1)}
        with pytest.raises(ConfigError, match=r"ranks \['r0/1'\] are an attached engine's"):
            asyncio.run(fanout.resize_pool("r0", 0, []))
        links.attached = set()
        caches[1].release(batch)
        assert [r["lent_bytes"] for r in asyncio.run(fanout.resize_pool("r0", 0, []))] == [0, 0]
        for cache in caches:
            cache.check_integrity()
    finally:
        for outbox in outboxes:
            outbox.close()


def _lend_race_once(tmp_path: Path, wait_for_write_back: bool) -> tuple[bool, bool]:
    """On a GPU, one page of a one-slot pool: adapter-000 in it, its write-back held up on the write-back stream,
    the page lent and written by the engine on its compute stream, taken back while a slow engine op still
    writes it, then adapter-001 loaded into it. Returns (adapter-000's written-back host copy is its own weights,
    the page holds exactly adapter-001's shard)."""
    import torch

    from workers.cache import WorkerConfig
    from workers.staging.host_config import HostTierConfig

    make_adapters(tmp_path, SynthConfig(model="tiny", count=2, rank="16"))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(tmp_path),), model="tiny", max_rank=16))
    catalog.register_dir(tmp_path)
    cache = WorkerCache(WorkerConfig(num_slots=1, device="cuda", host=HostTierConfig(host_bytes=64 << 20)), catalog)
    try:
        staged = cache.stage("adapter-001")
        assert staged is not None
        staged.result(timeout=30)
        first = cache.prefetch("adapter-000").result(timeout=30)
        numel = cache.layout_of("adapter-000").numel
        own = cache.shard(first.slot)[:numel].clone()
        streams = cache.streams
        torch.cuda.synchronize()
        with torch.cuda.stream(streams.back_stream):  # type: ignore[attr-defined]
            torch.cuda._sleep(300_000_000)  # the write-back stream is busy: adapter-000's copy out runs late
        lease = cache.lender.give_back(1)
        assert lease.evicted == (f"adapter-000@{first.version}",)
        with torch.cuda.stream(streams.compute_stream):  # type: ignore[attr-defined]
            if wait_for_write_back:
                cache.lender.wait(lease)
            lease.views[0].fill_(7.0)  # the engine writes its page
            torch.cuda._sleep(300_000_000)
            lease.views[0].fill_(9.0)  # ... and still writes it, late, after handing it back below
        cache.lender.take_back(lease)
        second = cache.prefetch("adapter-001").result(timeout=60)  # a host hit: its copy is issued at once
        torch.cuda.synchronize()
        loaded_ok = torch.equal(cache.shard(second.slot)[: cache.layout_of("adapter-001").numel].cpu(),
                                _file_shard(cache, "adapter-001"))
        again = cache.prefetch("adapter-000").result(timeout=60)  # from the written-back host copy, not the file
        torch.cuda.synchronize()
        assert again.host_hit
        kept_ok = torch.equal(cache.shard(again.slot)[:numel], own)
        cache.check_integrity()
        return kept_ok, loaded_ok
    finally:
        cache.close()


def _file_shard(cache: WorkerCache, name: str) -> object:
    from tests.test_gpu import _file_shard as file_shard

    return file_shard(cache, name)


@pytest.mark.gpu
def test_on_a_gpu_the_engine_writes_a_lent_page_after_its_write_back_and_a_load_after_the_engine() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import tempfile

    for _ in range(3):
        with tempfile.TemporaryDirectory() as root:
            assert _lend_race_once(Path(root), wait_for_write_back=True) == (True, True)


@pytest.mark.gpu
def test_on_a_gpu_the_lent_page_race_is_real_without_the_lease_wait() -> None:
    """The control: an engine that writes its lent page without ``wait(lease)`` corrupts the evicted adapter's
    written-back host copy (the next load from it is not the adapter's weights)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        kept_ok, _ = _lend_race_once(Path(root), wait_for_write_back=False)
    assert not kept_ok
