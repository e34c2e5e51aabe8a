"""SGMV: segmented gather matrix multiply LoRA for prefill, tokens grouped by adapter slot.

One launch, fused shrink and expand: a program owns a tile of ``BLOCK_T`` tokens, one fused module and
a range of that module's output columns. For each distinct slot among its tokens (a tile of a prefill
batch spans one or two segments) it computes ``t = x_tile @ A^T`` on the tensor cores, keeps it in
registers, and adds ``scale * t @ B^T`` to the rows of ``y`` that use the slot. The grid depends on the
number of tokens only, so the launch is CUDA-graph safe; no atomics, so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from workers.kernels.args import Launch, cached_plan
from workers.kernels.bgmv import MIN, _expand_block
from workers.kernels.launch import KernelCall
from workers.kernels.meta import OFFSET_ALIGN, BatchMeta, SlotMeta
from workers.kernels.tuning import interpreting, sgmv_config

NO_SLOT = 2**30  # sentinel above every slot index: "no further slot in this tile"


BUILT_FOR_INTERPRETER = interpreting()  # @triton.jit decides at import: interpreter or GPU compiler

@triton.jit
def _expand_tile(scaled, b_ptr, rank, y_ptr, rows, sel, stride_y, col_f, n_lo, n_hi, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """y[rows where sel, col_f + n_lo : col_f + n_hi] += scaled @ B[n_lo:n_hi]^T, B = [out, rank] at b_ptr."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        _expand_block(scaled, b_ptr, rank, y_ptr, rows, sel, stride_y, col_f, offs_n, offs_n < n_hi, BLOCK_R,
                      PRECISION)


@triton.jit(do_not_specialize=["meta_layer"])
def _sgmv_kernel(
    x_ptr,  # [T, d_in] activations, row stride stride_x, column stride 1
    y_ptr,  # [T, sum(out)] output, updated in place; row stride stride_y, column stride 1
    pool_ptr,  # [num_slots, slot_numel] slot pool; A is [rank, d_in] at a_off, B is [out_m, rank] at b_off
    tok_slot_ptr,  # [>= T] int32 slot of each token, -1 = no adapter (segments expanded per token)
    meta_layer,  # index of this layer's first entry within a slot's table
    a_off_ptr,  # SlotMeta.a_off [num_slots, L, M] int64
    b_off_ptr,  # SlotMeta.b_off [num_slots, L, M] int64
    rank_ptr,  # SlotMeta.rank [num_slots, L, M] int32, 0 = module not adapted
    scale_ptr,  # SlotMeta.scale [num_slots, L, M] float32
    T,  # tokens
    d_in,  # input features (columns of x and of A)
    stride_x,  # row stride of x
    stride_y,  # row stride of y
    stride_pool,  # row stride of the pool
    stride_off,  # slot stride of SlotMeta.a_off / b_off (int64 entries)
    stride_rank,  # slot stride of SlotMeta.rank / scale (32-bit entries)
    n_per_split,  # output columns per program along grid axis 2, a multiple of BLOCK_N
    out0, out1, out2, out3,  # output features of fused modules 0..3
    col0, col1, col2, col3,  # first column of y of fused modules 0..3
    midx0, midx1, midx2, midx3,  # SlotMeta module index of fused modules 0..3
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_K: tl.constexpr,  # input features per shrink tile
    BLOCK_N: tl.constexpr,  # output features per expand tile
    BLOCK_R: tl.constexpr,  # >= every rank: the whole intermediate t stays in registers
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32 pools, else "tf32" (unused)
    NO_SLOT: tl.constexpr,  # sentinel above every slot index
    ALIGN: tl.constexpr,  # every SlotMeta offset is a multiple of this many elements (vector loads)
):
    f = tl.program_id(1)  # fused module
    n_lo = tl.program_id(2) * n_per_split  # first output column of this program
    out_f = tl.where(f == 0, out0, tl.where(f == 1, out1, tl.where(f == 2, out2, out3)))
    entry = meta_layer + tl.where(f == 0, midx0, tl.where(f == 1, midx1, tl.where(f == 2, midx2, midx3)))
    col_f = tl.where(f == 0, col0, tl.where(f == 1, col1, tl.where(f == 2, col2, col3)))
    n_hi = tl.minimum(n_lo + n_per_split, out_f)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(tok_slot_ptr + rows, mask=rows < T, other=-1)
    offs_r = tl.arange(0, BLOCK_R)
    cur = tl.reduce(tl.where(slots >= 0, slots, NO_SLOT), 0, MIN)
    cur = tl.where(n_lo < out_f, cur, NO_SLOT)  # programs past a narrow module's columns do nothing
    while cur < NO_SLOT:  # each distinct slot of the tile, in increasing order
        slot = cur.to(tl.int64)
        rank = tl.load(rank_ptr + slot * stride_rank + entry)
        if rank > 0:
            sel = slots == cur
            a_off = tl.multiple_of(tl.load(a_off_ptr + slot * stride_off + entry), ALIGN)
            a_ptr = pool_ptr + slot * stride_pool + a_off
            acc = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float32)
            for k0 in range(0, d_in, BLOCK_K):  # shrink: acc = x_tile @ A^T
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < d_in
                xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=sel[:, None] & kmask[None, :],
                             other=0.0)
                at = tl.load(a_ptr + offs_r[None, :] * d_in + offs_k[:, None],
                             mask=kmask[:, None] & (offs_r < rank)[None, :], other=0.0)
                acc = tl.dot(xt, at, acc, input_precision=PRECISION)
            scaled = (acc * tl.load(scale_ptr + slot * stride_rank + entry)).to(y_ptr.dtype.element_ty)
            b_off = tl.multiple_of(tl.load(b_off_ptr + slot * stride_off + entry), ALIGN)
            b_ptr = pool_ptr + slot * stride_pool + b_off
            if rank % 8 == 0:  # rows of B start 16-byte aligned: vector loads
                _expand_tile(scaled, b_ptr, (rank // 8) * 8, y_ptr, rows, sel, stride_y, col_f, n_lo, n_hi,
                             BLOCK_N, BLOCK_R, PRECISION)
            else:
                _expand_tile(scaled, b_ptr, rank, y_ptr, rows, sel, stride_y, col_f, n_lo, n_hi,
                             BLOCK_N, BLOCK_R, PRECISION)
        cur = tl.reduce(tl.where(slots > cur, slots, NO_SLOT), 0, MIN)


def sgmv(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta, layer: int,
         modules: Sequence[str]) -> None:
    """Semantics: for every segment i and every fused module m at column offset c_m::

        rows = slice(batch.seg_start[i], batch.seg_start[i + 1]); s = batch.seg_slot[i]   # s = -1: skipped
        r = slot_meta.rank[s, layer, m]                        # 0: module m not adapted by slot s
        A = pool[s, a_off:][: r * d_in].view(r, d_in)          # a_off = slot_meta.a_off[s, layer, m]
        B = pool[s, b_off:][: out_m * r].view(out_m, r)        # b_off = slot_meta.b_off[s, layer, m]
        y[rows, c_m : c_m + out_m] += slot_meta.scale[s, layer, m] * (x[rows] @ A.T) @ B.T

    x: [T, d_in], y: [T, sum(out_m)], pool: [num_slots, slot_numel], all one dtype (fp16, bf16 or fp32),
    rows contiguous. The kernel reads the per-token ``batch.token_slot`` that ``set_segments`` expands
    the segments into, so tokens in any order are correct (contiguous segments are what makes it fast).
    The intermediate ``x @ A.T`` is rounded to the pool dtype before the expand (as in Punica and vLLM).
    """
    plan = cached_plan("sgmv", x, y, pool, slot_meta, batch, layer, modules,
                       lambda launch: _plan(x, y, pool, slot_meta, launch))
    plan.kernel(x, y, pool, batch.token_slot, layer * plan.modules_per_layer)


class SgmvPlan(NamedTuple):
    """Everything of a call that one argument signature fixes (``args.cached_plan``)."""

    kernel: KernelCall  # takes (x, y, pool, token_slot, meta_layer)
    modules_per_layer: int  # SlotMeta entries per layer: meta_layer = layer * this


def _plan(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, launch: Launch) -> SgmvPlan:
    cfg = sgmv_config(launch.tokens, launch.fused, launch.d_in, launch.max_out, slot_meta.max_rank, x.device)
    fixed = dict(a_off_ptr=slot_meta.a_off, b_off_ptr=slot_meta.b_off, rank_ptr=slot_meta.rank,
                 scale_ptr=slot_meta.scale, T=launch.tokens, d_in=launch.d_in, stride_x=x.stride(0),
                 stride_y=y.stride(0), stride_pool=pool.stride(0), stride_off=slot_meta.a_off.stride(0),
                 stride_rank=slot_meta.rank.stride(0), n_per_split=cfg.n_per_split, **launch.per_module(),
                 BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", NO_SLOT=NO_SLOT, ALIGN=OFFSET_ALIGN)
    grid = (triton.cdiv(launch.tokens, cfg.block_t), launch.fused, cfg.n_splits)
    return SgmvPlan(KernelCall(_sgmv_kernel, grid, 5, fixed, dict(num_warps=cfg.num_warps)), len(slot_meta.modules))
