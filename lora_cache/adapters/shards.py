"""Tensor-parallel shard specs and the packed layout of one shard (lifecycle steps 5-6).

For TP size ``t`` and rank ``k``, which slice of each LoRA matrix a rank holds is a table:
column-parallel modules keep lora_A whole and take rows of lora_B; row-parallel modules take columns
of lora_A and keep lora_B whole. A shard is packed into one contiguous buffer, every (layer, module,
A/B) at a known element offset, identical in the pinned staging buffer and in the GPU slot, so a load
is one host-to-device copy. Offsets follow each adapter's own ranks: mixed ranks are not padded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lora_cache.adapters.peft import AdapterSpec, LoraModule, peft_key
from lora_cache.adapters.shapes import MODULE_ORDER, MODULES, ModelShape, Parallel
from lora_cache.errors import ConfigError, ShardError

ALIGN_BYTES = 128  # every matrix starts on a 128-byte boundary (vector loads, TMA)

# (parallel kind, matrix) -> the axis split across ranks, or None if the rank holds it whole
SPLIT_AXIS: dict[tuple[Parallel, str], int | None] = {
    (Parallel.COLUMN, "A"): None,
    (Parallel.COLUMN, "B"): 0,  # rows of lora_B [out, r]
    (Parallel.ROW, "A"): 1,  # columns of lora_A [r, in]
    (Parallel.ROW, "B"): None,
}


class ShardEntry(NamedTuple):
    """One matrix of the shard: where it comes from in the file and where it lands in the slot."""

    layer: int
    module: str
    ab: str  # "A" (shrink, [r, in/shard]) or "B" (expand, [out/shard, r])
    key: str  # PEFT key in adapter_model.safetensors
    rows: slice  # slice of the file tensor's rows
    cols: slice  # slice of the file tensor's columns
    shape: tuple[int, int]  # shape of the slice, row-major in the slot
    offset: int  # element offset in the packed shard

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def split(size: int, tp: int, rank: int, what: str) -> slice:
    """The ``rank``-th of ``tp`` equal parts of ``size``; a clear error if it does not divide."""
    if size % tp:
        raise ShardError(f"{what}: size {size} does not divide by TP size {tp}; "
                         f"use a TP size that divides {size}")
    part = size // tp
    return slice(rank * part, (rank + 1) * part)


def base_slices(module: str, d_in: int, d_out: int, tp: int, rank: int) -> tuple[slice, slice]:
    """(in, out) features of ``module``'s base linear layer that TP rank ``rank`` computes (Megatron):
    column-parallel modules split their outputs, row-parallel ones their inputs."""
    if MODULES[module][1] is Parallel.COLUMN:
        return slice(0, d_in), split(d_out, tp, rank, f"{module} out features (column-parallel)")
    return split(d_in, tp, rank, f"{module} in features (row-parallel)"), slice(0, d_out)


def _align(elems: int, elem_bytes: int) -> int:
    step = max(1, ALIGN_BYTES // elem_bytes)
    return -(-elems // step) * step


@dataclass(frozen=True)
class ShardLayout:
    """Packed layout of one TP rank's shard of one adapter, in elements of ``dtype``."""

    adapter: str
    version: str
    tp: int
    rank: int
    dtype: torch.dtype
    entries: tuple[ShardEntry, ...]
    modules: tuple[LoraModule, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def entry(self, layer: int, module: str, ab: str) -> ShardEntry:
        for e in self.entries:
            if (e.layer, e.module, e.ab) == (layer, module, ab):
                return e
        raise KeyError(f"{self.adapter}: no {module}.lora_{ab} in layer {layer}")


def _entries(m: LoraModule, shape: ModelShape, tp: int, rank: int) -> list[tuple[str, slice, slice, tuple[int, int]]]:
    d_in, d_out = shape.dims(m.module)
    parallel = MODULES[m.module][1]
    out: list[tuple[str, slice, slice, tuple[int, int]]] = []
    for ab, dims in (("A", (m.rank, d_in)), ("B", (d_out, m.rank))):
        axis = SPLIT_AXIS[(parallel, ab)]
        spans = [slice(0, dims[0]), slice(0, dims[1])]
        if axis is not None:
            what = f"layer {m.layer} {m.module}.lora_{ab} ({parallel.value}-parallel)"
            spans[axis] = split(dims[axis], tp, rank, what)
        out.append((ab, spans[0], spans[1], (spans[0].stop - spans[0].start, spans[1].stop - spans[1].start)))
    return out


def shard_layout(spec: AdapterSpec, shape: ModelShape, tp: int, rank: int, dtype: torch.dtype) -> ShardLayout:
    """The packed layout of TP rank ``rank`` of ``tp`` for ``spec``'s adapter."""
    if tp < 1 or not 0 <= rank < tp:
        raise ConfigError(f"TP rank {rank} of size {tp} is invalid: need tp >= 1 and 0 <= rank < tp")
    entries, numel = _packed(tuple((m.layer, m.module, m.rank) for m in spec.modules), shape, tp, rank, dtype)
    return ShardLayout(spec.name, spec.version, tp, rank, dtype, entries, spec.modules, numel)


@functools.lru_cache(maxsize=1024)
def _packed(modules: tuple[tuple[int, str, int], ...], shape: ModelShape, tp: int, rank: int,
            dtype: torch.dtype) -> tuple[tuple[ShardEntry, ...], int]:
    """The entries and size of a shard of adapters with these (layer, module, rank)s. Adapters that adapt
    the same modules at the same ranks share one (a fleet's thousands of adapters have a few such
    patterns): building one is ~2 ms of Python for an 8B model, which a demand load would otherwise pay
    before its read starts."""
    entries, offset = [], 0
    for layer, module, r in modules:
        for ab, rows, cols, sub in _entries(LoraModule(layer, module, r, 1.0), shape, tp, rank):
            entries.append(ShardEntry(layer, module, ab, peft_key(layer, module, ab), rows, cols, sub, offset))
            offset += _align(sub[0] * sub[1], dtype.itemsize)
    return tuple(entries), offset


def max_shard_numel(shape: ModelShape, tp: int, max_rank: int, dtype: torch.dtype,
                    modules: tuple[str, ...] = MODULE_ORDER) -> int:
    """Elements of the largest shard an adapter of rank <= ``max_rank`` can have: the slot size."""
    total = 0
    for layer in range(shape.num_layers):
        for module in modules:
            m = LoraModule(layer, module, max_rank, 1.0)
            total += sum(_align(sub[0] * sub[1], dtype.itemsize) for *_, sub in _entries(m, shape, tp, 0))
    return total
