"""Block sizes and grid splits of the LoRA kernels, chosen from shapes only (never from batch contents).

Only shapes decide a launch's grid and constants, so a CUDA graph captured for a shape stays valid when
the metadata is refilled between replays. Splits aim at a few waves of programs on the GPU; under
``TRITON_INTERPRET`` every program and loop step runs in Python, so there programs are few and wide.
The knobs are frozen dataclasses; ``python -m bench.probes.kernels --sweep`` tries others through ``tuned``.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton

from workers.kernels.knobs import KNOBS, BgmvKnobs, SgmvKnobs, tuned

__all__ = ["KNOBS", "BgmvKnobs", "SgmvKnobs", "bgmv_config", "interpreting", "sgmv_config", "tuned"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=16)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; 0 on the CPU or when interpreting (no splits)."""
    if device.type != "cuda" or interpreting():
        return 0
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


class BgmvConfig(NamedTuple):
    split_k: int  # K splits of the shrink (grid axis 2)
    k_per_split: int  # input features per split, a multiple of block_k
    block_k: int  # input features per shrink tile
    block_n: int  # output features per expand program
    block_r: int  # the whole rank in one tile: max_rank rounded up to a power of two >= 16
    num_warps: int
    num_stages: int
    reduce: bool  # the shrink sums the K splits (only when there are several)


def bgmv_config(fused: int, d_in: int, max_out: int, max_rank: int, tiles: int, device: torch.device) -> BgmvConfig:
    """Block sizes and K splits for a grid of ``tiles`` token tiles (``BatchMeta.chunk_grid``): sizes only."""
    knobs = KNOBS["bgmv"]
    assert isinstance(knobs, BgmvKnobs)
    block_r = max(16, triton.next_power_of_2(max_rank))
    block_k = max(16, min(knobs.block_k, triton.next_power_of_2(d_in)))
    # under the interpreter every program is Python: one column block (and no K splits: no SMs)
    block_n = max(16, triton.next_power_of_2(max_out)) if interpreting() else knobs.block_n
    k_blocks = triton.cdiv(d_in, block_k)
    split_k = max(1, min(k_blocks, knobs.waves * _sms(device) // (tiles * fused)))
    split_k = 1 << (split_k.bit_length() - 1)  # a power of two: few compiled variants
    k_per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(d_in, k_per_split)  # no empty splits
    return BgmvConfig(split_k, k_per_split, block_k, block_n, block_r, knobs.num_warps, knobs.num_stages,
                      bool(knobs.reduce) and split_k > 1)


class SgmvConfig(NamedTuple):
    block_t: int  # tokens per program (grid axis 0)
    block_k: int  # input features per shrink tile
    block_n: int  # output features per expand tile
    block_r: int  # the whole rank in one tile: max_rank rounded up to a power of two >= 16
    n_splits: int  # programs sharing one module's output columns (grid axis 2)
    n_per_split: int  # output features per split, a multiple of block_n
    num_warps: int


def sgmv_config(tokens: int, fused: int, d_in: int, max_out: int, max_rank: int,
                device: torch.device) -> SgmvConfig:
    knobs = KNOBS["sgmv"]
    assert isinstance(knobs, SgmvKnobs)
    block_t = 16 if tokens <= 16 else 32 if tokens <= 64 else 64
    block_r = max(16, triton.next_power_of_2(max_rank))
    block_k = max(16, min(knobs.block_k, triton.next_power_of_2(d_in)))
    tiles, n_blocks = triton.cdiv(tokens, block_t), triton.cdiv(max_out, knobs.block_n)
    n_splits = max(1, min(n_blocks, knobs.waves * _sms(device) // (tiles * fused)))
    n_per_split = triton.cdiv(n_blocks, n_splits) * knobs.block_n
    n_splits = triton.cdiv(max_out, n_per_split)  # no empty splits
    return SgmvConfig(block_t, block_k, knobs.block_n, block_r, n_splits, n_per_split, 4 if block_t <= 32 else 8)
