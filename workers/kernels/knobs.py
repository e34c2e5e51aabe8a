"""The LoRA kernels' tuning knobs, frozen dataclasses, and ``tuned`` to run with others (no Triton import:
``args.cached_plan`` keys launch plans by them, and the worker cache imports that without Triton)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BgmvKnobs:
    block_k: int = 128  # input features per shrink tile (A^T tile: 128 x 64 ranks bf16 = 16 KiB)
    block_n: int = 128  # output features per expand program
    num_warps: int = 4
    num_stages: int = 3  # software pipelining depth of the K loop
    waves: int = 2  # aim for this many programs per SM when splitting K (2: best of 2/4/8 in the H200 sweep)
    reduce: bool = True  # the shrink's last split sums the splits (else every expand program sums them)


@dataclass(frozen=True)
class SgmvKnobs:
    block_k: int = 64  # input features per shrink tile
    block_n: int = 64  # output features per expand tile
    waves: int = 2  # aim for this many programs per SM when splitting the output columns


KNOBS: dict[str, BgmvKnobs | SgmvKnobs] = {"bgmv": BgmvKnobs(), "sgmv": SgmvKnobs()}


@contextlib.contextmanager
def tuned(kernel: str, **knobs: int | bool) -> Iterator[None]:
    """Run with other knobs for ``kernel`` ("bgmv" or "sgmv"), e.g. ``tuned("bgmv", block_k=512)``."""
    old: Any = KNOBS[kernel]
    KNOBS[kernel] = dataclasses.replace(old, **knobs)
    try:
        yield
    finally:
        KNOBS[kernel] = old


