"""GPU tests of the worker data path: side-stream loads, no host syncs, stream-ordered slot reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import workers.gpu.loads as loads_module
from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import AdapterKey
from tests.waiting import wait_for
from tests.worker_queries import forget_last_use
from workers.cache import WorkerCache, WorkerConfig
from workers.staging.host_config import HostTierConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _catalog(root: Path, count: int, rank: str = "8,16", model: str = "tiny") -> AdapterCatalog:
    make_adapters(root, SynthConfig(model=model, count=count, rank=rank))
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(root),), model=model, max_rank=64))
    catalog.register_dir(root)
    return catalog


def _cache(catalog: AdapterCatalog, slots: int, **kw: object) -> WorkerCache:
    return WorkerCache(WorkerConfig(num_slots=slots, device="cuda", host=HostTierConfig(host_bytes=64 << 20), **kw),
                       catalog)


def _file_shard(cache: WorkerCache, name: str) -> torch.Tensor:
    """The packed shard as it must appear in a slot, built from the file on the CPU."""
    layout = cache.layout_of(name)
    out = torch.zeros(layout.numel, dtype=cache.dtype)
    with safe_open(str(cache.catalog.get(name).weights), framework="pt") as f:
        for e in layout.entries:
            out[e.offset : e.offset + e.numel].view(e.shape).copy_(f.get_slice(e.key)[e.rows, e.cols])
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_side_stream_load_matches_file(tmp_path: Path, tp: int) -> None:
    catalog = _catalog(tmp_path, 4)
    caches = [_cache(catalog, 2, tp=tp, tp_rank=k) for k in range(tp)]
    try:
        for cache in caches:  # read in reader processes into the shared arena, pinned in place
            assert cache.host.reads == "process" and cache.host.arena.buffer.is_pinned()
            record = cache.prefetch("adapter-001").result(timeout=30)
            assert record.h2d_ms > 0 and record.tp_rank == cache.config.tp_rank
            layout = cache.layout_of("adapter-001")
            got = cache.shard(record.slot)[: layout.numel].cpu()
            assert torch.equal(got, _file_shard(cache, "adapter-001"))
            cache.check_integrity()
    finally:
        for cache in caches:
            cache.close()


@pytest.mark.parametrize("readers", [1, 4])
def test_parallel_reads_of_llama_shards_load_the_files_slices(tmp_path: Path, readers: int) -> None:
    """Llama-3.1-8B layouts (rank 2: 10 MB) at TP 4, every rank read by reader processes into the pinned shared
    arena, one thread or four per read, chunk by chunk: each slot holds exactly its rank's slices of the file."""
    catalog = _catalog(tmp_path, 1, rank="2", model="llama-3.1-8b")
    for k in range(4):
        host = HostTierConfig(host_bytes=256 << 20, read_parallel=readers)  # a slot holds a rank-64 shard: 164 MiB
        cache = WorkerCache(WorkerConfig(num_slots=1, device="cuda", tp=4, tp_rank=k, chunk_bytes=1 << 20, host=host),
                            catalog)
        try:
            assert cache.host.reads == "process" and cache.host.parallel == readers
            record = cache.prefetch("adapter-000").result(timeout=120)
            layout = cache.layout_of("adapter-000")
            assert len(cache.plan_of("adapter-000").chunks) > 1 and record.disk_ms > 0
            assert torch.equal(cache.shard(record.slot)[: layout.numel].cpu(), _file_shard(cache, "adapter-000"))
            cache.check_integrity()
        finally:
            cache.close()


def test_staged_shard_loads_as_a_host_hit_into_a_slot_that_matches_the_file(tmp_path: Path) -> None:
    """A stage reads the shard in a reader process into the pinned shared arena, with no slot; the load
    after it copies from there (a host hit) and the slot holds exactly the file's slices."""
    catalog = _catalog(tmp_path, 4)
    cache = _cache(catalog, 2)
    try:
        staged = cache.stage("adapter-002")
        assert staged is not None and staged.result(timeout=30).key.name == "adapter-002"
        assert cache.residency() == [] and cache.stats()["stages"] == 1
        record = cache.prefetch("adapter-002").result(timeout=30)
        assert record.host_hit and record.disk_ms == 0.0 and record.h2d_ms > 0
        layout = cache.layout_of("adapter-002")
        assert torch.equal(cache.shard(record.slot)[: layout.numel].cpu(), _file_shard(cache, "adapter-002"))
        cache.check_integrity()
    finally:
        cache.close()


def test_acquire_and_step_make_no_host_sync(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, 6)
    cache = _cache(catalog, 4)
    try:
        for name in ("adapter-000", "adapter-001"):
            cache.prefetch(name).result(timeout=30)
        x = torch.randn(8, cache.slot_numel // 64, device="cuda", dtype=cache.dtype)
        cache.host.fetch(catalog.get("adapter-002"), cache.layout_of("adapter-002"))[0].result(timeout=30)
        cache.host.release(AdapterKey("adapter-002", catalog.get("adapter-002").version))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for names in (["adapter-000", "adapter-001"], ["adapter-001", "adapter-002", "adapter-003"]):
                batch = cache.acquire(names)  # adapter-002: host hit, copy in flight; -003: on-demand miss
                rows = cache.pool.index_select(0, batch.slot_index.long())[:, : x.shape[1]]
                y = x[: len(names)] * rows  # a "step" reading the slots through the device index
                cache.release(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert y.isfinite().all()
        cache.check_integrity()
    finally:
        cache.close()


def _where(cache: WorkerCache) -> str:
    """Where this process runs work against ``cache``: its device and streams, against the process's current ones (a
    race test's batch runs on the current stream, which must be the cache's compute stream)."""
    return (f"cache on {cache.device} (pool {cache.pool.device}), compute stream {cache.streams.compute_stream}; "
            f"current device {torch.cuda.current_device()}, current stream {torch.cuda.current_stream()}, "
            f"{torch.cuda.device_count()} GPUs")


def _poison(cache: WorkerCache) -> None:
    """Fill the pool with NaN, as a process's earlier GPU work can leave its memory (``torch.empty``): the bytes
    past a shard are never written, and a check that compares them (NaN != NaN) fails whatever the streams did.
    Until 2026-12-03 the race tests compared the whole pool and failed so, 8 of 9 (every one but the control),
    after ``tests/test_kernels.py`` in one process (2026-11-30 twice, 2026-12-03 on one H200); alone they passed."""
    cache.pool[0].fill_(float("nan"))
    torch.cuda.synchronize()


def _race_once(cache: WorkerCache, delay_cycles: int, wait_for_last_use: bool) -> bool:
    """A slow batch reads adapter-000's shard through the device index while a prefetch of adapter-001 wants its
    slot; True if the batch saw its own weights, bit for bit the file's."""
    assert torch.cuda.current_stream(cache.pool.device) == cache.streams.compute_stream, _where(cache)
    own = _file_shard(cache, "adapter-000").to(cache.device)
    batch = cache.acquire(["adapter-000"])
    start = cache.shard(batch.slots[0]).storage_offset() - cache.pool.storage_offset()
    seen = torch.empty_like(own)
    torch.cuda._sleep(delay_cycles)  # the batch is slow: its read of the slot happens late
    seen.copy_(cache.pool.index_select(0, batch.slot_index.long())[0, start : start + own.numel()])
    cache.release(batch)
    if not wait_for_last_use:  # the control: what a loader without last-use events would do
        forget_last_use(cache, 0)
    cache.prefetch("adapter-001").result(timeout=60)  # host hit: the copy is issued at once, into slot 0
    torch.cuda.synchronize()
    ok = torch.equal(seen.view(torch.uint8), own.view(torch.uint8))
    cache.prefetch("adapter-000").result(timeout=60)  # back to the starting state
    torch.cuda.synchronize()
    return ok


@pytest.mark.parametrize("delay_cycles", [0, 10_000, 1_000_000, 20_000_000, 200_000_000])
def test_stream_race_batch_sees_its_own_adapter(tmp_path: Path, delay_cycles: int) -> None:
    catalog = _catalog(tmp_path, 2, rank="16")
    cache = _cache(catalog, 1)
    try:
        _poison(cache)
        for name in ("adapter-001", "adapter-000"):  # both staged on the host; adapter-000 in the only slot
            cache.prefetch(name).result(timeout=30)
        seen = [_race_once(cache, delay_cycles, wait_for_last_use=True) for _ in range(3)]
        assert all(seen), f"a batch saw another adapter's weights in {seen.count(False)} of 3 races; {_where(cache)}"
        cache.check_integrity()
    finally:
        cache.close()


def test_stream_race_is_real_without_last_use_event(tmp_path: Path) -> None:
    """The control: skipping the last-use wait lets the copy overwrite the slot under a slow batch."""
    catalog = _catalog(tmp_path, 2, rank="16")
    cache = _cache(catalog, 1)
    try:
        _poison(cache)
        for name in ("adapter-001", "adapter-000"):
            cache.prefetch(name).result(timeout=30)
        assert not _race_once(cache, 500_000_000, wait_for_last_use=False)
    finally:
        cache.close()


@pytest.mark.parametrize("delay_cycles", [0, 1_000_000, 200_000_000])
def test_stream_race_chunked_loads_wait_on_every_chunks_last_use(tmp_path: Path, delay_cycles: int) -> None:
    """The sweep with a chunk per layer: a slow batch's read of the slot (every chunk) finishes before any
    chunk of the next load lands there."""
    catalog = _catalog(tmp_path, 2, rank="16")
    cache = _cache(catalog, 1, chunk_bytes=0)
    try:
        assert len(cache.plan_of("adapter-000").chunks) == catalog.shape.num_layers > 1
        _poison(cache)
        for name in ("adapter-001", "adapter-000"):
            cache.prefetch(name).result(timeout=30)
        seen = [_race_once(cache, delay_cycles, wait_for_last_use=True) for _ in range(3)]
        assert all(seen), f"a batch saw another adapter's weights in {seen.count(False)} of 3 races; {_where(cache)}"
        cache.check_integrity()
    finally:
        cache.close()


@pytest.mark.parametrize("wait", [True, False])
def test_pipelined_layer_reads_its_chunk_after_a_slow_copy(tmp_path: Path, wait: bool) -> None:
    """A pipelined batch's read of the last layer's chunk, behind a slow copy stream, sees the new adapter
    when it waited on that chunk's event (a stream wait, no host sync); the control without it does not."""
    catalog = _catalog(tmp_path, 2, rank="16")
    cache = _cache(catalog, 1, chunk_bytes=0)
    try:
        cache.prefetch("adapter-001").result(timeout=30)
        cache.prefetch("adapter-000").result(timeout=30)  # adapter-001 stays staged: a host hit next
        want = _file_shard(cache, "adapter-001").cuda()
        last = cache.plan_of("adapter-001").chunks[-1]
        torch.cuda.synchronize()
        with torch.cuda.stream(cache.streams.copy_stream):
            torch.cuda._sleep(200_000_000)  # the copy stream is busy: the chunks land late
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = cache.acquire(["adapter-001"], pipelined=True)
            assert batch.waits is not None
            if wait:
                batch.waits.before(catalog.shape.num_layers - 1)
            seen = cache.shard(batch.slots[0])[last.start : last.stop].clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        batch.waits.finish()
        cache.release(batch)
        torch.cuda.synchronize()
        assert torch.equal(seen, want[last.start : last.stop]) == wait
        cache.settle()
        cache.check_integrity()
    finally:
        cache.close()


@pytest.mark.parametrize(("stream", "delay_cycles"), [("back", 0), ("back", 200_000_000), ("copy", 200_000_000)])
def test_an_evicted_slot_is_written_back_before_the_next_load_overwrites_it(tmp_path: Path, stream: str,
                                                                           delay_cycles: int,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Exclusive tiers on real streams: one slot; B's load evicts A, whose shard is copied out to the host tier on the
    write-back stream in pieces while B's copies into that slot wait, range by range, for the pieces they overwrite.
    A spin holds back the write-back stream (B's copies must wait for it: without the cross-stream waits A's entry
    would hold some of B's bytes) or the copy stream. A's host entry is served only once its copy completed and
    holds A's file bytes, B's slot holds B's; the load of A after it is a host hit."""
    monkeypatch.setattr(loads_module, "WRITE_BACK_PIECE_BYTES", 4096)  # the tiny shard in the most pieces allowed
    catalog = _catalog(tmp_path, 2, rank="64")
    cache = WorkerCache(WorkerConfig(num_slots=1, device="cuda",
                                     host=HostTierConfig(host_bytes=64 << 20, tiers="exclusive")), catalog)
    try:
        assert cache.host.arena.wait_pinned(60)
        a, b = "adapter-000", "adapter-001"
        cache.prefetch(a).result(timeout=30)
        key_a = AdapterKey(a, catalog.get(a).version)
        assert not cache.host.contains(key_a)
        held = getattr(cache.streams, f"{stream}_stream")
        with torch.cuda.stream(held):
            torch.cuda._sleep(delay_cycles)  # the copies queued next on it wait behind it
        record = cache.prefetch(b).result(timeout=60)
        assert torch.equal(cache.shard(record.slot)[: cache.layout_of(b).numel].cpu(), _file_shard(cache, b))
        if stream == "back" and delay_cycles:  # the landing estimate saw A's pieces queued behind the spin (events)
            assert cache.book.loads[record.slot].behind == cache.layout_of(a).nbytes
        wait_for(lambda: cache.host.contains(key_a), "A's write-back seen complete")  # stream order: before B's
        assert cache.host.contains(key_a) and cache.host.written_back == 1
        entry = cache.host._entries[key_a]
        assert torch.equal(entry.tensor[: cache.layout_of(a).numel], _file_shard(cache, a))
        again = cache.prefetch(a).result(timeout=30)
        assert again.host_hit
        assert torch.equal(cache.shard(again.slot)[: cache.layout_of(a).numel].cpu(), _file_shard(cache, a))
        cache.check_integrity()
    finally:
        cache.close()
