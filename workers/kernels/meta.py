"""Kernel metadata on the device: per-slot LoRA tables and per-batch slot indices (lifecycle steps 6, 9).

Both are preallocated at their maximum size and filled in place from pinned host memory with one
``non_blocking`` copy, so a kernel launch needs no host sync and a captured CUDA graph stays valid.

``SlotMeta``: one row per slot. For every (layer, module) the element offsets of lora_A and lora_B
inside the slot, the rank (0 = module not adapted) and the scaling. A row is written on the load's
copy stream right after the slot's data, so it is valid exactly when the slot is.

``BatchMeta``: which slot each token of a batch uses, given as segments (SGMV, prefill: tokens grouped
by adapter) or per token (BGMV, decode). Either setter also groups the batch's adapted tokens by slot on
the host: ``token_perm`` lists them slot by slot and ``chunks`` cuts each slot's run into tiles of at
most ``chunk`` tokens, so the decode kernel reads each adapter once per tile instead of once per token.
SGMV reads ``token_slot``; ``seg_start``/``seg_slot`` are kept for engines that want the segment view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lora_cache.adapters.peft import AdapterSpec, LoraModule
from lora_cache.adapters.shapes import MODULES, ModelShape
from lora_cache.adapters.shards import ShardEntry, ShardLayout, base_slices

# bytes per (layer, module) in a SlotMeta row: a_off int64, b_off int64, rank int32, scale float32
_ENTRY_BYTES = 8 + 8 + 4 + 4
MODES = ("sgmv", "bgmv")
OFFSET_ALIGN = 16  # kernels assume every matrix offset is a multiple of this (shards align to 128 bytes)
MAX_FUSED = 4  # modules fused into one launch (q/k/v is 3)
MIN_CHUNK = 16  # fewest tokens a grouped-decode tile is sized for (tl.dot takes 16 rows at least)
MAX_PLANS = 512  # launch plans kept per SlotMeta (args.py); all dropped when full


def decode_chunk(tokens: int) -> int:
    """Tokens per grouped-decode tile for a batch of ``tokens``: from the size only, so CUDA graphs stay valid."""
    return 16 if tokens <= 64 else 32 if tokens <= 128 else 64


def shard_dims(shape: ModelShape, tp: int, modules: Sequence[str] | None = None) -> dict[str, tuple[int, int]]:
    """module -> (in, out) features of one TP rank's shard: what x and y of ``lora_apply`` hold."""
    dims = {}
    for module in modules or MODULES:
        ins, outs = base_slices(module, *shape.dims(module), tp, 0)
        dims[module] = (_width(ins), _width(outs))
    return dims


def _width(s: slice) -> int:
    return s.stop - s.start


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def concrete(device: torch.device | str) -> torch.device:
    """``cuda`` as the ``cuda:N`` it means now, so devices compare equal to the tensors' own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


KNOWN_LAYOUTS = 64  # rank patterns whose checked rows a SlotMeta keeps (a fleet's adapters share a few)

class SlotMeta:
    """Per-slot device tables of offsets, ranks and scalings; see the module docstring.

    Device views, each ``[num_slots, num_layers, len(modules)]``: ``a_off``/``b_off`` (int64, elements from the
    start of the slot's row of the pool: a worker's pool rows all start at its first element, so these are the
    pool's own offsets, ``WorkerCache``), ``rank`` (int32, 0 = not adapted), ``scale`` (float32). The same views
    of the pinned host staging rows (``host_*``) mirror what was last written, for the CPU reference path.
    """

    def __init__(self, num_slots: int, num_layers: int, modules: tuple[str, ...], device: torch.device, *,
                 max_rank: int = 128, dims: Mapping[str, tuple[int, int]] | None = None,
                 slot_numel: int | None = None) -> None:
        if num_slots < 1 or num_layers < 1 or not modules:
            raise ValueError(f"SlotMeta needs num_slots >= 1, num_layers >= 1 and modules, got {num_slots}, "
                             f"{num_layers}, {modules!r}")
        if len(set(modules)) != len(modules):
            raise ValueError(f"SlotMeta modules {modules!r} repeat a name; list each module once")
        if max_rank < 1:
            raise ValueError(f"SlotMeta max_rank must be >= 1, got {max_rank}")
        self.num_slots, self.num_layers, self.modules = num_slots, num_layers, tuple(modules)
        self.device, self.max_rank, self.slot_numel = concrete(device), max_rank, slot_numel
        self.dims: dict[str, tuple[int, int]] = dict(dims or {})  # module -> shard (in, out); learned if not given
        self.dtype: torch.dtype | None = None  # dtype of the layouts written (the pool's dtype)
        self.numel = [0] * num_slots  # elements of the pool row each row's offsets reach
        self.max_numel = 0  # the largest of them: what a pool's slots must hold
        # bumped whenever something the kernel wrappers check changes (dims, dtype, a larger max_numel), so
        # their validated launch plans (``plans``: args.py, at most MAX_PLANS) are keyed by it and never stale
        self.version = 0
        self.plans: dict[tuple[Any, ...], Any] = {}
        self._index = {m: i for i, m in enumerate(self.modules)}
        self._row_bytes = _ENTRY_BYTES * num_layers * len(self.modules)
        pin = _is_cuda(self.device)
        self._host = torch.zeros((num_slots, self._row_bytes), dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros((num_slots, self._row_bytes), dtype=torch.uint8, device=self.device)
        self._copied: list[Any] = [None] * num_slots  # event after each row's last copy (CUDA)
        # (id(layout.entries), id(layout.modules)) -> (the entries and modules, kept alive so their ids stay
        # theirs; (dtype, numel); the finished host row) of layouts checked and written before (``write``)
        self._rows: dict[tuple[int, int], tuple[Any, Any, tuple[torch.dtype, int], torch.Tensor]] = {}
        self.a_off, self.b_off, self.rank, self.scale = self._views(self._dev)
        self.host_a_off, self.host_b_off, self.host_rank, self.host_scale = self._views(self._host)

    def _views(self, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = (self.num_slots, self.num_layers, len(self.modules))
        n = self.num_layers * len(self.modules)
        spans = ((0, 8 * n, torch.int64), (8 * n, 16 * n, torch.int64), (16 * n, 20 * n, torch.int32),
                 (20 * n, 24 * n, torch.float32))
        return tuple(raw[:, lo:hi].view(dtype).view(shape) for lo, hi, dtype in spans)

    def module_index(self, name: str) -> int:
        if name not in self._index:
            raise KeyError(f"module {name!r} has no SlotMeta column; known modules: {list(self.modules)}")
        return self._index[name]

    def write(self, slot: int, layout: ShardLayout, spec: AdapterSpec | None = None, stream: Any = None,
              base: int = 0) -> None:
        """Fill ``slot``'s row for ``layout`` (one non-blocking copy on ``stream``, default: current), its offsets
        counted from the pool element ``base`` (where the slot's pages start: a multiple of ``OFFSET_ALIGN``).

        A layout of a rank pattern written before (``layout.entries`` and ``layout.modules``, both shared by the
        adapters of a pattern: ``shards._packed``, ``peft._interned``) is checked once: its finished row is kept,
        and a later write is that row copied into the slot's, with no per-module Python on the load's path (a
        host-tier hit's fixed cost: ~0.3 ms for Llama-3.1-8B's 224 modules before, bench/RESULTS.md, issue 30
        item 1, fourth round)."""
        self._check_slot(slot)
        self._wait_row(slot)
        key = (id(layout.entries), id(layout.modules))
        kept = self._rows.get(key) if spec is None else None
        if (kept is not None and kept[0] is layout.entries and kept[1] is layout.modules
                and kept[2] == (layout.dtype, layout.numel) and self.dtype == layout.dtype):
            self._host[slot].copy_(kept[3])
        else:
            self._fill(slot, layout, spec)
            if spec is None:
                if len(self._rows) >= KNOWN_LAYOUTS:
                    self._rows.clear()
                self._rows[key] = (layout.entries, layout.modules, (layout.dtype, layout.numel),
                                   self._host[slot].clone())
        if base:
            if base < 0 or base % OFFSET_ALIGN:
                raise ValueError(f"slot {slot}: its shard starts at pool element {base}; give a multiple of "
                                 f"{OFFSET_ALIGN} (a page boundary)")
            self.host_a_off[slot] += base
            self.host_b_off[slot] += base
        self._set_numel(slot, base + layout.numel)
        self._upload(slot, stream)

    def _fill(self, slot: int, layout: ShardLayout, spec: AdapterSpec | None) -> None:
        """Check ``layout`` (every module against the table) and write its row into the host staging row."""
        entries = {(e.layer, e.module, e.ab): e for e in layout.entries}
        modules = self._check_layout(layout, spec, entries)
        layers, cols = [m.layer for m in modules], [self._index[m.module] for m in modules]
        self._host[slot].zero_()
        a_off, b_off, rank, scale = (t.numpy() for t in (self.host_a_off, self.host_b_off, self.host_rank,
                                                         self.host_scale))
        a_off[slot, layers, cols] = [entries[(m.layer, m.module, "A")].offset for m in modules]
        b_off[slot, layers, cols] = [entries[(m.layer, m.module, "B")].offset for m in modules]
        rank[slot, layers, cols] = [m.rank for m in modules]
        scale[slot, layers, cols] = [m.scaling for m in modules]

    def clear(self, slot: int, stream: Any = None) -> None:
        """Mark every module of ``slot`` as not adapted (rank 0)."""
        self._check_slot(slot)
        self._wait_row(slot)
        self._host[slot].zero_()
        self._set_numel(slot, 0)
        self._upload(slot, stream)

    def _set_numel(self, slot: int, numel: int) -> None:
        self.numel[slot] = numel
        if numel > self.max_numel:
            self._changed()  # a pool validated for the old largest shard may be too small now
        self.max_numel = max(self.numel)

    def _changed(self) -> None:
        """What launches were validated against changed: drop their plans (the key's version guards races)."""
        self.version += 1
        self.plans.clear()

    # -- checks -----------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot!r} is out of range: SlotMeta has slots 0..{self.num_slots - 1}")

    def _check_layout(self, layout: ShardLayout, spec: AdapterSpec | None,
                      entries: dict[tuple[int, str, str], ShardEntry]) -> tuple[LoraModule, ...]:
        where = f"adapter {layout.adapter}@{layout.version}"
        if spec is not None and (spec.name, spec.version) != (layout.adapter, layout.version):
            raise ValueError(f"{where}: the spec is for {spec.name}@{spec.version}; pass the spec the layout was "
                             "built from")
        if self.dtype is not None and layout.dtype != self.dtype:
            raise ValueError(f"{where}: layout dtype {layout.dtype} differs from the {self.dtype} of the slots "
                             "written before; one pool has one dtype")
        if self.slot_numel is not None and layout.numel > self.slot_numel:
            raise ValueError(f"{where}: the shard has {layout.numel} elements but a slot holds {self.slot_numel}")
        modules = spec.modules if spec is not None else layout.modules
        learned: dict[str, tuple[int, int]] = {}
        for m in modules:
            got = self._check_module(m, entries, where)
            want = self.dims.get(m.module) or learned.setdefault(m.module, got)
            if got != want:
                raise ValueError(f"{where}: layer {m.layer} {m.module} shard is (in, out) = {got}, but this "
                                 f"SlotMeta serves {want} (another model shape or TP size?)")
        if self.dtype != layout.dtype or any(m not in self.dims for m in learned):
            self._changed()  # launches validated against the old dims or dtype must be checked again
        self.dims.update(learned)
        self.dtype = layout.dtype
        return modules

    def _check_module(self, m: LoraModule, entries: dict[tuple[int, str, str], ShardEntry],
                      where: str) -> tuple[int, int]:
        """Checks one module against the table; returns its shard's (in, out) features."""
        if m.module not in self._index:
            raise ValueError(f"{where}: module {m.module!r} has no SlotMeta column (modules {list(self.modules)})")
        if not 0 <= m.layer < self.num_layers:
            raise ValueError(f"{where}: layer {m.layer} is outside 0..{self.num_layers - 1}")
        if not 0 < m.rank <= self.max_rank:
            raise ValueError(f"{where}: layer {m.layer} {m.module} has rank {m.rank}; the kernels are set up for "
                             f"ranks 1..{self.max_rank} (SlotMeta max_rank)")
        a, b = entries.get((m.layer, m.module, "A")), entries.get((m.layer, m.module, "B"))
        if a is None or b is None:
            raise ValueError(f"{where}: the layout has no matrices for layer {m.layer} {m.module}; build the "
                             "layout from this spec (shards.shard_layout)")
        if a.offset % OFFSET_ALIGN or b.offset % OFFSET_ALIGN:
            raise ValueError(f"{where}: layer {m.layer} {m.module} matrices start at elements {a.offset} and "
                             f"{b.offset}; the kernels need multiples of {OFFSET_ALIGN} (use shards.shard_layout)")
        if a.shape[0] != m.rank or b.shape[1] != m.rank:
            raise ValueError(f"{where}: layer {m.layer} {m.module} has rank {m.rank} but its shard matrices are "
                             f"A {a.shape}, B {b.shape}")
        return a.shape[1], b.shape[0]

    # -- host row -> device row -------------------------------------------------------------------
    def _wait_row(self, slot: int) -> None:
        """The previous copy of this row must have left the host buffer before it is rewritten."""
        event = self._copied[slot]
        if event is not None and not event.query():
            event.synchronize()  # only if the same slot is rewritten while its last copy is still queued

    def _upload(self, slot: int, stream: Any) -> None:
        if not _is_cuda(self.device):
            self._dev[slot].copy_(self._host[slot])
            return
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            self._dev[slot].copy_(self._host[slot], non_blocking=True)  # the one copy of this row
            event = torch.cuda.Event()
            event.record(stream)
        self._copied[slot] = event


class BatchMeta:
    """Per-batch token -> slot indices on the device, refilled in place for every batch.

    Device views (int32), all in one buffer that one ``non_blocking`` copy fills:
    ``token_slot[:num_tokens]`` (-1 = no adapter), read by SGMV; ``seg_start`` (``num_segments + 1``
    entries) and ``seg_slot``, the segments when ``set_segments`` was used; ``token_perm``, the adapted
    tokens grouped by slot (ascending slot, token order within a slot); ``chunks`` ``[max_chunks, 3]``,
    rows ``(first position in token_perm, tokens, slot)``: each slot's run cut into tiles of at most
    ``chunk`` tokens, read by the decode kernel; rows past ``num_chunks`` have 0 tokens. ``tile_locks``
    ``[max_chunks * MAX_FUSED]``: the decode kernel's split counters, 0 at rest (every copy rewrites 0).
    ``chunk`` depends on the batch size only (``decode_chunk``, or ``chunk_tokens`` if given), and
    ``chunk_grid`` bounds the tiles from sizes only, so a captured CUDA graph stays valid for any mix.
    """

    def __init__(self, max_tokens: int, max_segments: int, device: torch.device, *,
                 num_slots: int | None = None, ring: int = 4, chunk_tokens: int | None = None) -> None:
        if max_tokens < 1 or max_segments < 1:
            raise ValueError(f"BatchMeta needs max_tokens >= 1 and max_segments >= 1, got {max_tokens}, "
                             f"{max_segments}")
        if chunk_tokens is not None and (chunk_tokens < MIN_CHUNK or chunk_tokens & (chunk_tokens - 1)):
            raise ValueError(f"chunk_tokens must be a power of two >= {MIN_CHUNK}, got {chunk_tokens}")
        self.max_tokens, self.max_segments, self.num_slots = max_tokens, max_segments, num_slots
        self.chunk_tokens = chunk_tokens
        self.device = concrete(device)
        # tiles: each slot's run adds at most one partial tile to the full ones
        self.max_chunks = -(-max_tokens // MIN_CHUNK) + min(max_tokens, num_slots or max_tokens)
        n = sum(-(-n // 4) * 4 for n in self._sizes())
        self._dev = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        self.token_slot, self.seg_start, self.seg_slot, self.token_perm, self.chunks, self.tile_locks = (
            self._split(self._dev))
        pin = _is_cuda(self.device)
        self._ring = [torch.full((n,), -1, dtype=torch.int32, pin_memory=pin) for _ in range(ring)]
        for buf in [self._dev, *self._ring]:
            self._split(buf)[5].zero_()  # counters rest at 0
        self._host_views = [tuple(v.numpy() for v in self._split(buf)) for buf in self._ring]
        self._copied: list[Any] = [None] * ring  # event after each host buffer's last copy (CUDA)
        self._next = 0
        self.num_tokens = self.num_segments = self.num_chunks = 0
        self.chunk = MIN_CHUNK  # tokens per tile of this batch
        self.mode: str | None = None  # "sgmv" or "bgmv": which setter ran last
        self.max_slot = -1  # largest slot index of the batch (checked against the pool at launch)
        self.host_token_slot = np.full(0, -1, dtype=np.int32)  # this batch's token_slot, on the host

    def _sizes(self) -> list[int]:
        """Entries of token_slot, seg_start, seg_slot, token_perm, chunks, tile_locks."""
        t, s = self.max_tokens, self.max_segments
        return [t, s + 1, s, t, 3 * self.max_chunks, MAX_FUSED * self.max_chunks]

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The regions of ``buf``, each starting 16-byte aligned (vector loads; launch.py's direct launches)."""
        views, start = [], 0
        for n in self._sizes():
            views.append(buf[start : start + n])
            start += -(-n // 4) * 4
        return (*views[:4], views[4].view(self.max_chunks, 3), views[5])

    def chunk_grid(self, num_slots: int) -> int:
        """Tiles the decode kernel launches for this batch size over a pool of ``num_slots``: sizes only."""
        t = self.num_tokens
        return min(-(-t // self.chunk) + min(t, num_slots), self.max_chunks)

    def set_segments(self, seg_lens: Sequence[int], seg_slots: Sequence[int], stream: Any = None) -> None:
        """Tokens ``[start_i, start_i + seg_lens[i])`` use slot ``seg_slots[i]`` (-1 = no adapter)."""
        lens, slots = _ints(seg_lens, "seg_lens"), _ints(seg_slots, "seg_slots")
        if len(lens) != len(slots):
            raise ValueError(f"seg_lens has {len(lens)} entries but seg_slots has {len(slots)}; give one slot "
                             "per segment")
        if not 0 < len(lens) <= self.max_segments:
            raise ValueError(f"{len(lens)} segments given; this BatchMeta takes 1..{self.max_segments} "
                             "(max_segments): raise it or split the batch")
        if lens.min() < 0:
            raise ValueError(f"seg_lens must be >= 0, got {lens.min()} in segment {int(lens.argmin())}")
        tokens = np.repeat(slots, lens)
        self._check(tokens, slots)
        i = self._take()
        _, s_host, slot_host, _, _, _ = self._host_views[i]
        s_host[: len(lens) + 1] = np.concatenate(([0], np.cumsum(lens)))
        slot_host[: len(slots)] = slots
        self._publish(i, tokens, len(lens), "sgmv", stream)

    def set_tokens(self, token_slots: Sequence[int], stream: Any = None) -> None:
        """Token ``i`` uses slot ``token_slots[i]`` (-1 = no adapter). Host work and one copy: no sync."""
        tokens = _ints(token_slots, "token_slots")
        self._check(tokens, tokens)
        self._publish(self._take(), tokens, 0, "bgmv", stream)

    def _check(self, tokens: np.ndarray, slots: np.ndarray) -> None:
        if not 0 < len(tokens) <= self.max_tokens:
            raise ValueError(f"batch has {len(tokens)} tokens; this BatchMeta takes 1..{self.max_tokens} "
                             "(max_tokens): raise it or split the batch")
        if len(slots) and slots.min() < -1:
            raise IndexError(f"slot index {slots.min()} is invalid: use a slot >= 0, or -1 for no adapter")
        if self.num_slots is not None and len(slots) and slots.max() >= self.num_slots:
            raise IndexError(f"slot index {slots.max()} is out of range: the pool has slots "
                             f"0..{self.num_slots - 1}")

    def _take(self) -> int:
        """The next pinned host buffer; waits only if the GPU is a whole ring of batches behind."""
        i = self._next
        self._next = (i + 1) % len(self._ring)
        event = self._copied[i]
        if event is not None and not event.query():
            event.synchronize()
        return i

    def _publish(self, i: int, tokens: np.ndarray, segments: int, mode: str, stream: Any) -> None:
        chunk = self.chunk_tokens or decode_chunk(len(tokens))
        t_host, _, _, perm_host, chunk_host, _ = self._host_views[i]
        t_host[: len(tokens)] = tokens
        perm, table = group_by_slot(tokens, chunk)
        perm_host[: len(perm)] = perm
        chunk_host[: len(table)] = table
        chunk_host[len(table) :, 1] = 0  # no tokens: tiles past the batch's own do nothing
        if _is_cuda(self.device):
            stream = stream or torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self._dev.copy_(self._ring[i], non_blocking=True)  # the one copy of the batch's metadata
                event = torch.cuda.Event()
                event.record(stream)
            self._copied[i] = event
        else:
            self._dev.copy_(self._ring[i])
        self.num_tokens, self.num_segments, self.num_chunks, self.chunk = len(tokens), segments, len(table), chunk
        self.mode = mode
        self.max_slot = int(tokens.max())
        self.host_token_slot = tokens.astype(np.int32)


def group_by_slot(tokens: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side of grouped decode: ``(perm, tiles)`` for the tokens' slots (-1 = no adapter).

    ``perm`` lists the adapted tokens slot by slot (stable: token order within a slot); ``tiles`` has
    one row ``(first position in perm, tokens, slot)`` per run of at most ``chunk`` tokens of one slot.
    """
    adapted = np.flatnonzero(tokens >= 0)
    perm = adapted[np.argsort(tokens[adapted], kind="stable")]
    if not len(perm):
        return perm, np.zeros((0, 3), dtype=np.int64)
    slots = tokens[perm]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
    ends = np.r_[starts[1:], len(perm)]
    per = -(-(ends - starts) // chunk)  # tiles of each slot's run
    run = np.repeat(np.arange(len(starts)), per)
    first = starts[run] + (np.arange(len(run)) - np.repeat(np.cumsum(per) - per, per)) * chunk
    return perm, np.stack([first, np.minimum(chunk, ends[run] - first), slots[starts][run]], axis=1)


def _ints(values: Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a flat sequence of integers, got {values!r}")
    return arr.astype(np.int64)
