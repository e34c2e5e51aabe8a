"""Gather: many byte ranges of one device buffer copied into another in one launch.

What it is for: a rank taking its shard of a pushed adapter straight from the trainer's buffer on the GPU (issue 44
item 5; ``workers.reads.device``). A shard is hundreds to thousands of ranges (every matrix, and every row of a
row-parallel ``lora_A``'s column slice): one copy launch per range costs more than the bytes themselves (an 8B
rank-16 shard is 448 matrices and 1.6 ms of host-to-device copy), so the ranges are copied by one kernel.

Semantics (``gather_reference`` is the torch twin; both are checked against each other):
    for every segment (s, d, n) of the plan, in bytes:   dst[d : d + n] = src[s : s + n]
``src`` and ``dst`` are 1-D ``uint8`` tensors on one device. Segments never overlap in ``dst`` (``gather_plan``
refuses it), so their order does not matter. ``src`` is only read; bytes of ``dst`` no segment names are left as
they were.

How: the plan is a table of (source word, destination word, words) rows, in the widest word (8, 4, 2 or 1 bytes)
that divides every offset and length and both buffers' addresses, each row at most ``chunk_bytes``. One program
copies one row in blocks of ``BLOCK`` words. The table is built once per plan on the host and uploaded once per
device; a launch is then one kernel, no host sync. On a CPU tensor outside the Triton interpreter the twin runs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from workers.kernels.tuning import interpreting

BUILT_FOR_INTERPRETER = interpreting()  # @triton.jit decides at import: interpreter or GPU compiler
CHUNK_BYTES = 64 << 10  # a row's bytes at most: a 1 GB shard is ~16k programs, a few waves on any GPU
BLOCK_BYTES = 8 << 10  # bytes one program moves per step (1024 words of 8 bytes, 8 per thread at 4 warps)
WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _gather_kernel(
    src_ptr,  # the source buffer, as words
    dst_ptr,  # the destination buffer, as words
    table_ptr,  # [rows, 3] int64: (source word, destination word, words) per row
    BLOCK: tl.constexpr,  # words per step
):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(table_ptr + row * 3)
    d = tl.load(table_ptr + row * 3 + 1)
    n = tl.load(table_ptr + row * 3 + 2)
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst_ptr + d + offs, tl.load(src_ptr + s + offs, mask=m), mask=m)


class GatherError(ValueError):
    """A gather's plan or buffers that cannot be run: the message names the segment or buffer and the fix."""


@dataclass(frozen=True, eq=False)
class GatherPlan:
    """Segments (source byte, destination byte, bytes) merged where adjacent in both, in destination order; the
    table of rows for a word of ``word`` bytes is made on first use per (device, word) and kept."""

    segments: tuple[tuple[int, int, int], ...]
    word: int  # the widest word dividing every offset and length
    src_end: int  # bytes of the source the plan reads up to
    dst_end: int  # bytes of the destination it writes up to
    chunk_bytes: int
    _tables: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.segments)

    def rows(self, word: int) -> list[tuple[int, int, int]]:
        """The kernel's rows in words of ``word`` bytes (a divisor of ``self.word``), each at most a chunk."""
        step = self.chunk_bytes  # a multiple of 8, so of every word
        return [((s + k) // word, (d + k) // word, min(step, n - k) // word)
                for s, d, n in self.segments for k in range(0, n, step)]

    def table(self, device: torch.device, word: int) -> torch.Tensor:
        """The rows as an int64 [rows, 3] tensor on ``device``, made once (an upload per device and word)."""
        key = (str(device), word)
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                host = torch.tensor(self.rows(word), dtype=torch.int64).view(-1, 3)
                table = self._tables[key] = host.to(device)
            return table


def gather_plan(segments: Sequence[tuple[int, int, int]], chunk_bytes: int = CHUNK_BYTES) -> GatherPlan:
    """The plan of ``segments`` (source byte, destination byte, bytes). Refused, naming the segment: a negative
    offset, an empty or negative length, or two segments writing the same destination byte."""
    if chunk_bytes < 8 or chunk_bytes % 8:
        raise GatherError(f"chunk_bytes={chunk_bytes} is not a positive multiple of 8: give one such as {CHUNK_BYTES}")
    for seg in segments:
        s, d, n = seg
        if s < 0 or d < 0 or n <= 0:
            raise GatherError(f"gather segment {seg} (source byte, destination byte, bytes) is not a range: offsets "
                              "must be >= 0 and the length > 0; drop empty slices before planning")
    merged: list[tuple[int, int, int]] = []
    for s, d, n in sorted(segments, key=lambda seg: seg[1]):
        if merged:
            ps, pd, pn = merged[-1]
            if d < pd + pn:
                raise GatherError(f"gather segments {merged[-1]} and {(s, d, n)} both write destination bytes "
                                  f"{d}..{min(d + n, pd + pn) - 1}: each destination byte must come from one place")
            if pd + pn == d and ps + pn == s:
                merged[-1] = (ps, pd, pn + n)
                continue
        merged.append((s, d, n))
    g = math.gcd(*(x for seg in merged for x in seg), 8) if merged else 8
    word = max(w for w in WORDS if g % w == 0)
    return GatherPlan(tuple(merged), word, max((s + n for s, _, n in merged), default=0),
                      max((d + n for _, d, n in merged), default=0), chunk_bytes)


def _check(dst: torch.Tensor, src: torch.Tensor, plan: GatherPlan) -> None:
    for name, t, end in (("destination", dst, plan.dst_end), ("source", src, plan.src_end)):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise GatherError(f"the gather's {name} is {t.dtype} of shape {tuple(t.shape)}: give a contiguous 1-D "
                              "uint8 view (tensor.view(torch.uint8))")
        if t.numel() < end:
            raise GatherError(f"the gather's {name} holds {t.numel()} bytes but its plan reaches byte {end}: give the "
                              "whole buffer the plan was made for")
    if dst.device != src.device:
        raise GatherError(f"the gather's source is on {src.device} and its destination on {dst.device}: both must be "
                          "on one device (open the source there first)")


def gather_reference(dst: torch.Tensor, src: torch.Tensor, plan: GatherPlan) -> None:
    """The torch twin: one copy per segment, in plan order (on the current stream for CUDA tensors)."""
    _check(dst, src, plan)
    for s, d, n in plan.segments:
        dst[d:d + n].copy_(src[s:s + n])


def _word_for(plan: GatherPlan, *buffers: torch.Tensor) -> int:
    word = plan.word
    while any(t.data_ptr() % word for t in buffers):
        word //= 2
    return word


def gather(dst: torch.Tensor, src: torch.Tensor, plan: GatherPlan) -> None:
    """Run ``plan``: one launch on the current stream (the caller orders it after the source's event); the twin for
    CPU tensors outside the Triton interpreter."""
    _check(dst, src, plan)
    if not plan.segments:
        return
    if src.device.type != "cuda" and not interpreting():
        gather_reference(dst, src, plan)
        return
    word = _word_for(plan, dst, src)
    dtype = WORDS[word]
    table = plan.table(src.device, word)
    # views as words: each buffer cut to whole words (the plan's offsets and ends are multiples of the word)
    s = src[:src.numel() // word * word].view(dtype)
    d = dst[:dst.numel() // word * word].view(dtype)
    block = 256 if interpreting() else BLOCK_BYTES // word
    _gather_kernel[(table.shape[0],)](s, d, table, BLOCK=block, num_warps=4)


def warm(device: torch.device) -> float:
    """Compile the gather for every word it launches with (one launch each on a scratch buffer of ``device``), so a
    trainer's first push does not wait for Triton's compiler: it did, 2.0-2.3 s on a fresh H100 (bench/reports/
    issue-44.md). The seconds it took; nothing to do on the CPU (the twin runs there)."""
    if device.type != "cuda" or interpreting():
        return 0.0
    start = time.perf_counter()
    with torch.cuda.device(device):
        src = torch.zeros(64, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for word in WORDS:  # the widest word each plan's offsets allow: each is its own compiled kernel
            gather(dst, src, gather_plan([(0, 0, word)]))
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
