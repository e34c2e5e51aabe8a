"""BGMV: LoRA for decode, one adapter slot per token, the batch's tokens grouped by slot into tiles.

``BatchMeta`` lists the adapted tokens slot by slot on the host (``token_perm``) and cuts each slot's
run into tiles of at most ``chunk`` tokens (``chunks``). Two launches per call: ``shrink`` computes
``x[tile] @ A^T`` for every (tile, fused module, K split) into a small float32 workspace (one row per
position in ``token_perm``), and the last split of each (tile, module) to finish sums the splits (a
counter per tile, deterministic order); ``expand`` adds ``scale * t @ B^T`` to the tile's rows of
``y``, gathered through ``token_perm`` so every row stays in place. A program reads its tile's
A or B once for all the tile's tokens, on the tensor cores: an adapter that many tokens share is read
once per tile, not once per token (per-token BGMV re-read it for each). With every token on its own
adapter a tile holds one token and a program reads just what a per-token BGMV program reads.

The grid is a bound from the sizes only (``BatchMeta.chunk_grid``): tiles past the batch's own have no
tokens and return at once, so a captured CUDA graph stays valid whatever the adapter mix. The only
atomic counts finished splits; sums run in a fixed order, so results are deterministic and identical
under replay. Both kernels read A and B straight from the slot
pool at the offsets in ``SlotMeta``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from workers.kernels.args import Launch, cached_plan
from workers.kernels.launch import KernelCall
from workers.kernels.meta import OFFSET_ALIGN, BatchMeta, SlotMeta
from workers.kernels.tuning import bgmv_config, interpreting

BUILT_FOR_INTERPRETER = interpreting()  # @triton.jit decides at import: interpreter or GPU compiler

# Reductions are spelled tl.reduce(x, axis, <the standard library's combine function>): that is what
# tl.sum / tl.max compile to, and the interpreter runs it with numpy even when Triton was imported before
# TRITON_INTERPRET was set (tl.sum / tl.max / tl.zeros themselves are then GPU-only @jit functions).
SUM, MAX, MIN = tl.standard._sum_combine, tl.standard._elementwise_max, tl.standard._elementwise_min


@triton.jit(do_not_specialize=["meta_layer"])
def _bgmv_shrink_kernel(
    x_ptr,  # [T, d_in] activations, row stride stride_x, column stride 1
    pool_ptr,  # [num_slots, slot_numel] slot pool; A of (slot, layer, m) is [rank, d_in] row-major at a_off
    part_ptr,  # [T, F, SPLIT_K, BLOCK_R] float32 out, row = position in token_perm: x[t] @ A^T per K split
    perm_ptr,  # BatchMeta.token_perm: the adapted tokens, slot by slot
    chunk_ptr,  # BatchMeta.chunks [max_chunks, 3] int32: (first position in token_perm, tokens, slot) per tile
    lock_ptr,  # BatchMeta.tile_locks [max_chunks * MAX_FUSED] int32: K splits done per (tile, module), 0 at rest
    meta_layer,  # index of this layer's first entry within a slot's table
    a_off_ptr,  # SlotMeta.a_off [num_slots, L, M] int64 (contiguous within a slot's row)
    rank_ptr,  # SlotMeta.rank [num_slots, L, M] int32, 0 = module not adapted
    stride_x,  # row stride of x
    stride_pool,  # row stride of the pool (elements per slot)
    stride_off,  # slot stride of SlotMeta.a_off (int64 entries)
    stride_rank,  # slot stride of SlotMeta.rank (int32 entries)
    d_in,  # input features (columns of x and of A)
    k_per_split,  # columns of A per K split, a multiple of BLOCK_K
    midx0, midx1, midx2, midx3,  # SlotMeta module index of fused modules 0..3
    F: tl.constexpr,  # number of fused modules
    SPLIT_K: tl.constexpr,  # K splits (grid axis 2)
    BLOCK_T: tl.constexpr,  # tokens per tile (BatchMeta.chunk), >= 16 for tl.dot
    BLOCK_R: tl.constexpr,  # >= every rank: the whole rank in one tile, a power of two >= 16
    BLOCK_K: tl.constexpr,  # input features per inner tile
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32 pools, else "tf32" (unused)
    ALIGN: tl.constexpr,  # every SlotMeta offset is a multiple of this many elements (vector loads)
    REDUCE: tl.constexpr,  # the last split of a (tile, module) sums the splits into split 0 for the expand
):
    c = tl.program_id(0)  # tile
    f = tl.program_id(1)  # fused module
    ks = tl.program_id(2)  # K split
    n = tl.load(chunk_ptr + c * 3 + 1)  # tokens of this tile; 0 past the batch's tiles
    if n > 0:
        slot = tl.load(chunk_ptr + c * 3 + 2).to(tl.int64)
        entry = meta_layer + tl.where(f == 0, midx0, tl.where(f == 1, midx1, tl.where(f == 2, midx2, midx3)))
        rank = tl.load(rank_ptr + slot * stride_rank + entry)
        if rank > 0:
            pos = tl.load(chunk_ptr + c * 3) + tl.arange(0, BLOCK_T)  # positions in token_perm
            tmask = tl.arange(0, BLOCK_T) < n
            rows = tl.load(perm_ptr + pos, mask=tmask, other=0).to(tl.int64)  # the tokens, rows of x
            a_off = tl.multiple_of(tl.load(a_off_ptr + slot * stride_off + entry), ALIGN)
            a_ptr = pool_ptr + slot * stride_pool + a_off
            offs_r = tl.arange(0, BLOCK_R)
            rmask = offs_r < rank
            acc = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float32)
            k_lo = ks * k_per_split
            for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < d_in
                xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=tmask[:, None] & kmask[None, :],
                             other=0.0)  # [BLOCK_T, BLOCK_K]
                at = tl.load(a_ptr + offs_r[None, :] * d_in + offs_k[:, None], mask=kmask[:, None] & rmask[None, :],
                             other=0.0)  # [BLOCK_K, BLOCK_R]: A^T
                acc = tl.dot(xt, at, acc, input_precision=PRECISION)
            base = part_ptr + (pos.to(tl.int64) * F + f) * SPLIT_K * BLOCK_R  # [BLOCK_T]: split 0 of each token
            pmask = tmask[:, None] & rmask[None, :]
            tl.store(base[:, None] + ks * BLOCK_R + offs_r[None, :], acc, mask=pmask)
            if REDUCE:
                _reduce_splits(base, offs_r, pmask, lock_ptr + c * F + f, SPLIT_K, BLOCK_T, BLOCK_R)


@triton.jit
def _reduce_splits(base, offs_r, pmask, lock, SPLIT_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """The last of a tile's K splits to finish sums all of them, in split order, into split 0.

    So the expand reads one partial per token instead of SPLIT_K per output block (it re-reads them for
    each of its many column blocks), and the sum is deterministic whichever split finishes last. The
    counter is reset to 0 by the last split: it rests at 0 between launches (CUDA-graph replays)."""
    tl.debug_barrier()  # every thread's partial is stored before this program counts itself done
    done = tl.atomic_add(lock, 1, sem="acq_rel")  # release our partial, acquire the others'
    if done == SPLIT_K - 1:
        total = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float32)
        for s in range(SPLIT_K):  # .cg: from L2, where the other programs' stores are
            total += tl.load(base[:, None] + s * BLOCK_R + offs_r[None, :], mask=pmask, other=0.0, cache_modifier=".cg")
        tl.store(base[:, None] + offs_r[None, :], total, mask=pmask)
        tl.store(lock, 0)


@triton.jit
def _expand_block(scaled, b_ptr, rank, y_ptr, rows, tmask, stride_y, col_f, offs_n, nmask, BLOCK_R: tl.constexpr,
                  PRECISION: tl.constexpr):
    """y[rows, col_f + offs_n] += scaled @ B[offs_n]^T, B = [out, rank] row-major at b_ptr."""
    offs_r = tl.arange(0, BLOCK_R)
    bt = tl.load(b_ptr + offs_n[None, :] * rank + offs_r[:, None], mask=(offs_r < rank)[:, None] & nmask[None, :],
                 other=0.0)  # [BLOCK_R, BLOCK_N]: B^T
    delta = tl.dot(scaled, bt, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_y + (col_f + offs_n)[None, :]
    ymask = tmask[:, None] & nmask[None, :]
    old = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (old + delta).to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit(do_not_specialize=["meta_layer"])
def _bgmv_expand_kernel(
    y_ptr,  # [T, sum(out)] output, updated in place; row stride stride_y, column stride 1
    pool_ptr,  # [num_slots, slot_numel] slot pool; B of (slot, layer, m) is [out_m, rank] row-major at b_off
    part_ptr,  # [T, F, SPLIT_K, BLOCK_R] float32 from the shrink
    perm_ptr,  # BatchMeta.token_perm: the adapted tokens, slot by slot
    chunk_ptr,  # BatchMeta.chunks [max_chunks, 3] int32: (first position in token_perm, tokens, slot) per tile
    meta_layer,  # index of this layer's first entry within a slot's table
    b_off_ptr,  # SlotMeta.b_off [num_slots, L, M] int64
    rank_ptr,  # SlotMeta.rank [num_slots, L, M] int32
    scale_ptr,  # SlotMeta.scale [num_slots, L, M] float32
    stride_y,  # row stride of y
    stride_pool,  # row stride of the pool
    stride_off,  # slot stride of SlotMeta.b_off (int64 entries)
    stride_rank,  # slot stride of SlotMeta.rank and .scale (32-bit entries)
    out0, out1, out2, out3,  # output features of fused modules 0..3
    col0, col1, col2, col3,  # first column of y of fused modules 0..3
    midx0, midx1, midx2, midx3,  # SlotMeta module index of fused modules 0..3
    F: tl.constexpr,  # number of fused modules
    SPLIT_K: tl.constexpr,  # K splits written by the shrink
    BLOCK_T: tl.constexpr,  # tokens per tile (BatchMeta.chunk)
    BLOCK_R: tl.constexpr,  # >= every rank, a power of two >= 16
    BLOCK_N: tl.constexpr,  # output features per program (grid axis 2)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32 pools, else "tf32" (unused)
    ALIGN: tl.constexpr,  # every SlotMeta offset is a multiple of this many elements (vector loads)
    REDUCE: tl.constexpr,  # the shrink summed the splits into split 0
):
    c = tl.program_id(0)  # tile
    f = tl.program_id(1)  # fused module
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's output features
    out_f = tl.where(f == 0, out0, tl.where(f == 1, out1, tl.where(f == 2, out2, out3)))
    n = tl.load(chunk_ptr + c * 3 + 1)  # tokens of this tile; 0 past the batch's tiles
    if (n > 0) & (tl.program_id(2) * BLOCK_N < out_f):  # and not past a narrow module's columns
        slot = tl.load(chunk_ptr + c * 3 + 2).to(tl.int64)
        entry = meta_layer + tl.where(f == 0, midx0, tl.where(f == 1, midx1, tl.where(f == 2, midx2, midx3)))
        rank = tl.load(rank_ptr + slot * stride_rank + entry)
        if rank > 0:
            pos = tl.load(chunk_ptr + c * 3) + tl.arange(0, BLOCK_T)
            tmask = tl.arange(0, BLOCK_T) < n
            rows = tl.load(perm_ptr + pos, mask=tmask, other=0).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            vmask = tmask[:, None] & (offs_r < rank)[None, :]
            part = part_ptr + (pos.to(tl.int64) * F + f) * SPLIT_K * BLOCK_R  # [BLOCK_T]
            v = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float32)
            for s in range(1 if REDUCE else SPLIT_K):
                v += tl.load(part[:, None] + s * BLOCK_R + offs_r[None, :], mask=vmask, other=0.0)
            # the intermediate is rounded to the pool dtype for the tensor cores, as in SGMV (and Punica, vLLM)
            scaled = (v * tl.load(scale_ptr + slot * stride_rank + entry)).to(y_ptr.dtype.element_ty)
            b_off = tl.multiple_of(tl.load(b_off_ptr + slot * stride_off + entry), ALIGN)
            b_ptr = pool_ptr + slot * stride_pool + b_off
            col_f = tl.where(f == 0, col0, tl.where(f == 1, col1, tl.where(f == 2, col2, col3)))
            nmask = offs_n < out_f
            if rank % 8 == 0:  # rows of B start 16-byte aligned: vector loads
                _expand_block(scaled, b_ptr, (rank // 8) * 8, y_ptr, rows, tmask, stride_y, col_f, offs_n, nmask,
                              BLOCK_R, PRECISION)
            else:
                _expand_block(scaled, b_ptr, rank, y_ptr, rows, tmask, stride_y, col_f, offs_n, nmask, BLOCK_R,
                              PRECISION)


class BgmvPlan(NamedTuple):
    """Everything of a call that one argument signature fixes (``args.cached_plan``)."""

    part_shape: tuple[int, int, int, int]  # the float32 workspace [T, F, SPLIT_K, BLOCK_R]
    shrink: KernelCall  # takes (x, pool, part, token_perm, chunks, tile_locks, meta_layer)
    expand: KernelCall  # takes (y, pool, part, token_perm, chunks, meta_layer)
    device: torch.device
    modules_per_layer: int  # SlotMeta entries per layer: meta_layer = layer * this




def bgmv(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta, layer: int,
         modules: Sequence[str]) -> None:
    """Semantics: for every token t and every fused module m at column offset c_m::

        s = batch.token_slot[t]                    # -1: y[t] is left as it is
        r = slot_meta.rank[s, layer, m]            # 0: module m not adapted by slot s
        A = pool[s, a_off:][: r * d_in].view(r, d_in)          # a_off = slot_meta.a_off[s, layer, m]
        B = pool[s, b_off:][: out_m * r].view(out_m, r)        # b_off = slot_meta.b_off[s, layer, m]
        y[t, c_m : c_m + out_m] += slot_meta.scale[s, layer, m] * (x[t] @ A.T) @ B.T

    x: [T, d_in], y: [T, sum(out_m)], pool: [num_slots, slot_numel], all one dtype (fp16, bf16 or fp32),
    rows contiguous; accumulation in float32, ``x[t] @ A.T`` rounded to the pool dtype before the expand.
    Column-parallel shards: x is the full input and y this rank's slice of the outputs; row-parallel: x
    is this rank's input slice and y a full-width partial sum. Tokens are taken in the slot-grouped
    tiles ``batch.token_perm`` / ``batch.chunks`` that either BatchMeta setter writes.
    """
    plan = cached_plan("bgmv", x, y, pool, slot_meta, batch, layer, modules,
                       lambda launch: _plan(x, y, pool, slot_meta, batch, launch))
    meta_layer = layer * plan.modules_per_layer
    part = torch.empty(plan.part_shape, dtype=torch.float32, device=plan.device)
    plan.shrink(x, pool, part, batch.token_perm, batch.chunks, batch.tile_locks, meta_layer)
    plan.expand(y, pool, part, batch.token_perm, batch.chunks, meta_layer)


def _plan(x: torch.Tensor, y: torch.Tensor, pool: torch.Tensor, slot_meta: SlotMeta, batch: BatchMeta,
          launch: Launch) -> BgmvPlan:
    tiles = batch.chunk_grid(slot_meta.num_slots)
    cfg = bgmv_config(launch.fused, launch.d_in, launch.max_out, slot_meta.max_rank, tiles, x.device)
    common = dict(rank_ptr=slot_meta.rank, stride_pool=pool.stride(0), stride_off=slot_meta.a_off.stride(0),
                  stride_rank=slot_meta.rank.stride(0), F=launch.fused, SPLIT_K=cfg.split_k, BLOCK_T=batch.chunk,
                  BLOCK_R=cfg.block_r, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ALIGN=OFFSET_ALIGN,
                  REDUCE=cfg.reduce)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    modules = launch.per_module()
    shrink = dict(common, a_off_ptr=slot_meta.a_off, stride_x=x.stride(0), d_in=launch.d_in,
                  k_per_split=cfg.k_per_split, BLOCK_K=cfg.block_k,
                  **{k: v for k, v in modules.items() if k.startswith("midx")})
    expand = dict(common, b_off_ptr=slot_meta.b_off, scale_ptr=slot_meta.scale, stride_y=y.stride(0),
                  BLOCK_N=cfg.block_n, **modules)
    return BgmvPlan(
        part_shape=(launch.tokens, launch.fused, cfg.split_k, cfg.block_r),
        shrink=KernelCall(_bgmv_shrink_kernel, (tiles, launch.fused, cfg.split_k), 7, shrink, options),
        expand=KernelCall(_bgmv_expand_kernel, (tiles, launch.fused, triton.cdiv(launch.max_out, cfg.block_n)), 6,
                          expand, options),
        device=x.device, modules_per_layer=len(slot_meta.modules))
