"""Issue 30 item 1 on the CPU: a cold load's phases as the probe splits them, the sample check taken from the
bytes the read put in the buffer (no second read of the block), reader processes reused last-used first."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from bench.probes.cold_read import phases
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.chunks import chunk_plan
from lora_cache.adapters.files import BLOCK_BYTES, RACY_NS
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import shard_layout
from lora_cache.errors import AdapterChangedError, ConfigError
from lora_cache.vocab import AdapterKey
from workers.cache import WorkerCache, WorkerConfig
from workers.kernels import SlotMeta, shard_dims
from workers.reads import processes as reader_proc_module
from workers.reads import proof as proof_module
from workers.reads import shard as reader_module
from workers.reads.plan import Run
from workers.reads.positioned import block_crc
from workers.reads.shard import read_slices
from workers.reads.threads import auto_readers
from workers.staging.host_config import AUTO_MAX_SPLIT, HostTierConfig
from workers.staging.host_tier import HostTier
from workers.staging.tier_reads import ProcessReads

TINY = SHAPES["tiny"]


def test_block_crc_takes_the_read_bytes_from_the_buffer_and_the_rest_from_the_file(tmp_path: Path) -> None:
    rng = random.Random(3)
    size = 3 * BLOCK_BYTES + BLOCK_BYTES // 2
    data = rng.randbytes(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    runs = [
        Run(100, 0, BLOCK_BYTES - 100),
        Run(BLOCK_BYTES, BLOCK_BYTES, BLOCK_BYTES),  # block 0 from 100; 1
        Run(2 * BLOCK_BYTES + 7, 3 * BLOCK_BYTES, 1000),
        Run(3 * BLOCK_BYTES + 5, 4 * BLOCK_BYTES, 9),
    ]
    buf = bytearray(5 * BLOCK_BYTES)
    for r in runs:
        buf[r.at : r.at + r.nbytes] = data[r.start : r.start + r.nbytes]
    raw = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        for b in range(4):
            want = zlib.crc32(data[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES])
            assert block_crc(fd, raw, runs, b, BLOCK_BYTES, size) == want, b
        buf[BLOCK_BYTES + 5] ^= 1  # a byte of block 1 in the buffer: the check sees the buffer, not the file
        assert block_crc(fd, raw, runs, 1, BLOCK_BYTES, size) != zlib.crc32(data[BLOCK_BYTES : 2 * BLOCK_BYTES])
    finally:
        os.close(fd)
    assert reader_module._covered(runs, size) == (1,)
    assert reader_module._best_covered(runs[2:], [2, 3]) == [2]  # 1000 bytes of block 2 against 9 of block 3
    assert reader_module._best_covered([], [2, 3]) == [2, 3]
    assert reader_module._covered([Run(0, 0, size)], size) == (0, 1, 2, 3)  # the short last block too
    assert reader_module._covered([Run(0, 0, BLOCK_BYTES // 2), Run(BLOCK_BYTES // 2, 10, BLOCK_BYTES // 2)], size) == (
        0,
    )  # adjacent runs in the file hold block 0 together


@pytest.fixture
def catalog(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]) -> AdapterCatalog:
    paths = tiny_adapters(count=2, rank="16")
    return make_catalog(paths[0].parent)


@pytest.mark.parametrize("reads", ["thread", "process"])
def test_a_cold_load_and_a_hit_split_into_phases_that_add_up(catalog: AdapterCatalog, reads: str) -> None:
    host = HostTierConfig(host_bytes=1 << 20, read_threads=1, pin=False, reads=reads)
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=host, chunk_bytes=1 << 10), catalog)
    try:
        name = catalog.names()[0]
        record = cache.prefetch(name).result(timeout=60)
        load = cache.book.loads[record.slot]
        cold = phases(load.t0, load.marks, load.entry.marks)
        chunks = len(load.plan.chunks)
        assert chunks > 1 and sum(n.startswith("issue ") for n, _ in load.marks) == chunks
        assert sum(n.startswith("proven ") for n, _ in load.entry.marks) == chunks
        if reads == "process":  # the reader's own marks came back with its reply, on the same clock
            assert sum(n.startswith("got ") for n, _ in load.entry.marks) == chunks
            assert {"received", "opened", "planned", "done", "reply"} <= {n for n, _ in load.entry.marks}
        steps = ("dispatch", "to_reader", "open", "plan", "read", "reply", "copy_tail", "finish")
        assert all(cold[k] >= 0 for k in steps) and cold["busy_read"] > 0
        assert sum(cold[k] for k in steps) <= cold["total"] + 1e-6  # from the end of the step before: no overlap
        assert cold["total"] == pytest.approx(record.ready_ms, abs=5)
        assert cache.evict(name)
        hit = cache.prefetch(name).result(timeout=60)
        assert hit.host_hit
        split = phases(cache.book.loads[hit.slot].t0, cache.book.loads[hit.slot].marks, [])
        assert {"to_slot", "issue", "copy_tail", "finish", "total"} <= set(split) and "read" not in split
    finally:
        cache.close()


def test_reader_processes_are_taken_last_used_first(catalog: AdapterCatalog) -> None:
    """One read at a time goes to the process that read last: warm (the entries, the header's index and the
    plan it keeps per rank pattern), where taken in turn each process paid for them on its first read."""
    # inclusive tiers: each round drops the host copy itself to read again (exclusive ones write it back at eviction)
    host = HostTierConfig(host_bytes=1 << 20, read_threads=3, read_split=1, pin=False, reads="process",
                          tiers="inclusive")
    cache = WorkerCache(WorkerConfig(num_slots=2, device="cpu", host=host), catalog)
    try:
        reader = cache.host._reader
        assert isinstance(reader, ProcessReads)
        for name in catalog.names():
            cache.prefetch(name).result(timeout=60)
            key = AdapterKey(name, catalog.get(name).version)
            assert cache.evict(name) and cache.host.drop(key)
            cache.prefetch(name).result(timeout=60)
        assert sorted(bool(p._sent) for p in reader._all) == [False, False, True]  # one process did every read
    finally:
        cache.close()


@pytest.fixture
def split_tier() -> Iterator[HostTier]:
    """A 1 MiB unpinned tier whose reads are split over three reader processes of one thread each."""
    tier = HostTier(
        HostTierConfig(host_bytes=1 << 20, read_threads=3, read_split=3, read_parallel=3, pin=False, reads="process")
    )
    try:
        assert tier.split == 3 and tier.parallel == 3
        yield tier
    finally:
        tier.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_read_split_over_reader_processes_holds_the_files_slices(
    catalog: AdapterCatalog, split_tier: HostTier, file_slices: Callable, tp: int
) -> None:
    spec = catalog.get(catalog.names()[0])
    for rank in range(tp):
        lay = shard_layout(spec, TINY, tp, rank, torch.bfloat16)
        plan = chunk_plan(lay.entries, lay.numel, TINY.num_layers, 2, min_bytes=0)
        entry = split_tier.fetch(spec, lay, chunks=plan.entry_spans)[0].result(timeout=120)
        assert sum(n == "received" for n, _ in entry.marks) == 3, "every process read a part"
        assert entry.staged == len(plan.chunks) and entry.bytes_read == lay.nbytes
        for e in lay.entries:
            want = file_slices(spec, lay)[(e.layer, e.module, e.ab)]
            assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape), want), e.key
        split_tier.release(AdapterKey(spec.name, spec.version))
        assert split_tier.drop(AdapterKey(spec.name, spec.version))
        split_tier.check_integrity()


def test_a_read_of_n_chunks_takes_n_replies_from_each_process_the_last_chunk_told_by_its_end(
    catalog: AdapterCatalog, split_tier: HostTier, file_slices: Callable
) -> None:
    """Issue 30 item 1 (fourth round): each reply is a message and a wake-up of the worker's read thread per
    process; the end of a part ("ok") says its last chunk is in place, which had a reply of its own before."""
    spec = catalog.get(catalog.names()[0])
    lay = shard_layout(spec, TINY, 2, 0, torch.bfloat16)
    plan = chunk_plan(lay.entries, lay.numel, TINY.num_layers, 2, min_bytes=0)
    assert len(plan.chunks) > 1
    replies: dict[int, list[str]] = {}
    for pid, proc in enumerate(split_tier._reader._all):
        def counted(spec_, layout_, _reply=proc.reply, _pid=pid):  # type: ignore[no-untyped-def]
            reply = _reply(spec_, layout_)
            replies.setdefault(_pid, []).append(reply[0])
            return reply

        proc.reply = counted  # type: ignore[method-assign]
    entry = split_tier.fetch(spec, lay, chunks=plan.entry_spans)[0].result(timeout=120)
    assert len(replies) == 3
    for kinds in replies.values():
        assert kinds == ["chunk"] * (len(plan.chunks) - 1) + ["ok"], kinds
    assert entry.staged == len(plan.chunks)
    assert [int(n.split()[1]) for n, _ in entry.marks if n.startswith("got ")] == list(range(len(plan.chunks)))
    for e in lay.entries:
        assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape),
                           file_slices(spec, lay)[(e.layer, e.module, e.ab)]), e.key


def test_a_split_reads_job_is_pickled_once_for_all_its_parts(
    catalog: AdapterCatalog, split_tier: HostTier, file_slices: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30 item 1 (fourth round): each part's job was pickled on its own, one after another before the last
    part could start; the job is now pickled once and every part gets the same bytes with its own part number."""
    spec = catalog.get(catalog.names()[0])
    lay = shard_layout(spec, TINY, 2, 0, torch.bfloat16)
    split_tier.fetch(spec, lay)[0].result(timeout=120)  # the processes up
    split_tier.release(AdapterKey(spec.name, spec.version))
    assert split_tier.drop(AdapterKey(spec.name, spec.version))
    jobs: list[bytes] = []
    job = reader_proc_module.ReaderProcess.job

    def counted(*args: object) -> bytes:
        jobs.append(job(*args))  # type: ignore[arg-type]
        return jobs[-1]

    monkeypatch.setattr(reader_proc_module.ReaderProcess, "job", staticmethod(counted))
    entry = split_tier.fetch(spec, lay)[0].result(timeout=120)
    assert len(jobs) == 1 and sum(n == "received" for n, _ in entry.marks) == 3
    for e in lay.entries:
        assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape),
                           file_slices(spec, lay)[(e.layer, e.module, e.ab)]), e.key


def test_a_miss_is_sent_to_started_reader_processes_by_the_fetching_thread(
    catalog: AdapterCatalog, split_tier: HostTier, file_slices: Callable
) -> None:
    """Issue 30 item 1 (fourth round): a miss's read went to the tier's pool first, and a pool thread sent it to
    the readers (``dispatch``, 0.16-0.26 ms of a small shard's 5 ms on the GPU host). Now the fetching thread
    sends it when the processes are idle and started; a process not yet started (its first read) is waited for
    on the pool, never by the fetch."""
    first, second = (catalog.get(n) for n in catalog.names()[:2])
    senders: list[str] = []
    for proc in split_tier._reader._all:
        def sent(*args, _begin=proc.begin):  # type: ignore[no-untyped-def]
            senders.append(threading.current_thread().name)
            return _begin(*args)

        proc.begin = sent  # type: ignore[method-assign]
    here = threading.current_thread().name
    for spec in (first, second):
        lay = shard_layout(spec, TINY, 2, 1, torch.bfloat16)
        senders.clear()
        entry = split_tier.fetch(spec, lay)[0].result(timeout=120)
        assert len(senders) == 3
        if spec is first:  # the processes may still be starting: then the pool sends it, once they are
            assert len(set(senders)) == 1, senders
        else:
            assert senders == [here] * 3, senders
        for e in lay.entries:
            assert torch.equal(entry.tensor[e.offset : e.offset + e.numel].view(e.shape),
                               file_slices(spec, lay)[(e.layer, e.module, e.ab)]), e.key
        split_tier.release(AdapterKey(spec.name, spec.version))
    split_tier.check_integrity()


def test_a_split_read_of_a_changed_file_is_refused_and_leaves_the_tier_as_it_was(
    catalog: AdapterCatalog, split_tier: HostTier
) -> None:
    first, second = (catalog.get(n) for n in catalog.names()[:2])
    lay = shard_layout(first, TINY, 2, 1, torch.bfloat16)
    split_tier.fetch(first, lay)[0].result(timeout=120)  # the processes up, one shard staged
    split_tier.release(AdapterKey(first.name, first.version))
    before = (list(split_tier.arena._free), dict(split_tier.arena._used), split_tier.bytes_read)
    data = second.weights.read_bytes()
    assert len(data) == first.weights.stat().st_size
    with open(second.weights, "r+b") as f:  # other bytes of the same size written in place
        f.write(data[:8] + bytes(len(data) - 8))  # its header length kept, everything after it zeroed
    with pytest.raises(AdapterChangedError) as e:
        split_tier.fetch(second, shard_layout(second, TINY, 2, 1, torch.bfloat16))[0].result(timeout=120)
    assert second.version in str(e.value) and "register" in str(e.value)
    assert (list(split_tier.arena._free), dict(split_tier.arena._used), split_tier.bytes_read) == before
    split_tier.check_integrity()
    assert all(p.pid is not None for p in split_tier._reader._all)  # no process died of it


def test_a_host_hit_is_copied_in_one_copy_with_every_chunk_on_its_event(
    catalog: AdapterCatalog, file_slices: Callable
) -> None:
    """All of a hit's chunks are staged when it takes its slot: one copy (up to COPY_MAX_BYTES), not one per
    chunk (a fixed cost per chunk that weighed most on small shards: issue 30, hits at 0.46 of the memcpy)."""
    cache = WorkerCache(
        WorkerConfig(
            num_slots=2, device="cpu", chunk_bytes=1 << 10, host=HostTierConfig(host_bytes=1 << 20, pin=False)
        ),
        catalog,
    )
    try:
        name = catalog.names()[0]
        cache.prefetch(name).result(timeout=60)
        assert cache.evict(name)
        cache.streams.trace = deque()
        record = cache.prefetch(name).result(timeout=60)
        assert record.host_hit
        load = cache.book.loads[record.slot]
        assert len(load.plan.chunks) > 1 and len(load.events) == len(load.plan.chunks)
        assert [op[0] for op in cache.streams.trace] == ["copy"] and len({id(e) for e in load.events}) == 1
        spec, layout = catalog.get(name), cache.layout_of(name)
        for (layer, module, ab), want in file_slices(spec, layout).items():
            e = layout.entry(layer, module, ab)
            assert torch.equal(cache.shard(record.slot)[e.offset : e.offset + e.numel].view(e.shape), want)
        cache.check_integrity()
    finally:
        cache.close()


def test_the_split_config_and_its_defaults() -> None:
    assert auto_readers(64, 4, AUTO_MAX_SPLIT) == 16 and auto_readers(64, 4) == 8  # processes / one process
    assert [HostTierConfig().splits(n) for n in (1, 4, 8, 16, 64)] == [1, 1, 2, 4, 4]  # at most read_threads (4)
    assert HostTierConfig(read_split=2).splits(16) == 2 and HostTierConfig(read_threads=8).splits(64) == 8
    with pytest.raises(ConfigError, match=r"read_split must be 0 \(auto\) or 1\.\.read_threads \(4\).*got 5"):
        HostTierConfig(read_split=5)


def test_slot_metadata_of_a_rank_pattern_seen_before_is_written_from_its_checked_offsets(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> None:
    """``SlotMeta.write`` checks a layout once per rank pattern (its shared entries) and keeps the offsets; the
    rows it writes from them equal a fresh check's, the scaling is each adapter's own, and another pattern is
    checked again."""
    paths = tiny_adapters(count=3, rank="8,16")
    catalog = make_catalog(paths[0].parent)
    specs = [catalog.get(n) for n in catalog.names()]
    layouts = [shard_layout(s, TINY, 2, 1, torch.float32) for s in specs]
    kept = SlotMeta(2, TINY.num_layers, MODULE_ORDER, torch.device("cpu"), max_rank=16, dims=shard_dims(TINY, 2))
    for spec, layout in [*zip(specs, layouts, strict=True)] * 2:
        fresh = SlotMeta(2, TINY.num_layers, MODULE_ORDER, torch.device("cpu"), max_rank=16, dims=shard_dims(TINY, 2))
        kept.write(1, layout)
        fresh.write(1, layout)
        for name in ("a_off", "b_off", "rank", "scale"):
            assert torch.equal(getattr(kept, name)[1], getattr(fresh, name)[1]), (spec.name, name)
        assert kept.numel[1] == layout.numel
    assert 1 <= len(kept._rows) <= len({(id(lay.entries), id(lay.modules)) for lay in layouts})


class _Counted(tuple):  # type: ignore[type-arg]
    """A layout's modules that count how often they are iterated (what a write does per module)."""

    iterations = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _Counted.iterations += 1
        return super().__iter__()


def test_slot_metadata_of_a_pattern_seen_before_is_one_row_copy_with_no_per_module_work(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog]
) -> None:
    """Issue 30 item 1 (fourth round): a host-tier hit's ``issue`` was the slot's metadata, built module by module
    on every load. A layout whose entries and modules (shared by the adapters of a rank pattern) were written
    before is written as its kept row: no module of it is looked at again, and the row is the one a fresh check
    writes; another slot, or a layout of other modules (another scaling), is checked and written anew."""
    paths = tiny_adapters(count=2, rank="8,16")
    catalog = make_catalog(paths[0].parent)
    spec = catalog.get(catalog.names()[0])
    base = shard_layout(spec, TINY, 2, 1, torch.float32)
    layout = dataclasses.replace(base, modules=_Counted(base.modules))
    meta = SlotMeta(3, TINY.num_layers, MODULE_ORDER, torch.device("cpu"), max_rank=16, dims=shard_dims(TINY, 2))
    meta.write(0, layout)
    first = _Counted.iterations
    assert first >= 1
    for slot in (1, 2, 1):
        meta.write(slot, layout)
    assert _Counted.iterations == first, "a write of a pattern seen before went over its modules again"
    fresh = SlotMeta(3, TINY.num_layers, MODULE_ORDER, torch.device("cpu"), max_rank=16, dims=shard_dims(TINY, 2))
    fresh.write(2, base)
    for name in ("a_off", "b_off", "rank", "scale"):
        assert torch.equal(getattr(meta, name)[2], getattr(fresh, name)[2]), name
        assert torch.equal(getattr(meta, f"host_{name}")[1], getattr(fresh, f"host_{name}")[2]), name
    doubled = dataclasses.replace(base, modules=tuple(m._replace(scaling=2 * m.scaling) for m in base.modules))
    meta.write(1, doubled)  # other modules (scalings): checked and written as they are
    assert torch.equal(meta.scale[1], 2 * fresh.scale[2]) and torch.equal(meta.a_off[1], fresh.a_off[2])


def test_a_parts_share_of_a_settled_pattern_is_built_once_and_the_bytes_come_from_the_plan(
    catalog: AdapterCatalog, file_slices: Callable
) -> None:
    """Issue 30 item 1 (fourth round): each read built its part's share of every chunk again (the work list, the
    runs sorted, the blocks they cover) and summed its entries' bytes after the last chunk: most of a split read's
    ``plan`` phase and ~0.1 ms before its end. A version past its racy window (no block checks but the sample's)
    keeps each (plan, part)'s share; a racy one, whose checks change as blocks settle, builds it per read."""
    spec = catalog.get(catalog.names()[0])
    assert spec.source is not None
    settled = spec.source._replace(registered_ns=spec.source.identity.ctime_ns + RACY_NS)
    assert not settled.racy and spec.source.racy
    lay = shard_layout(spec, TINY, 2, 1, torch.bfloat16)
    plan = chunk_plan(lay.entries, lay.numel, TINY.num_layers, 2, min_bytes=0)
    index = proof_module.tensor_index(str(spec.weights), spec.version, spec.weights.stat().st_size)
    want_bytes = sum(e.numel * index[e.key].dtype.itemsize for e in lay.entries)  # this rank's, in file bytes

    def read_both(source: object) -> list[int]:
        dest = torch.zeros(lay.numel, dtype=torch.bfloat16)
        got = [read_slices(source, lay.entries, dest, "TP 1/2", "sample", plan.entry_spans, part=(i, 2), readers=2)
               for i in (0, 1)]
        for e in lay.entries:
            assert torch.equal(dest[e.offset : e.offset + e.numel].view(e.shape),
                               file_slices(spec, lay)[(e.layer, e.module, e.ab)]), e.key
        return got

    before = dict(reader_module._PARTS.items())
    assert read_both(spec.source) == [want_bytes] * 2
    assert dict(reader_module._PARTS.items()) == before, "a racy version's share was kept"
    assert read_both(settled) == [want_bytes] * 2
    kept = {k: v[1] for k, v in reader_module._PARTS.items() if k not in before}
    assert len(kept) == 2  # one per part
    assert read_both(settled) == [want_bytes] * 2
    now = dict(reader_module._PARTS.items())
    assert all(now[k][1] is share for k, share in kept.items()), "a share was built again"
