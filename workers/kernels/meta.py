"""Kernel metadata on the device: per-slot LoRA tables and per-batch slot indices (lifecycle steps 6, 9).

Both are preallocated at their maximum size and filled in place from pinned host memory with one
``non_blocking`` copy, so a kernel launch needs no host sync and a captured CUDA graph stays valid.

``SlotMeta``: one row per slot. For every (layer, module) the element offsets of lora_A and lora_B
inside the slot, the rank (0 = module not adapted) and the scaling. A row is written on the load's
copy stream right after the slot's data, so it is valid exactly when the slot is.

``BatchMeta``: which slot each token of a batch uses, given as segments (SGMV, prefill: tokens grouped
by adapter) or per token (BGMV, decode). The kernels read ``token_slot``; ``seg_start``/``seg_slot``
are kept for engines that want the segment view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lora_cache.peft import AdapterSpec, LoraModule
from lora_cache.shapes import MODULES, ModelShape
from lora_cache.shards import ShardEntry, ShardLayout, base_slices

# bytes per (layer, module) in a SlotMeta row: a_off int64, b_off int64, rank int32, scale float32
_ENTRY_BYTES = 8 + 8 + 4 + 4
MODES = ("sgmv", "bgmv")
OFFSET_ALIGN = 16  # kernels assume every matrix offset is a multiple of this (shards align to 128 bytes)


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


class SlotMeta:
    """Per-slot device tables of offsets, ranks and scalings; see the module docstring.

    Device views, each ``[num_slots, num_layers, len(modules)]``: ``a_off``/``b_off`` (int64, elements
    from the slot's start), ``rank`` (int32, 0 = not adapted), ``scale`` (float32). The same views of
    the pinned host staging rows (``host_*``) mirror what was last written, for the CPU reference path.
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
        self.numel = [0] * num_slots  # elements of the slot each row's offsets reach
        self._index = {m: i for i, m in enumerate(self.modules)}
        self._row_bytes = _ENTRY_BYTES * num_layers * len(self.modules)
        pin = _is_cuda(self.device)
        self._host = torch.zeros((num_slots, self._row_bytes), dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros((num_slots, self._row_bytes), dtype=torch.uint8, device=self.device)
        self._copied: list[Any] = [None] * num_slots  # event after each row's last copy (CUDA)
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

    def write(self, slot: int, layout: ShardLayout, spec: AdapterSpec | None = None, stream: Any = None) -> None:
        """Fill ``slot``'s row for ``layout`` (one non-blocking copy on ``stream``, default: current)."""
        self._check_slot(slot)
        entries = {(e.layer, e.module, e.ab): e for e in layout.entries}
        modules = self._check_layout(layout, spec, entries)
        self._wait_row(slot)
        self._host[slot].zero_()
        layers, cols = [m.layer for m in modules], [self._index[m.module] for m in modules]
        a_off, b_off, rank, scale = (t.numpy() for t in (self.host_a_off, self.host_b_off, self.host_rank,
                                                         self.host_scale))
        a_off[slot, layers, cols] = [entries[(m.layer, m.module, "A")].offset for m in modules]
        b_off[slot, layers, cols] = [entries[(m.layer, m.module, "B")].offset for m in modules]
        rank[slot, layers, cols] = [m.rank for m in modules]
        scale[slot, layers, cols] = [m.scaling for m in modules]
        self.numel[slot] = layout.numel
        self._upload(slot, stream)

    def clear(self, slot: int, stream: Any = None) -> None:
        """Mark every module of ``slot`` as not adapted (rank 0)."""
        self._check_slot(slot)
        self._wait_row(slot)
        self._host[slot].zero_()
        self.numel[slot] = 0
        self._upload(slot, stream)

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

    ``token_slot[:num_tokens]`` (int32, -1 = no adapter) is what the kernels read; ``seg_start``
    (``num_segments + 1`` entries) and ``seg_slot`` describe the segments when ``set_segments`` was used.
    """

    def __init__(self, max_tokens: int, max_segments: int, device: torch.device, *,
                 num_slots: int | None = None, ring: int = 4) -> None:
        if max_tokens < 1 or max_segments < 1:
            raise ValueError(f"BatchMeta needs max_tokens >= 1 and max_segments >= 1, got {max_tokens}, "
                             f"{max_segments}")
        self.max_tokens, self.max_segments, self.num_slots = max_tokens, max_segments, num_slots
        self.device = concrete(device)
        n = max_tokens + 2 * max_segments + 1
        self._dev = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        self.token_slot, self.seg_start, self.seg_slot = self._split(self._dev)
        pin = _is_cuda(self.device)
        self._ring = [torch.full((n,), -1, dtype=torch.int32, pin_memory=pin) for _ in range(ring)]
        self._copied: list[Any] = [None] * ring  # event after each host buffer's last copy (CUDA)
        self._next = 0
        self.num_tokens = self.num_segments = 0
        self.mode: str | None = None  # "sgmv" or "bgmv": which setter ran last
        self.max_slot = -1  # largest slot index of the batch (checked against the pool at launch)
        self.host_token_slot = np.full(0, -1, dtype=np.int32)  # this batch's token_slot, on the host

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, s = self.max_tokens, self.max_segments
        return buf[:t], buf[t : t + s + 1], buf[t + s + 1 :]

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
        i, host = self._take()
        t_host, s_host, slot_host = self._split(host)
        t_host.numpy()[: len(tokens)] = tokens
        s_host.numpy()[: len(lens) + 1] = np.concatenate(([0], np.cumsum(lens)))
        slot_host.numpy()[: len(slots)] = slots
        self._publish(i, tokens, len(lens), "sgmv", stream)

    def set_tokens(self, token_slots: Sequence[int], stream: Any = None) -> None:
        """Token ``i`` uses slot ``token_slots[i]`` (-1 = no adapter)."""
        tokens = _ints(token_slots, "token_slots")
        self._check(tokens, tokens)
        i, host = self._take()
        self._split(host)[0].numpy()[: len(tokens)] = tokens
        self._publish(i, tokens, 0, "bgmv", stream)

    def _check(self, tokens: np.ndarray, slots: np.ndarray) -> None:
        if not 0 < len(tokens) <= self.max_tokens:
            raise ValueError(f"batch has {len(tokens)} tokens; this BatchMeta takes 1..{self.max_tokens} "
                             "(max_tokens): raise it or split the batch")
        if len(slots) and slots.min() < -1:
            raise IndexError(f"slot index {slots.min()} is invalid: use a slot >= 0, or -1 for no adapter")
        if self.num_slots is not None and len(slots) and slots.max() >= self.num_slots:
            raise IndexError(f"slot index {slots.max()} is out of range: the pool has slots "
                             f"0..{self.num_slots - 1}")

    def _take(self) -> tuple[int, torch.Tensor]:
        """The next pinned host buffer; waits only if the GPU is a whole ring of batches behind."""
        i = self._next
        self._next = (i + 1) % len(self._ring)
        event = self._copied[i]
        if event is not None and not event.query():
            event.synchronize()
        return i, self._ring[i]

    def _publish(self, i: int, tokens: np.ndarray, segments: int, mode: str, stream: Any) -> None:
        if _is_cuda(self.device):
            stream = stream or torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self._dev.copy_(self._ring[i], non_blocking=True)  # the one copy of the batch's metadata
                event = torch.cuda.Event()
                event.record(stream)
            self._copied[i] = event
        else:
            self._dev.copy_(self._ring[i])
        self.num_tokens, self.num_segments, self.mode = len(tokens), segments, mode
        self.max_slot = int(tokens.max())
        self.host_token_slot = tokens.astype(np.int32)


def _ints(values: Sequence[int], what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a flat sequence of integers, got {values!r}")
    return arr.astype(np.int64)
