"""The positioned reads one reader thread makes for its task (lifecycle step 5; ``workers.reads.plan``).

Every byte comes from ``os.preadv`` on the read's one fd, which releases the GIL for the copy out of the page
cache: runs straight into the packed buffer; a column slice's rows into their places with the bytes between
them into this thread's scratch buffer (one call per matrix piece) or one call per row (no byte between rows
read); conversions into scratch, then copied into place by torch; block CRCs from scratch.
A read that comes back short (the file was cut while it was read) raises ``FileShrank``.

``read_runs_direct``: the runs by ``O_DIRECT`` reads (``HostTierConfig.direct_reads``): no page cache, so a cold
file is read at the device's own rate at the readers' queue depth, nothing is copied out of the page cache, and
no page is left to drop. ``O_DIRECT`` takes only block-aligned offsets, lengths and addresses, and a run's place in
the packed buffer is not aligned with its place in the file, so each read lands in this thread's page-aligned
bounce buffer (runs close together in the file by one read) and its runs are copied into place by torch (the GIL
let go).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch

from lora_cache.adapters.shards import ShardEntry
from workers.reads.plan import FileTensor, Run, Strided, Task, span_of

try:  # ISA-L's CRC-32: zlib's checksum (the registered CRCs are zlib's), 15-25x as fast here; optional
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - an image without isal: zlib's (2-3 GB/s)
    from zlib import crc32

MAX_IOV = 1024  # IOV_MAX on Linux: vectors one preadv may take
_SCRATCH = threading.local()  # each reader thread's buffer for skipped bytes, conversions and CRCs
DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and addresses aligned to the device's logical block (<= 4 KiB)
DIRECT_GAP = 64 << 10  # runs at most this far apart in the file are read by one O_DIRECT read, the gap with them
DIRECT_SPAN = 8 << 20  # one O_DIRECT read's bytes at most (a longer run alone is read whole)
_BOUNCE = threading.local()  # each reader thread's page-aligned buffer for O_DIRECT reads
_REFUSED: list[OSError] = []  # the first O_DIRECT read refused (EINVAL) in this process: told once
log = logging.getLogger(__name__)


class FileShrank(EOFError):
    """The file ended before byte ``offset``, which the read needed."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"the file ended before byte {offset}")
        self.offset = offset


def scratch(nbytes: int) -> memoryview:
    """This thread's scratch buffer, at least ``nbytes`` long (kept for its next task)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = bytearray(max(nbytes, 1 << 20))
    return memoryview(buf)


def pread_all(fd: int, into: memoryview, offset: int) -> None:
    """Fill ``into`` from the file at ``offset``; ``FileShrank`` if it ends first."""
    done, want = 0, len(into)
    while done < want:
        got = os.preadv(fd, [into[done:]], offset + done)
        if got <= 0:
            raise FileShrank(offset + want)
        done += got


def read_runs(fd: int, raw: memoryview, runs: Iterable[Run]) -> None:
    for run in runs:
        pread_all(fd, raw[run.at : run.at + run.nbytes], run.start)


def bounce(nbytes: int) -> tuple[memoryview, torch.Tensor]:
    """This thread's page-aligned buffer for ``O_DIRECT`` reads (an anonymous mapping), at least ``nbytes`` long,
    as bytes and as a uint8 tensor over the same memory (kept for its next read)."""
    kept = getattr(_BOUNCE, "kept", None)
    if kept is None or len(kept[0]) < nbytes:
        size = -(-max(nbytes, 1 << 20) // mmap.PAGESIZE) * mmap.PAGESIZE
        mapped = mmap.mmap(-1, size)
        kept = _BOUNCE.kept = (memoryview(mapped), torch.frombuffer(mapped, dtype=torch.uint8))
    return kept


def read_runs_direct(dfd: int, dest: torch.Tensor, runs: Iterable[Run]) -> None:
    """``runs`` into ``dest`` (the packed buffer as uint8) by ``O_DIRECT`` reads of ``dfd`` (the file opened with
    it): runs within ``DIRECT_GAP`` of each other in the file, up to ``DIRECT_SPAN``, by one aligned read into this
    thread's ``bounce`` buffer, then each copied into place. Only the file's end may make a read short (its size
    need not be aligned); ``FileShrank`` if it ends before a run does."""
    ordered = sorted(runs, key=lambda r: r.start)
    i = 0
    while i < len(ordered):
        lo, hi, j = ordered[i].start, ordered[i].start + ordered[i].nbytes, i + 1
        while (j < len(ordered) and ordered[j].start - hi <= DIRECT_GAP
               and ordered[j].start + ordered[j].nbytes - lo <= DIRECT_SPAN):
            hi, j = max(hi, ordered[j].start + ordered[j].nbytes), j + 1
        first = lo - lo % DIRECT_ALIGN
        want = -(-hi // DIRECT_ALIGN) * DIRECT_ALIGN - first
        raw, tensor = bounce(want)
        done = 0
        while done < want:
            got = os.preadv(dfd, [raw[done:want]], first + done)
            done += max(got, 0)
            if got <= 0 or got % DIRECT_ALIGN:  # the file's end: an unaligned offset may not be read on from
                break
        if first + done < hi:
            raise FileShrank(hi)
        for run in ordered[i:j]:
            at = run.start - first
            dest[run.at : run.at + run.nbytes].copy_(tensor[at : at + run.nbytes])
        i = j


def read_strided(fd: int, raw: memoryview, s: Strided, rows: bool = False) -> None:
    """The segments of ``s`` into their places: by one preadv over their span, what lies between them read into
    scratch (every byte of the span is copied: 4x the bytes needed at TP 4), or, ``rows``, by one preadv per
    segment. Rows move fewer bytes but make a call each, and every call of a thread waits for the GIL again:
    with 8 reader threads, reading Llama-3.1-8B's column slices row by row took 26 ms more per rank-64 TP-4
    shard than reading their spans (bench/RESULTS.md, issue 30)."""
    if rows or s.rows == 1:
        at, off, width = s.at, s.start, s.width
        for _ in range(s.rows):
            if os.preadv(fd, [raw[at : at + width]], off) != width:
                pread_all(fd, raw[at : at + width], off)
            at, off = at + width, off + s.stride
        return
    gap = scratch(s.stride - s.width)[: s.stride - s.width]
    per = MAX_IOV // 2  # rows per call: a row and a gap each
    for first in range(0, s.rows, per):
        n = min(per, s.rows - first)
        iov: list[memoryview] = []
        for i in range(first, first + n):
            iov.append(raw[s.at + i * s.width : s.at + (i + 1) * s.width])
            if i < first + n - 1:
                iov.append(gap)
        want = n * s.width + (n - 1) * len(gap)
        if os.preadv(fd, iov, s.start + first * s.stride) != want:  # short (never from the page cache): by rows
            read_strided(fd, raw, s._replace(start=s.start + first * s.stride, at=s.at + first * s.width, rows=n),
                         rows=True)


def convert(fd: int, dest: torch.Tensor, index: Mapping[str, FileTensor], pieces: Iterable[ShardEntry]) -> None:
    """Pieces of another dtype: each piece's span read into scratch, its slice copied (converted) into place."""
    for e in pieces:
        t = index[e.key]
        first, nbytes = span_of(e, t)
        raw = scratch(nbytes)[:nbytes]
        pread_all(fd, raw, first)
        span = torch.frombuffer(raw, dtype=t.dtype)  # type: ignore[call-overload]
        src = span.as_strided(e.shape, (t.shape[-1], 1))
        dest[e.offset : e.offset + e.numel].view(e.shape).copy_(src)


def read_task(fd: int, raw: memoryview, dest: torch.Tensor, index: Mapping[str, FileTensor], task: Task,
              rows: bool = False, direct: int | None = None) -> bool:
    """One task: its runs (``direct``: the file's ``O_DIRECT`` fd, ``read_runs_direct``), its column slices
    (``rows``: row by row), its conversions. True where its runs were to go by ``O_DIRECT`` and the device refused
    them (they went through the page cache)."""
    refused = False
    if direct is None:
        read_runs(fd, raw, task.runs)
    elif task.runs:
        try:
            read_runs_direct(direct, dest.view(torch.uint8), task.runs)
        except OSError as e:  # a device whose blocks are larger than DIRECT_ALIGN: EINVAL; read them again by fd
            if e.errno != errno.EINVAL:
                raise
            if not _REFUSED:
                _REFUSED.append(e)
                log.warning("O_DIRECT reads were refused (%s): reads go through the page cache where that happens", e)
            read_runs(fd, raw, task.runs)
            refused = True
    for s in task.strided:
        read_strided(fd, raw, s, rows)
    convert(fd, dest, index, task.converts)
    return refused


def bad_block(fd: int, crcs: Sequence[int], size: int, blocks: Iterable[int], block_bytes: int) -> int | None:
    """The first of ``blocks`` (of ``block_bytes`` each; the last one of the ``size``-byte file shorter) whose
    CRC-32 is not ``crcs[block]``, or None."""
    for b in blocks:
        start = b * block_bytes
        raw = scratch(block_bytes)[: min(block_bytes, size - start)]
        pread_all(fd, raw, start)
        if crc32(raw) != crcs[b]:
            return b
    return None


def block_crc(fd: int, raw: memoryview, runs: Sequence[Run], block: int, block_bytes: int, size: int) -> int:
    """The CRC-32 of file block ``block`` (of ``block_bytes``; the last one of the ``size``-byte file shorter),
    taken from the bytes ``runs`` (sorted by file offset, not overlapping) put into ``raw`` wherever they cover
    it, and from the file (``preadv`` into scratch) where they do not: a block a chunk has read whole costs no
    read at all, and one it has read in part only the rest. ``FileShrank`` if the file ends before the block."""
    start = block * block_bytes
    end = min(start + block_bytes, size)
    crc, at = 0, start
    for run in runs:
        lo, hi = max(at, run.start), min(end, run.start + run.nbytes)
        if lo >= hi:
            if run.start >= end:
                break
            continue
        if lo > at:  # a gap before this run: from the file
            gap = scratch(lo - at)[: lo - at]
            pread_all(fd, gap, at)
            crc = crc32(gap, crc)
        crc = crc32(raw[run.at + lo - run.start : run.at + hi - run.start], crc)
        at = hi
    if at < end:
        rest = scratch(end - at)[: end - at]
        pread_all(fd, rest, at)
        crc = crc32(rest, crc)
    return crc
