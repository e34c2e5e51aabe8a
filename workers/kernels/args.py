"""Argument checks shared by the LoRA kernel wrappers and the reference: one place, clear errors.

Everything checked here is host state (shapes, dtypes, strides, the metadata's host mirrors), so a
launch stays free of host syncs. ``cached_plan`` runs the full ``check_launch`` once per distinct
argument signature (shapes, strides, dtypes, devices, batch size, SlotMeta version) and keeps the
kernel's launch plan (grid, block sizes, constant arguments) on the SlotMeta; a call with a known
signature checks only what changes between calls of one step (the layer, the batch's largest slot).
An engine makes 4 such calls per layer, so this is what keeps a decode step's Python cost down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

from workers.kernels.knobs import KNOBS
from workers.kernels.meta import MAX_FUSED, MAX_PLANS, BatchMeta, SlotMeta

P = TypeVar("P")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Launch(NamedTuple):
    """The validated facts of one fused LoRA launch; per-module tuples are padded to MAX_FUSED."""

    tokens: int  # T: rows of x and y
    d_in: int  # columns of x: every fused module's shard input features
    midx: tuple[int, ...]  # SlotMeta module index of each fused module
    outs: tuple[int, ...]  # output features of each fused module (0 = padding)
    cols: tuple[int, ...]  # first column of y of each fused module
    fused: int  # number of real modules
    meta_layer: int  # offset of this layer's entries in a SlotMeta row, in entries

    @property
    def max_out(self) -> int:
        return max(self.outs)

    def per_module(self) -> dict[str, int]:
        """The kernels' per-module arguments by name: out0..3, col0..3, midx0..3."""
        return {f"{name}{i}": v for name, values in (("out", self.outs), ("col", self.cols), ("midx", self.midx))
                for i, v in enumerate(values)}


def check_launch(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta,
                 layer: int, modules: Sequence[str]) -> Launch:
    """Validate a ``lora_apply`` call; returns the launch facts or raises naming the problem and the fix."""
    _check_tensors(x, y, pool, slot_meta, batch)
    if not isinstance(layer, int) or not 0 <= layer < slot_meta.num_layers:
        raise IndexError(f"layer {layer!r} is out of range: SlotMeta has layers 0..{slot_meta.num_layers - 1}")
    midx, outs, d_ins = _check_modules(modules, slot_meta)
    if len(set(d_ins)) != 1:
        raise ValueError(f"modules {list(modules)} have different input sizes {d_ins}; fuse only modules that "
                         "read the same input (q/k/v or gate/up)")
    if x.shape[1] != d_ins[0]:
        raise ValueError(f"x has {x.shape[1]} columns but {list(modules)} take {d_ins[0]} input features on this "
                         "TP rank (row-parallel modules take in/tp)")
    if y.shape[1] != sum(outs):
        raise ValueError(f"y has {y.shape[1]} columns but {list(modules)} produce {outs} = {sum(outs)} on this "
                         "TP rank; y holds the modules' outputs side by side, in the given order")
    cols = [sum(outs[:i]) for i in range(len(outs))]
    pad = MAX_FUSED - len(outs)
    return Launch(x.shape[0], d_ins[0], tuple(midx) + (0,) * pad, tuple(outs) + (0,) * pad,
                  tuple(cols) + (0,) * pad, len(outs), layer * len(slot_meta.modules))


def cached_plan(kernel: str, x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta,
                batch: BatchMeta, layer: int, modules: Sequence[str], build: Callable[[Launch], P]) -> P:
    """``build(check_launch(...))``, computed once per argument signature and kept in ``slot_meta.plans``.

    The key holds every fact ``check_launch`` reads except the layer and the batch's slots, which are
    checked on every call, and the kernel's tuning knobs (``tuning.tuned`` changes them); anything that is
    not a tensor (or unhashable) misses and gets the full check.
    """
    try:
        key = (kernel, modules if isinstance(modules, (tuple, str)) else tuple(modules),
               x.shape, x.stride(), x.dtype, x.get_device(), y.shape, y.stride(), y.dtype, y.get_device(),
               pool.shape, pool.stride(), pool.dtype, pool.get_device(), batch.device, batch.num_tokens,
               batch.chunk, batch.max_chunks, slot_meta.version, KNOBS.get(kernel))  # knobs: tuned() runs
        plan: P | None = slot_meta.plans.get(key)
    except (AttributeError, TypeError):
        key, plan = None, None
    if plan is None:
        plan = build(check_launch(x, y, pool, slot_meta, batch, layer, modules))
        if key is not None:
            if len(slot_meta.plans) >= MAX_PLANS:  # bounded; one clear is safe beside a loader thread's
                slot_meta.plans.clear()
            slot_meta.plans[key] = plan
        return plan
    if not isinstance(layer, int) or not 0 <= layer < slot_meta.num_layers:
        raise IndexError(f"layer {layer!r} is out of range: SlotMeta has layers 0..{slot_meta.num_layers - 1}")
    if batch.max_slot >= slot_meta.num_slots:
        raise IndexError(f"the batch uses slot {batch.max_slot}, out of range for {slot_meta.num_slots} slots")
    return plan


def _check_tensors(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta,
                   batch: BatchMeta) -> None:
    for name, t in (("x", x), ("y", y), ("pool", pool)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; LoRA kernels take {[str(d) for d in DTYPES]}")
        if t.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(f"{name} has column stride {t.stride(1)}; its rows must be contiguous: pass "
                             f"{name}.contiguous()")
        if t.device != slot_meta.device or t.device != batch.device:
            raise ValueError(f"{name} is on {t.device} but the metadata is on {slot_meta.device} (SlotMeta) and "
                             f"{batch.device} (BatchMeta); keep them on one device")
    if not x.dtype == y.dtype == pool.dtype:
        raise TypeError(f"x ({x.dtype}), y ({y.dtype}) and pool ({pool.dtype}) must share one dtype; cast the "
                        "activations to the pool's dtype")
    if slot_meta.dtype is not None and pool.dtype != slot_meta.dtype:
        raise TypeError(f"pool has dtype {pool.dtype} but the SlotMeta offsets were written for {slot_meta.dtype}")
    if pool.shape[0] != slot_meta.num_slots:
        raise ValueError(f"pool has {pool.shape[0]} slots but SlotMeta describes {slot_meta.num_slots}")
    if pool.shape[1] < slot_meta.max_numel:
        raise ValueError(f"pool slots hold {pool.shape[1]} elements but a written shard needs {slot_meta.max_numel}")
    if batch.mode is None:
        raise ValueError("BatchMeta is empty: call set_segments (prefill) or set_tokens (decode) first")
    if x.shape[0] != batch.num_tokens or y.shape[0] != batch.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows and y {y.shape[0]}, but the batch metadata is for "
                         f"{batch.num_tokens} tokens; one row per token")
    for name, t in (("x", x), ("y", y)):
        if t.shape[0] * t.stride(0) >= 2**31:
            raise ValueError(f"{name} spans {t.shape[0] * t.stride(0)} elements; the kernels index activations with "
                             "32-bit offsets: split the batch")
    if batch.max_slot >= slot_meta.num_slots:
        raise IndexError(f"the batch uses slot {batch.max_slot}, out of range for {slot_meta.num_slots} slots")


def _check_modules(modules: Sequence[str], slot_meta: SlotMeta) -> tuple[list[int], list[int], list[int]]:
    if isinstance(modules, str) or not 0 < len(modules) <= MAX_FUSED:
        raise ValueError(f"modules must be a list of 1..{MAX_FUSED} module names (e.g. ['q_proj', 'k_proj', "
                         f"'v_proj']), got {modules!r}")
    if len(set(modules)) != len(modules):
        raise ValueError(f"modules {list(modules)} repeat a name; list each module once")
    midx, outs, d_ins = [], [], []
    for m in modules:
        midx.append(slot_meta.module_index(m))
        if m not in slot_meta.dims:
            raise ValueError(f"the shard size of {m} is unknown: no adapter with {m} was written to this SlotMeta; "
                             "build it with dims=shard_dims(shape, tp)")
        d_in, d_out = slot_meta.dims[m]
        d_ins.append(d_in)
        outs.append(d_out)
    return midx, outs, d_ins
