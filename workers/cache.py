"""The worker cache: one TP rank's adapters in GPU slots, loaded on a side stream (lifecycle steps 5-9).

It composes the catalog, the host tier, the slot book (slot table, loads, counters, residency changes)
and the load path (``workers/gpu/loads.py``: staging, slot, chunked copies, READY), and holds no
allocation or eviction logic of its own. The engine calls ``acquire`` / ``release`` each step; the
controller (or a local caller) calls ``prefetch`` / ``stage`` / ``evict``, which start or undo loads.

Every residency change, whoever caused it (a command, an engine's on-demand load, the LRU eviction a
load makes), is handed to ``on_change`` as one ``Delta``, in the order the changes happened (step 7).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.adapters.chunks import MIN_CHUNK_BYTES, ChunkPlan, chunk_plan
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shapes import MODULE_ORDER, ModelShape
from lora_cache.adapters.shards import ShardLayout, max_shard_numel, shard_layout
from lora_cache.errors import ConfigError
from lora_cache.vocab import NAMESPACE, AdapterKey, Delta, ReadinessRecord
from workers.counters import host_counts, resident_prefetches
from workers.gpu.acquire import Acquirer, AdapterRef, Batch
from workers.gpu.book import SlotBook
from workers.gpu.lend import PoolLender
from workers.gpu.loads import LoadPath
from workers.gpu.slots import SlotPhase
from workers.gpu.streams import make_streams, resolve_device
from workers.kernels.meta import OFFSET_ALIGN, SlotMeta, shard_dims
from workers.lru import BoundedLRU
from workers.reads.device import ImageReads, ImageShard
from workers.reads.fill_graph import FillGraphs
from workers.reads.threads import ranks_on_host
from workers.staging.disk_tier import DiskTier, DiskTierConfig
from workers.staging.host_config import HostTierConfig
from workers.staging.host_tier import HostEntry, HostTier

ON_MISS = ("load", "error")  # acquire of a non-resident adapter: load it on demand, or refuse


@dataclass(frozen=True)
class WorkerConfig:
    """One TP rank's cache: slots, dtype, device and its host tier."""

    num_slots: int = field(default=8, metadata={"help": "GPU slots: the most adapters resident at once (each holds "
                                                        "one adapter's shard, in a run of pages)",
                                                "aliases": ("--slots",)})
    page_rank: int = field(default=0, metadata={
        "help": "GPU pages sized for a shard of this LoRA rank: an adapter takes the pages its own rank needs "
                "(0: the catalog's max_rank, one page per adapter)"})
    pool_pages: int = field(default=0, metadata={
        "help": "GPU pages in the pool (0: as many as num_slots shards of the max rank take, the slots' bytes)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel size of the replica"})
    tp_rank: int = field(default=0, metadata={"help": "this worker's TP rank"})
    dtype: str = field(default="bfloat16", metadata={"help": "slot dtype: bfloat16, float16 or float32"})
    device: str = field(default="auto", metadata={"help": "cuda, cuda:N, cpu or auto"})
    max_batch: int = field(default=256, metadata={"help": "most adapters one acquire() may name"})
    on_miss: str = field(default="load", metadata={"help": "acquire of a non-resident adapter: load or error"})
    chunk_bytes: int = field(default=MIN_CHUNK_BYTES, metadata={
        "help": "least bytes of a load's layer-ordered chunks (each read, copied and waited on by itself); "
                "0: a chunk per layer"})
    host: HostTierConfig = field(default_factory=HostTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ConfigError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.page_rank < 0 or self.pool_pages < 0:
            raise ConfigError(f"page_rank ({self.page_rank}) and pool_pages ({self.pool_pages}) must be >= 0 "
                              "(0: pages of the max rank's size, and as many as num_slots of them)")
        if self.tp < 1 or not 0 <= self.tp_rank < self.tp:
            raise ConfigError(f"tp_rank {self.tp_rank} must be in 0..{self.tp - 1} for tp {self.tp}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.on_miss not in ON_MISS:
            raise ConfigError(f"on_miss must be one of {ON_MISS}, got {self.on_miss!r}")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.chunk_bytes < 0:
            raise ConfigError(f"chunk_bytes must be >= 0 (0: a chunk per layer; default {MIN_CHUNK_BYTES}), "
                              f"got {self.chunk_bytes}")


KEPT_SHARDS = 4096  # versions (and patterns) whose layouts and plans a rank keeps


class RankShards:
    """This rank's layout and chunk plan of each adapter version, each computed once per spec (specs are
    immutable; bounded). A new version of a module pattern seen before (its ``modules``, interned by
    ``peft._interned``) takes that pattern's entries and chunk plan as they are: a pushed version's load (issue 44
    item 5) pays no per-module Python for them (~0.4 ms of an 8B rank-16 shard's on this CPU,
    bench/reports/issue-44.md). Kept by identity (a spec, a modules tuple, an entries tuple: each compared with
    ``is``), so a lookup costs no hash of a spec's 224 modules."""

    def __init__(self, catalog: AdapterCatalog, tp: int, rank: int, dtype: torch.dtype, chunk_bytes: int) -> None:
        self.catalog, self.tp, self.rank, self.dtype, self.chunk_bytes = catalog, tp, rank, dtype, chunk_bytes
        self._layouts: BoundedLRU[tuple[str, str], tuple[AdapterSpec, ShardLayout]] = BoundedLRU(KEPT_SHARDS)
        self._patterns: BoundedLRU[int, tuple[Any, ShardLayout]] = BoundedLRU(KEPT_SHARDS)  # id(modules) -> a layout
        self._plans: BoundedLRU[int, tuple[Any, ChunkPlan]] = BoundedLRU(KEPT_SHARDS)  # id(entries) -> their plan

    def layout(self, spec: AdapterSpec) -> ShardLayout:
        kept = self._layouts.get((spec.name, spec.version))
        if kept is not None and kept[0] is spec:
            return kept[1]
        seen = self._patterns.get(id(spec.modules))
        if seen is not None and seen[0] is spec.modules:
            layout = replace(seen[1], adapter=spec.name, version=spec.version)
        else:
            layout = shard_layout(spec, self.catalog.shape, self.tp, self.rank, self.dtype)
            self._patterns.put(id(spec.modules), (spec.modules, layout))
        self._layouts.put((spec.name, spec.version), (spec, layout))
        return layout

    def plan(self, spec: AdapterSpec) -> ChunkPlan:
        layout = self.layout(spec)
        kept = self._plans.get(id(layout.entries))
        if kept is not None and kept[0] is layout.entries:
            return kept[1]
        plan = chunk_plan(layout.entries, layout.numel, self.catalog.shape.num_layers, self.dtype.itemsize,
                          self.chunk_bytes)
        self._plans.put(id(layout.entries), (layout.entries, plan))
        return plan


def pool_pages(config: WorkerConfig, shape: ModelShape, max_rank: int, dtype: torch.dtype) -> tuple[int, int]:
    """(elements of a page, pages in the pool) for ``config`` (issue 43): pages sized for a shard of ``page_rank``
    (aligned for the kernels), and ``pool_pages`` of them, or as many as ``num_slots`` shards of ``max_rank`` take.
    A bad setting is refused here, naming it, before anything is allocated (the simulator sizes its pool here too)."""
    slot_numel = max_shard_numel(shape, config.tp, max_rank, dtype)
    if config.page_rank > max_rank:
        raise ConfigError(f"page_rank {config.page_rank} is above the catalog's max_rank {max_rank}: a page would "
                          f"hold more than the largest shard; give 1..{max_rank} (0: one page per adapter)")
    paged = bool(config.page_rank) and config.page_rank < max_rank
    page = max_shard_numel(shape, config.tp, config.page_rank, dtype) if paged else slot_numel
    page = -(-page // OFFSET_ALIGN) * OFFSET_ALIGN
    per_slot = -(-slot_numel // page)  # the pages of a shard of the max rank
    pages = config.pool_pages or (config.num_slots * slot_numel // page if paged else config.num_slots)
    if pages < per_slot:
        raise ConfigError(f"pool_pages {pages} cannot hold one adapter of rank {max_rank} ({per_slot} pages of "
                          f"rank {config.page_rank or max_rank}); give pool_pages >= {per_slot} or lower max_rank")
    return page, pages


def _host_changed(book: SlotBook, key: AdapterKey, present: bool) -> None:
    """The host tier gained (``staged``) or lost (``unstaged``) a whole shard: one delta to ``on_change``, as the
    slots' changes are (the controller's routing knows where a shard is one copy from a GPU slot)."""
    if book.on_change is not None:
        book.on_change(Delta(key.name, key.version, "staged" if present else "unstaged"))


class WorkerCache:
    """One TP rank's adapter cache.

    ``on_change``: called with one ``Delta`` per residency change, in the order of the changes, never
    under the cache's lock (it may read the cache; it must not wait for a load): a slot taken for a load
    ("loading", after "gone" for the adapter that slot's LRU eviction removed), READY ("ready"), freed by
    ``evict`` ("gone"), or a started load that failed before it had a slot ("failed"); and what the host tier
    holds, apart from the slots: a whole shard read in ("staged"), dropped by its LRU ("unstaged"). A change is
    reported before the call that made it returns and before the load's future resolves; the residency
    those changes add up to is ``residency()``. ``restate`` reports an adapter's state again ("in_use"
    if a batch holds it), in order with those changes.
    """

    def __init__(self, config: WorkerConfig, catalog: AdapterCatalog,
                 on_ready: Callable[[ReadinessRecord], None] | None = None, compute_stream: Any = None,
                 on_change: Callable[[Delta], None] | None = None, service: str = NAMESPACE) -> None:
        # the host tier's size resolved once (host_bytes 0: a share of this host's memory over its GPU ranks)
        config = replace(config, host=config.host.sized(ranks_on_host(config.tp)))
        self.config, self.catalog = config, catalog
        self.worker = config  # ``config`` under the name ``Attachment`` gives it (``workers.attach.seam.EngineCache``)
        self.device = resolve_device(config.device)
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.slot_numel = max_shard_numel(catalog.shape, config.tp, catalog.config.max_rank, self.dtype)
        slot_bytes = self.slot_numel * self.dtype.itemsize
        if config.host.host_bytes < slot_bytes:
            raise ConfigError(f"host_bytes ({config.host.host_bytes / 2**20:.1f} MiB) must hold at least one slot "
                              f"({slot_bytes / 2**20:.1f} MiB for {catalog.shape.name}, rank {catalog.config.max_rank}"
                              f", TP {config.tp}); raise host_bytes or lower max_rank")
        self.streams = make_streams(self.device, compute_stream)
        self.page_numel, num_pages = pool_pages(config, catalog.shape, catalog.config.max_rank, self.dtype)
        # the pool's pages one after another; the kernels see it as [num_slots, elements] with a row stride of 0,
        # so that a slot's row is the whole pool and its offsets are the pool's (its pages' start added: meta.write)
        self.pool = torch.empty(num_pages * self.page_numel, dtype=self.dtype, device=self.device).as_strided(
            (config.num_slots, num_pages * self.page_numel), (0, 1))
        self.pool_bytes = num_pages * self.page_numel * self.dtype.itemsize  # the GPU bytes of every page
        # the kernels' per-slot offsets / ranks / scalings; a reused slot's row is overwritten by its next load
        self.meta = SlotMeta(config.num_slots, catalog.shape.num_layers, MODULE_ORDER, self.device,
                             max_rank=catalog.config.max_rank, dims=shard_dims(catalog.shape, config.tp),
                             slot_numel=self.slot_numel)
        # adapters from an object store, in the service's own directory on this node
        self.disk = DiskTier(config.disk, catalog.config.store_timeout_s, service)
        self.host = HostTier(config.host, ranks_on_host(config.tp), self.disk)
        self.book = SlotBook(config.num_slots, on_change, num_pages)  # slots, pages, loads, counters; under its lock
        self.host.on_change = functools.partial(_host_changed, self.book)  # what the host tier holds, as deltas too
        self.counters = self.book.counters
        self.shards = RankShards(catalog, config.tp, config.tp_rank, self.dtype, config.chunk_bytes)
        self.acquirer = Acquirer(self.book, catalog, self.streams, self.device, config.max_batch, config.on_miss,
                                 config.tp_rank, functools.partial(self.prefetch, on_demand=True))
        self.load_path = LoadPath(self.book, self.host, self.streams, self.pool, self.meta, config.tp_rank, on_ready,
                                  catalog.__contains__, self.page_numel)
        # the pool lends whole pages to its engine and takes them back (issue 43 item 3)
        self.lender = PoolLender(self.book, self.load_path, self.host, self.streams, self.load_path.flat,
                                 self.page_numel)
        # an older version a slot here holds stays loadable past keep_versions; it retires once no slot holds it
        catalog.use(self.book.versions_held)
        self.book.on_freed = catalog.trim
        self.unfence = self.book.unfence  # lifts ``ready_keys``' fence (the engine's ``EngineCache.unfence``)
        self.image_reads = ImageReads()  # pushed images' read plans, one per header and layout (``load_image``)
        self.fill_graphs = FillGraphs()  # their fills captured as CUDA graphs, one per buffer and plan (a GPU's)

    @property
    def on_change(self) -> Callable[[Delta], None] | None:
        return self.book.on_change

    @on_change.setter
    def on_change(self, on_change: Callable[[Delta], None] | None) -> None:
        self.book.on_change = on_change

    # -- control: prefetch / stage / evict (lifecycle steps 4-7) ----------------------------------
    def prefetch(self, name: str, version: str | None = None, *, on_demand: bool = False,
                 slot_wait_s: float = 0.0, commanded: bool = False) -> Future[ReadinessRecord]:
        """Start loading ``name`` (idempotent). The future resolves when this rank's shard is READY.

        Raises only when no load is started (unknown adapter or version, bad shapes); a started load that
        fails (no GPU room, a bad read, a shard larger than the host tier) fails its future and is reported
        "failed". A load whose shard finds every host-tier byte held by loads in flight waits for one of
        them to let go of its entry (FIFO; ``host_waits``), as one that finds every slot loading waits for
        a slot; it fails at once only if nothing in flight could free room.
        ``on_demand``: started by an acquire that missed (not counted as a prefetch); ``slot_wait_s`` (on demand
        only): how long it waits for a batch to let go of a slot when every slot is held; ``commanded``: the
        controller's command (``CommandGate``); any other load is the rank's own, and its deltas say so
        (``Delta.acquired``: the controller believes a READY only of a load it commanded or one so marked)."""
        spec = self.catalog.get(name, version)
        layout = self.shards.layout(spec)  # bad shapes fail here, before anything is reserved
        return self.load_path.start(spec, AdapterKey(name, spec.version), layout, self.shards.plan(spec), on_demand,
                                    slot_wait_s, commanded)

    def load_image(self, name: str, version: str, image: torch.Tensor, head: bytes, after: Any = None, *,
                   commanded: bool = False, settle_s: float = 0.0) -> Future[ReadinessRecord]:
        """Load this rank's shard of ``name@version`` from a pushed image in device memory (issue 44 item 5): the
        version's safetensors image, whole (``head``: its first 8 + header-length bytes, as the trainer sent them;
        ``after``: the trainer's event after its last write), on this rank's device. A slot as any load's, then one
        gather into it on the copy stream (``workers.reads.device``), READY once it completed and proved finite; a
        shard that is not finite fails the load and leaves the rank as it was. Idempotent as ``prefetch``.

        The image is taken to be the version's bytes: the trainer names the version the controller registered for its
        push (``lora_cache.controller.device_pushes``). Its header must be the one the version was registered with
        (its CRC) and its size that version's (a device push's declaration, ``DeviceSource``; else the version's
        file), or it is refused before anything is reserved. ``settle_s``: for a caller that waits for the load, how
        long this call may wait for the gather it issued and make the load READY itself (``LoadPath.start_image``)."""
        marks = [("spec", time.perf_counter())]  # its phases before the load exists (``SlotLoad.marks``, the probes)
        spec = self.catalog.get(name, version)
        layout = self.shards.layout(spec)
        marks.append(("layout", time.perf_counter()))
        read = self.image_reads.read(spec, layout, head, image)
        plan = self.shards.plan(spec)
        marks.append(("planned", time.perf_counter()))
        return self.load_path.start_image(AdapterKey(name, spec.version), layout, plan,
                                          ImageShard(read, image, after, marks, self.fill_graphs), commanded,
                                          settle_s)

    def stage(self, name: str, version: str | None = None) -> Future[HostEntry] | None:
        """Read this rank's shard of ``name`` into the host tier, with no slot (idempotent): what the planner
        sends for a needed adapter that found no GPU room, so that its load, when a slot frees, is one copy.

        The staged shard's future (done when it is on the host; the read in flight, or the entry, if it was
        staged already), or None when nothing is staged: the adapter has a slot or a load on its way to
        one, or the host tier has no room (every byte held by loads in flight, or loads waiting for room;
        counted in ``stage_failures``). A stage never waits for room as a load does (``prefetch``): it fails
        softly instead, so that staging never holds back, or takes room ahead of, a load that is needed.
        Raises only for an unknown adapter or version, or bad shapes. A failed read is counted there too
        and leaves the tier as it was. The entry keeps no reference: it is the LRU's like any other, and
        ``stages`` counts the reads a stage started. A warm stage's (within ``host.demand.speculative()``) fetch of
        a store adapter's object yields the store to demand reads until a load joins it (``DemandMarks.yields``)."""
        spec = self.catalog.get(name, version)
        layout = self.shards.layout(spec)
        key, warm = AdapterKey(name, spec.version), self.host.demand.warm
        if spec.store is not None and not warm and not self.host.contains(key):
            self.disk.stage(spec)  # from the store to this node's disk, even where the host tier has no room
        staged = self.load_path.stage(spec, key, layout, self.shards.plan(spec))
        if staged is None and warm and spec.store is not None and not self.host.contains(key):
            # a warm stage with no host room: the object to the node's disk only, yielding the store as the warm
            # stage's own read would (its read fetches through the disk: ``DemandMarks.yields``)
            self.disk.stage(spec, self.host.demand.busy)
        return staged

    def evict(self, name: str, version: str | None = None) -> bool:
        """Free the adapter's slot if it is READY and unused; False if absent, loading or in use."""
        version = version or self.catalog.current(name)
        with self.book.lock:
            key = AdapterKey(name, version)
            slot = self.book.table.lookup(key)
            if slot is None or not self.book.table.evict(key):
                return False
            self.load_path.vacate(slot.index)  # retired, "gone"; exclusive tiers: the shard back into the host tier
        self.book.report()
        self.host.report()
        return True

    def restate(self, name: str, version: str) -> None:
        """Report an adapter's state again, in order with its changes ("loading", "ready" or "in_use"; nothing
        if absent): after a refused evict, whose sender assumed it gone."""
        key = AdapterKey(name, version)
        with self.book.lock:
            slot = self.book.table.lookup(key)
            if slot is not None:
                self.book.changed(key, "in_use" if slot.refs else slot.state.value)
        self.book.report()

    # -- engine: acquire / release (lifecycle step 9: ``workers.gpu.acquire``) ---------------------------
    def acquire(self, adapters: Sequence[AdapterRef], *, partial: bool = False, pipelined: bool = False,
                slot_wait_s: float = 0.0) -> Batch:
        """Slots for a batch's adapters; the compute stream waits (on the GPU) for loads in flight: for
        all of each (the host waiting until its last chunk's copy is issued), or, ``pipelined``, layer by
        layer through the batch's ``waits`` (``workers.gpu.chunk_waits``; the host waits only for a slot).

        Each adapter is a name (its current version) or an ``AdapterKey``: exactly that version, loaded if
        it is not resident (invariant 1: a TP rank never computes a request with another version than
        the one it was admitted with). ``partial``: an adapter that cannot be held (unknown version, a
        failed load, no slot) gets slot -1 and is listed in ``failed`` instead of failing the batch.
        ``slot_wait_s``: as ``Acquirer.acquire``."""
        return self.acquirer.acquire(adapters, partial=partial, pipelined=pipelined, slot_wait_s=slot_wait_s)

    def acquire_ready(self, adapters: Sequence[AdapterRef]) -> Batch | None:
        """References on those of ``adapters`` READY here, taken atomically (no load started, no hit counted):
        what an engine pins before it schedules (``Acquirer.acquire_ready``). None if none is ready."""
        return self.acquirer.acquire_ready(adapters)

    def release(self, batch: Batch) -> None:
        """The batch's kernels are enqueued: record their completion as the slots' last use."""
        self.acquirer.release(batch)

    def plan_of(self, name: str, version: str | None = None) -> ChunkPlan:
        """The chunk plan of ``name``'s shard here (how its loads are read, copied and waited on)."""
        return self.shards.plan(self.catalog.get(name, version))

    # -- introspection ------------------------------------------------------------------------------
    def ready_keys(self, fence: bool = False) -> set[AdapterKey]:
        """Adapter versions READY here; ``fence``: each stays resident until ``unfence`` (an engine's report: what it
        offers for admission is still here when its step holds it; ``workers.gpu.slots``, the fence)."""
        with self.book.lock:
            if fence:
                self.book.table.fence()
            return {s.key for s in self.book.table.slots if s.key is not None and s.state is SlotPhase.READY}

    def issued_keys(self) -> set[AdapterKey]:
        """Adapter versions still LOADING here whose every copy is issued (the read done): READY within a
        copy's time, so a pipelined step may run them (``workers.engine.admission``'s LOADING)."""
        with self.book.lock:
            return {s.key for s in self.book.table.slots if s.key is not None and s.state is SlotPhase.LOADING
                    and self.book.loads[s.index].issued.is_set() and self.book.loads[s.index].error is None}

    def issued_copies(self) -> dict[AdapterKey, tuple[int, float, int]]:
        """``issued_keys`` -> (the bytes of each one's copy, the ``perf_counter`` time its first chunk's copy was
        issued, the bytes the write-back stream had still to copy out, when it took its slot, before the range it
        overwrites was out: 0 for none, ``SlotLoad.behind``): what ``workers.engine.admission.CopyClock`` predicts
        its landing from."""
        with self.book.lock:
            loads = [(s.index, s.key, self.book.loads[s.index]) for s in self.book.table.slots
                     if s.key is not None and s.state is SlotPhase.LOADING]
            return {key: (load.layout.nbytes, next((t for phase, t in load.marks if phase == "issue 0"), load.t0),
                          load.behind)
                    for index, key, load in loads if load.issued.is_set() and load.error is None}

    def ready_names(self) -> set[str]:
        """Adapters READY here (any version): the engine's readiness report, without ``residency``'s rows."""
        with self.book.lock:
            return {s.key.name for s in self.book.table.slots if s.key is not None and s.state is SlotPhase.READY}

    def residency(self) -> list[dict[str, object]]:
        with self.book.lock:
            return [{"adapter": s.key.name, "version": s.key.version, "slot": s.index, "state": s.state.value,
                     "refs": s.refs, "acquired": not self.book.loads[s.index].commanded}  # the rank's own load
                    for s in self.book.table.slots if s.key is not None]

    def stats(self) -> dict[str, object]:
        table = self.book.table
        with self.book.lock:
            snap = self.counters.snapshot()
            snap.update(host_counts(self.host))
            snap.update(slots_ready=table.count(SlotPhase.READY), slots_loading=table.count(SlotPhase.LOADING),
                        host_bytes_used=self.host.arena.used_bytes, **resident_prefetches(self.book.loads.values()))
        snap.update(self.disk.stats())
        snap["read_ways"] = self.host.cold.ways.report()  # per file system and size class: each way's rate, the choice
        return snap

    def slot_view(self, slot: int, layout: ShardLayout, layer: int, module: str, ab: str) -> torch.Tensor:
        """One matrix of a resident shard, as a view of the pool (for engines and tests)."""
        e = layout.entry(layer, module, ab)
        return self.shard(slot)[e.offset : e.offset + e.numel].view(e.shape)

    def shard(self, slot: int) -> torch.Tensor:
        """The packed shard ``slot`` holds (or is loading), as a view of the pool's pages."""
        with self.book.lock:
            return self.load_path.shard(slot)


    def layout_of(self, name: str, version: str | None = None) -> ShardLayout:
        return self.shards.layout(self.catalog.get(name, version))

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every load now in flight has ended (READY or failed; its residency change reported
        before its future resolves): for tests, and callers that want a quiet cache. No sleeps."""
        with self.book.lock:
            futures = [ld.future for ld in (*self.book.loads.values(), *self.book.pending.values())]
        for f in futures:
            f.exception(timeout=timeout)

    def check_integrity(self) -> None:
        self.book.check_integrity(self.streams.done)
        self.host.check_integrity()

    def close(self) -> None:
        self.catalog.unuse(self.book.versions_held)
        self.load_path.close()  # loads waiting for host room fail, issued copies complete, the host tier closes
        self.disk.close()
