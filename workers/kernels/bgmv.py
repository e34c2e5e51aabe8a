"""BGMV: batched gather matrix-vector LoRA for decode, one adapter slot per token.

Two launches per call: ``shrink`` computes ``x[t] @ A^T`` for every (token, fused module, K split)
into a small float32 workspace, ``expand`` sums the K splits and adds ``scale * t @ B^T`` into its
block of ``y``'s columns. A program takes ``BLOCK_T`` tokens, each gathering its own A or B (one token
on the GPU: decode is bandwidth-bound; more under the interpreter, where every program costs Python).
No atomics: results are deterministic and identical under CUDA-graph replay. Both kernels read A and B
straight from the slot pool at the offsets in ``SlotMeta``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from workers.kernels.args import Launch, check_launch
from workers.kernels.meta import OFFSET_ALIGN, BatchMeta, SlotMeta
from workers.kernels.tuning import bgmv_config, interpreting

BUILT_FOR_INTERPRETER = interpreting()  # @triton.jit decides at import: interpreter or GPU compiler

# Reductions are spelled tl.reduce(x, axis, <the standard library's combine function>): that is what
# tl.sum / tl.max compile to, and the interpreter runs it with numpy even when Triton was imported before
# TRITON_INTERPRET was set (tl.sum / tl.max / tl.zeros themselves are then GPU-only @jit functions).
SUM, MAX, MIN = tl.standard._sum_combine, tl.standard._elementwise_max, tl.standard._elementwise_min


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,  # [T, d_in] activations, row stride stride_x, column stride 1
    pool_ptr,  # [num_slots, slot_numel] slot pool; A of (slot, layer, m) is [rank, d_in] row-major at a_off
    tok_slot_ptr,  # [>= T] int32 slot of each token, -1 = no adapter
    a_off_ptr,  # SlotMeta.a_off [num_slots, L, M] int64 (contiguous within a slot's row)
    rank_ptr,  # SlotMeta.rank [num_slots, L, M] int32, 0 = module not adapted
    part_ptr,  # [T, F, SPLIT_K, R_PAD] float32 out: x[t] @ A^T over each K split's columns
    T,  # tokens
    stride_x,  # row stride of x
    stride_pool,  # row stride of the pool (elements per slot)
    stride_off,  # slot stride of SlotMeta.a_off (int64 entries)
    stride_rank,  # slot stride of SlotMeta.rank (int32 entries)
    meta_layer,  # index of this layer's first entry within a slot's table
    d_in,  # input features (columns of x and of A)
    k_per_split,  # columns of A per K split, a multiple of BLOCK_K
    midx0, midx1, midx2, midx3,  # SlotMeta module index of fused modules 0..3
    F: tl.constexpr,  # number of fused modules
    SPLIT_K: tl.constexpr,  # K splits (grid axis 2)
    R_PAD: tl.constexpr,  # workspace rank padding (max rank rounded up to BLOCK_R)
    BLOCK_T: tl.constexpr,  # tokens per program, each with its own A (1 on the GPU)
    BLOCK_R: tl.constexpr,  # ranks per inner tile
    BLOCK_K: tl.constexpr,  # input features per inner tile
    ALIGN: tl.constexpr,  # every SlotMeta offset is a multiple of this many elements (vector loads)
):
    f = tl.program_id(1)  # fused module
    ks = tl.program_id(2)  # K split
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(tok_slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
    entry = meta_layer + tl.where(f == 0, midx0, tl.where(f == 1, midx1, tl.where(f == 2, midx2, midx3)))
    rank = tl.load(rank_ptr + slot * stride_rank + entry, mask=slot >= 0, other=0)  # [BLOCK_T]
    a_off = tl.load(a_off_ptr + slot * stride_off + entry, mask=rank > 0, other=0)
    a_ptr = pool_ptr + slot * stride_pool + tl.multiple_of(a_off, ALIGN)  # [BLOCK_T]
    x_ptr += tok.to(tl.int64)[:, None] * stride_x  # [BLOCK_T, 1]
    out = part_ptr + ((tok.to(tl.int64) * F + f) * SPLIT_K + ks) * R_PAD  # [BLOCK_T]
    k_lo = ks * k_per_split
    for r0 in range(0, tl.reduce(rank, 0, MAX), BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows[None, :] < rank[:, None]  # [BLOCK_T, BLOCK_R]
        acc = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float32)
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < d_in
            xv = tl.load(x_ptr + cols[None, :], mask=(rank > 0)[:, None] & kmask[None, :], other=0.0)
            a = tl.load(a_ptr[:, None, None] + rows[None, :, None] * d_in + cols[None, None, :],
                        mask=rmask[:, :, None] & kmask[None, None, :], other=0.0)  # [BLOCK_T, BLOCK_R, BLOCK_K]
            acc += tl.reduce(a.to(tl.float32) * xv.to(tl.float32)[:, None, :], 2, SUM)
        tl.store(out[:, None] + rows[None, :], acc, mask=rmask)


@triton.jit
def _expand_rows(b_ptr, part, rank, offs_n, nmask, R_PAD: tl.constexpr, SPLIT_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """[BLOCK_T, BLOCK_N] float32: (sum of the K splits of x @ A^T) @ B[offs_n]^T for each token."""
    acc = tl.full([BLOCK_T, BLOCK_N], 0.0, tl.float32)
    for r0 in range(0, tl.reduce(rank, 0, MAX), BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows[None, :] < rank[:, None]  # [BLOCK_T, BLOCK_R]
        v = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float32)
        for s in range(SPLIT_K):
            v += tl.load(part[:, None] + s * R_PAD + rows[None, :], mask=rmask, other=0.0)
        b = tl.load(b_ptr[:, None, None] + offs_n[None, :, None] * rank[:, None, None] + rows[None, None, :],
                    mask=nmask[None, :, None] & rmask[:, None, :], other=0.0)  # [BLOCK_T, BLOCK_N, BLOCK_R]
        acc += tl.reduce(b.to(tl.float32) * v[:, None, :], 2, SUM)
    return acc


@triton.jit
def _bgmv_expand_kernel(
    y_ptr,  # [T, sum(out)] output, updated in place; row stride stride_y, column stride 1
    pool_ptr,  # [num_slots, slot_numel] slot pool; B of (slot, layer, m) is [out_m, rank] row-major at b_off
    tok_slot_ptr,  # [>= T] int32 slot of each token, -1 = no adapter
    b_off_ptr,  # SlotMeta.b_off [num_slots, L, M] int64
    rank_ptr,  # SlotMeta.rank [num_slots, L, M] int32
    scale_ptr,  # SlotMeta.scale [num_slots, L, M] float32
    part_ptr,  # [T, F, SPLIT_K, R_PAD] float32 from the shrink
    T,  # tokens
    stride_y,  # row stride of y
    stride_pool,  # row stride of the pool
    stride_off,  # slot stride of SlotMeta.b_off (int64 entries)
    stride_rank,  # slot stride of SlotMeta.rank and .scale (32-bit entries)
    meta_layer,  # index of this layer's first entry within a slot's table
    out0, out1, out2, out3,  # output features of fused modules 0..3
    col0, col1, col2, col3,  # first column of y of fused modules 0..3
    midx0, midx1, midx2, midx3,  # SlotMeta module index of fused modules 0..3
    F: tl.constexpr,  # number of fused modules
    SPLIT_K: tl.constexpr,  # K splits written by the shrink
    R_PAD: tl.constexpr,  # workspace rank padding
    BLOCK_T: tl.constexpr,  # tokens per program, each with its own B (1 on the GPU)
    BLOCK_R: tl.constexpr,  # ranks per inner tile
    BLOCK_N: tl.constexpr,  # output features per program (grid axis 2)
    ALIGN: tl.constexpr,  # every SlotMeta offset is a multiple of this many elements (vector loads)
):
    f = tl.program_id(1)  # fused module
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's output features
    out_f = tl.where(f == 0, out0, tl.where(f == 1, out1, tl.where(f == 2, out2, out3)))
    col_f = tl.where(f == 0, col0, tl.where(f == 1, col1, tl.where(f == 2, col2, col3)))
    nmask = offs_n < out_f
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(tok_slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
    entry = meta_layer + tl.where(f == 0, midx0, tl.where(f == 1, midx1, tl.where(f == 2, midx2, midx3)))
    rank = tl.load(rank_ptr + slot * stride_rank + entry, mask=slot >= 0, other=0)  # [BLOCK_T]
    rank = tl.where(tl.program_id(2) * BLOCK_N < out_f, rank, 0)  # programs past a narrow module's columns
    on = rank > 0
    b_off = tl.load(b_off_ptr + slot * stride_off + entry, mask=on, other=0)
    b_ptr = pool_ptr + slot * stride_pool + tl.multiple_of(b_off, ALIGN)  # [BLOCK_T]
    part = part_ptr + (tok.to(tl.int64) * F + f) * SPLIT_K * R_PAD  # [BLOCK_T]
    if tl.reduce(rank % 8, 0, MAX) == 0:  # all ranks multiples of 8: B's rows 16-byte aligned, vector loads
        acc = _expand_rows(b_ptr, part, (rank // 8) * 8, offs_n, nmask, R_PAD, SPLIT_K, BLOCK_T, BLOCK_N, BLOCK_R)
    else:
        acc = _expand_rows(b_ptr, part, rank, offs_n, nmask, R_PAD, SPLIT_K, BLOCK_T, BLOCK_N, BLOCK_R)
    scale = tl.load(scale_ptr + slot * stride_rank + entry, mask=on, other=0.0)
    ymask = on[:, None] & nmask[None, :]
    y_ptrs = y_ptr + tok.to(tl.int64)[:, None] * stride_y + col_f + offs_n[None, :]
    old = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (old + scale[:, None] * acc).to(y_ptr.dtype.element_ty), mask=ymask)


def bgmv(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta, layer: int,
         modules: Sequence[str]) -> None:
    """Semantics: for every token t and every fused module m at column offset c_m::

        s = batch.token_slot[t]                    # -1: y[t] is left as it is
        r = slot_meta.rank[s, layer, m]            # 0: module m not adapted by slot s
        A = pool[s, a_off:][: r * d_in].view(r, d_in)          # a_off = slot_meta.a_off[s, layer, m]
        B = pool[s, b_off:][: out_m * r].view(out_m, r)        # b_off = slot_meta.b_off[s, layer, m]
        y[t, c_m : c_m + out_m] += slot_meta.scale[s, layer, m] * (x[t] @ A.T) @ B.T

    x: [T, d_in], y: [T, sum(out_m)], pool: [num_slots, slot_numel], all one dtype (fp16, bf16 or fp32),
    rows contiguous; accumulation in float32. Column-parallel shards: x is the full input and y this
    rank's slice of the outputs; row-parallel: x is this rank's input slice and y a full-width partial sum.
    """
    launch = check_launch(x, y, pool, slot_meta, batch, layer, modules)
    _launch(x, y, pool, slot_meta, batch, launch)


def _launch(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta,
            launch: Launch) -> None:
    cfg = bgmv_config(launch.tokens, launch.fused, launch.d_in, slot_meta.max_rank, x.device)
    part = torch.empty((launch.tokens, launch.fused, cfg.split_k, cfg.r_pad), dtype=torch.float32,
                       device=x.device)
    strides = (slot_meta.a_off.stride(0), slot_meta.rank.stride(0))
    tiles = triton.cdiv(launch.tokens, cfg.block_t)
    _bgmv_shrink_kernel[(tiles, launch.fused, cfg.split_k)](
        x, pool, batch.token_slot, slot_meta.a_off, slot_meta.rank, part,
        launch.tokens, x.stride(0), pool.stride(0), *strides, launch.meta_layer, launch.d_in, cfg.k_per_split,
        *launch.midx, F=launch.fused, SPLIT_K=cfg.split_k, R_PAD=cfg.r_pad, BLOCK_T=cfg.block_t,
        BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, ALIGN=OFFSET_ALIGN, num_warps=cfg.num_warps)
    _bgmv_expand_kernel[(tiles, launch.fused, triton.cdiv(launch.max_out, cfg.block_n))](
        y, pool, batch.token_slot, slot_meta.b_off, slot_meta.rank, slot_meta.scale, part,
        launch.tokens, y.stride(0), pool.stride(0), *strides, launch.meta_layer, *launch.outs, *launch.cols,
        *launch.midx, F=launch.fused, SPLIT_K=cfg.split_k, R_PAD=cfg.r_pad, BLOCK_T=cfg.block_t,
        BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, ALIGN=OFFSET_ALIGN, num_warps=cfg.num_warps)
