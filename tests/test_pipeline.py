"""Layer-pipelined loads on the CPU: the chunk plan, reads that stream chunk by chunk, per-chunk copy events
and the ordering invariants (a layer waits on its chunk; a slot's next load waits on its last use)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench.policies import BENCH_POLICIES
from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.chunks import MIN_CHUNK_BYTES, ChunkPlan, chunk_plan
from lora_cache.adapters.shapes import MODULE_ORDER, SHAPES
from lora_cache.adapters.shards import ShardLayout, _packed
from lora_cache.errors import ConfigError
from tests.worker_queries import use_streams
from workers.attach.versions import Readiness
from workers.cache import WorkerCache
from workers.engine.admission import ADMISSION
from workers.engine.workload import Request
from workers.gpu.copies import LoadFailed
from workers.gpu.streams import CpuStreams, HostEvent
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostEntry, HostTier


def check_plan(plan: ChunkPlan, entries: tuple, numel: int, num_layers: int, elem: int, min_bytes: int) -> None:
    chunks = plan.chunks
    assert chunks[0].start == 0 and chunks[-1].stop == numel
    for a, b in itertools.pairwise(chunks):
        assert a.stop == b.start and a.entries.stop == b.entries.start, "chunks tile the shard in order"
        assert a.layers.stop <= b.layers.start, "layer-ordered, whole layers"
    for c in chunks:
        held = entries[c.entries]
        assert all(c.start <= e.offset and e.offset + e.numel <= c.stop for e in held)
        assert {e.layer for e in held} <= set(c.layers)
        if len(chunks) > 1:
            assert c.numel * elem >= min_bytes, "every chunk reaches the floor when the shard allows"
    assert len(plan.layer_chunk) == num_layers and list(plan.layer_chunk) == sorted(plan.layer_chunk)
    for e in entries:
        assert e.layer in chunks[plan.chunk_of(e.layer)].layers, "a layer waits on the chunk that holds it"


@given(layers=st.lists(st.booleans(), min_size=1, max_size=12), rank=st.sampled_from([1, 4, 16]),
       min_bytes=st.sampled_from([0, 1, 2048, 8192, 1 << 20]))
def test_chunk_plan_tiles_the_shard_by_whole_layers(layers: list[bool], rank: int, min_bytes: int) -> None:
    shape = SHAPES["tiny"]
    num_layers = len(layers)
    modules = tuple((i, m, rank) for i, on in enumerate(layers) if on for m in MODULE_ORDER)
    entries, numel = _packed(modules, shape, 1, 0, torch.bfloat16)
    plan = chunk_plan(entries, numel, num_layers, 2, min_bytes)
    check_plan(plan, entries, numel, num_layers, 2, min_bytes)
    if min_bytes == 0 and entries:
        assert len(plan.chunks) == sum(layers), "0: a chunk per adapted layer"


@pytest.mark.parametrize("rank,tp", [(16, 1), (64, 1), (16, 2)])
def test_llama8b_chunks_reach_4mb(rank: int, tp: int) -> None:
    shape = SHAPES["llama-3.1-8b"]
    modules = tuple((i, m, rank) for i in range(shape.num_layers) for m in MODULE_ORDER)
    entries, numel = _packed(modules, shape, tp, 0, torch.bfloat16)
    plan = chunk_plan(entries, numel, shape.num_layers, 2)
    check_plan(plan, entries, numel, shape.num_layers, 2, MIN_CHUNK_BYTES)
    assert 1 < len(plan.chunks) <= shape.num_layers


def test_chunk_plan_refuses_bad_input() -> None:
    entries, numel = _packed(((1, "q_proj", 4), (0, "q_proj", 4)), SHAPES["tiny"], 1, 0, torch.bfloat16)
    with pytest.raises(ConfigError, match="not in layer order"):
        chunk_plan(entries, numel, 2, 2)
    with pytest.raises(ConfigError, match="min_bytes must be >= 0"):
        chunk_plan(entries, numel, 2, 2, -1)


# -- streams, reads, the cache ---------------------------------------------------------------------------
@pytest.fixture
def deferred_cache(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
                   make_cache: Callable[..., WorkerCache]) -> WorkerCache:
    """A cache whose copy stream is deferred (copies run when waited on) and traced, a chunk per layer."""
    return _deferred(tiny_adapters, make_catalog, make_cache, "exclusive")


def _deferred(tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
              make_cache: Callable[..., WorkerCache], tiers: str) -> WorkerCache:
    cache = make_cache(make_catalog(tiny_adapters(3, rank="16")[0].parent), num_slots=1, chunk_bytes=0, tiers=tiers)
    streams = CpuStreams(cache.device, deferred=True)
    streams.trace = deque(maxlen=4096)
    use_streams(cache, streams)  # (the index uploads keep their own: untraced)
    return cache


def file_shard(cache: WorkerCache, name: str) -> torch.Tensor:
    from tests.test_worker_cache import file_entries

    layout = cache.layout_of(name)
    out = torch.zeros(layout.numel, dtype=cache.dtype)
    for (layer, module, ab), t in file_entries(cache.catalog.get(name).weights, layout).items():
        e = layout.entry(layer, module, ab)
        out[e.offset : e.offset + e.numel].view(e.shape).copy_(t)
    return out


def test_pipelined_acquire_waits_layer_by_layer_on_chunk_events(deferred_cache: WorkerCache) -> None:
    cache, streams = deferred_cache, deferred_cache.streams
    assert isinstance(streams, CpuStreams)
    name = "adapter-000"
    plan = cache.plan_of(name)
    assert len(plan.chunks) == 2  # the tiny model's two layers
    batch = cache.acquire([name], pipelined=True)
    assert batch.waits is not None and cache.residency()[0]["state"] == "loading"
    want, slot = file_shard(cache, name), batch.slots[0]
    c0, c1 = plan.chunks
    assert not torch.equal(cache.shard(slot)[c0.start : c0.stop], want[c0.start : c0.stop]), "nothing copied yet"
    batch.waits.before(0)  # layer 0's op: the compute stream waits on chunk 0 only
    assert torch.equal(cache.shard(slot)[c0.start : c0.stop], want[c0.start : c0.stop])
    assert not torch.equal(cache.shard(slot)[c1.start : c1.stop], want[c1.start : c1.stop]), "chunk 1 still in flight"
    assert cache.meta.host_rank[slot].sum() > 0, "the slot's kernel metadata travels with chunk 0"
    batch.waits.before(1)
    assert torch.equal(cache.shard(slot)[: c1.stop], want)
    waits = [op[1] for op in streams.trace if op[0] == "compute_wait"]
    copies = [op[3] for op in streams.trace if op[0] == "copy"]
    assert waits == copies, "one stream wait per chunk, in layer order, on exactly that chunk's event"
    batch.waits.finish()  # nothing left: no further wait
    assert sum(op[0] == "compute_wait" for op in streams.trace) == 2
    cache.release(batch)
    cache.settle()
    assert cache.residency()[0]["state"] == "ready"  # READY only now that every chunk completed
    cache.check_integrity()


def test_whole_acquire_waits_on_the_last_chunk(deferred_cache: WorkerCache) -> None:
    cache, streams = deferred_cache, deferred_cache.streams
    batch = cache.acquire(["adapter-001"])  # overlap / ondemand: the whole adapter before the step
    assert batch.waits is None
    assert torch.equal(cache.shard(batch.slots[0])[: cache.layout_of("adapter-001").numel],
                       file_shard(cache, "adapter-001"))
    last = [op for op in streams.trace if op[0] == "copy"][-1][3]
    assert [op[1] for op in streams.trace if op[0] == "compute_wait"] == [last]
    cache.release(batch)
    cache.check_integrity()


@pytest.mark.parametrize("tiers", ["inclusive", "exclusive"])
def test_slot_reuse_waits_on_the_last_use_of_every_chunk(
    tiny_adapters: Callable[..., list[Path]], make_catalog: Callable[..., AdapterCatalog],
    make_cache: Callable[..., WorkerCache], tiers: str
) -> None:
    """Invariant 2 with chunks: a load into a reused slot issues its first chunk after a wait on the event
    its previous adapter's last batch recorded at release, and every later chunk behind it on the copy stream.
    Exclusive tiers: the evicted shard's write-back is issued before it, and each chunk also waits for the piece
    of the write-back that covers its range (never for the release again)."""
    cache = _deferred(tiny_adapters, make_catalog, make_cache, tiers)
    streams = cache.streams
    assert isinstance(streams, CpuStreams) and streams.trace is not None
    for name in ("adapter-000", "adapter-001", "adapter-002", "adapter-000"):
        batch = cache.acquire([name], pipelined=True)
        assert batch.waits is not None
        for layer in range(cache.catalog.shape.num_layers):
            batch.waits.before(layer)
        cache.release(batch)
        cache.settle()
        cache.check_integrity()
    ops = list(streams.trace)
    releases = [i for i, op in enumerate(ops) if op[0] == "compute"]
    copies_in = [i for i, op in enumerate(ops) if op[0] == "copy" and op[1][0] != "write-back"]
    backs = [i for i, op in enumerate(ops) if op[0] == "copy" and op[1][0] == "write-back"]
    firsts = [i for i in copies_in if ops[i][1][1] == 0]
    assert len(firsts) == 4 and len(releases) == 4
    assert (len(backs) > 0) == (tiers == "exclusive")
    for k, i in enumerate(firsts):
        after = _events(ops[i][2])
        if k == 0:
            assert after == ()  # a fresh slot
            continue
        last_release = max(j for j in releases if j < i)
        assert any(a is ops[last_release][2] for a in after), "the first chunk waits on the slot's last use"
        if tiers == "exclusive":
            back = [j for j in backs if last_release < j < i]
            assert back, "the evicted shard is written back before the next load's first chunk"
            assert any(a is ops[back[0]][3] for a in after), "and the first chunk waits for its first piece"
        later = [j for j in copies_in if j > i and ops[j][1][0] == ops[i][1][0]]
        for j in later[: len(cache.plan_of('adapter-000').chunks) - 1]:
            assert not any(a is ops[last_release][2] for a in _events(ops[j][2]))  # behind the first on the stream
            assert tiers == "exclusive" or ops[j][2] is None


def _events(after: object) -> tuple[object, ...]:
    """A traced copy's ``after``: None, one event, or a tuple of them (``copy_chunk``)."""
    return () if after is None else after if isinstance(after, tuple) else (after,)


def test_a_chunk_of_a_failed_load_raises_for_its_waiters(deferred_cache: WorkerCache) -> None:
    cache = deferred_cache
    batch = cache.acquire(["adapter-000"], pipelined=True)
    assert batch.waits is not None
    load = batch.waits.loads[0]
    event = load.chunk_event(1)  # issued: its event comes back at once
    assert isinstance(event, HostEvent)
    with pytest.raises(LoadFailed, match="chunk 5"):
        load.fail(RuntimeError("read failed"))
        load.chunk_event(5)
    cache.release(batch)
    cache.streams.run_copies()  # type: ignore[attr-defined]


def test_reads_stream_chunk_by_chunk_before_the_read_ends(tiny_adapters: Callable[..., list[Path]],
                                                          make_catalog: Callable[..., AdapterCatalog]) -> None:
    """The first chunk is in the arena (and a load could copy it) while the read of the last one is still
    to come; in reader processes and in threads alike, and the staged bytes equal the file's."""
    catalog = make_catalog(tiny_adapters(1, rank="16")[0].parent)
    spec = catalog.get("adapter-000")
    from lora_cache.adapters.shards import shard_layout

    layout: ShardLayout = shard_layout(spec, catalog.shape, 1, 0, torch.bfloat16)
    plan = chunk_plan(layout.entries, layout.numel, catalog.shape.num_layers, 2, 0)
    for reads in ("thread", "process"):
        tier = HostTier(HostTierConfig(host_bytes=1 << 20, read_threads=1, pin=False, reads=reads))
        try:
            seen: list[tuple[int, bool, bool]] = []

            def on_chunk(entry: HostEntry, count: int, hit: bool, seen: list = seen) -> None:
                seen.append((count, entry.ready.done(), hit))

            future, hit = tier.fetch(spec, layout, chunks=plan.entry_spans, on_chunk=on_chunk)
            entry = future.result(timeout=120)
            assert not hit and [c for c, _, _ in seen] == [1, 2], reads
            assert seen[0][1] is False, f"{reads}: chunk 1 reported before the read ended"
            seen.clear()
            tier.fetch(spec, layout, on_chunk=on_chunk)  # a hit: every chunk at once, before fetch returns
            assert seen == [(2, True, True)]
            tier.release(entry.key)
            tier.release(entry.key)
            tier.check_integrity()
        finally:
            tier.close()


def test_pipelined_rule_is_registered_and_benchmarked() -> None:
    rule = ADMISSION["pipelined"]()
    request = Request(0, "a", 4, 1, 0.0)
    assert rule.pipelined and rule.prefetch and not ADMISSION["overlap"].pipelined
    assert not rule.admits(request, Readiness.NOT_READY) and rule.admits(request, Readiness.READY)
    assert rule.loading and rule.admits(request, Readiness.LOADING)  # its copy issued: in any batch
    assert not rule.admits(request, Readiness.FAILED) and not ADMISSION["overlap"].loading
    assert not ADMISSION["overlap"]().admits(request, Readiness.LOADING)  # overlap waits for the whole load
    assert BENCH_POLICIES["pipelined"].admission == "pipelined"
