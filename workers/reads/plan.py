"""How one rank's read is cut into tasks for several reader threads (lifecycle step 5). Plain Python.

A slice that is one range of the file (a whole matrix, a block of whole rows: every column-parallel ``lora_A``
and ``lora_B``, every row-parallel ``lora_B``) of the buffer's own dtype is a ``Run``: one positioned read
(``os.preadv``) straight into its place in the packed buffer. A row-parallel ``lora_A``'s column slice (one
segment per row) is ``Strided``: one positioned read of the rows' span, each row's segment into its place and
the bytes between them into a scratch buffer (or, measured against it, one read per row). A file tensor of
another dtype is a *conversion*: its span read into scratch memory, then copied into place by torch. No page
of the file is mapped: a file cut short fails a read cleanly (no SIGBUS), and no mapping is faulted in or
torn down per read. Large matrices are cut by rows, and consecutive pieces are packed into tasks of about
``task_bytes`` each, in the layout's order, so that a chunk's tasks are spread over the threads and the next
chunk's start as soon as a thread is free (``workers.reads.threads``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from lora_cache.adapters.shards import ShardEntry


class FileTensor(NamedTuple):
    """Where one tensor's bytes are in the file (row-major)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of its first element in the file


class Run(NamedTuple):
    """File bytes ``start : start + nbytes`` read into the packed buffer's bytes ``at : at + nbytes``."""

    start: int
    at: int
    nbytes: int


class Strided(NamedTuple):
    """``rows`` segments of ``width`` bytes, ``stride`` bytes apart in the file from ``start``, packed one after
    another into the buffer from byte ``at``: a column slice."""

    start: int
    at: int
    rows: int
    width: int
    stride: int


class Task(NamedTuple):
    """What one reader thread does at once."""

    runs: tuple[Run, ...]
    strided: tuple[Strided, ...]
    converts: tuple[ShardEntry, ...]  # entries (or row pieces of them) of another dtype, or every piece (mmap)
    nbytes: int  # file bytes of the slices it reads


def contiguous(e: ShardEntry, t: FileTensor) -> bool:
    """Whether ``e``'s slice of ``t`` is one range of the file: whole rows, or a part of one row."""
    return (e.cols.start, e.cols.stop) == (0, t.shape[-1]) or e.shape[0] == 1


def run_of(e: ShardEntry, t: FileTensor) -> Run:
    """The positioned read of a contiguous slice of ``t`` of the buffer's dtype."""
    size = t.dtype.itemsize
    return Run(t.start + (e.rows.start * t.shape[-1] + e.cols.start) * size, e.offset * size, e.numel * size)


def strided_of(e: ShardEntry, t: FileTensor) -> Strided:
    size = t.dtype.itemsize
    return Strided(t.start + (e.rows.start * t.shape[-1] + e.cols.start) * size, e.offset * size, e.shape[0],
                   e.shape[1] * size, t.shape[-1] * size)


def span_of(e: ShardEntry, t: FileTensor) -> tuple[int, int]:
    """(first file byte, bytes) from ``e``'s first element to its last: what a conversion reads."""
    size, cols = t.dtype.itemsize, t.shape[-1]
    first = t.start + (e.rows.start * cols + e.cols.start) * size
    return first, ((e.shape[0] - 1) * cols + e.shape[1]) * size


def row_pieces(e: ShardEntry, t: FileTensor, max_bytes: int) -> list[ShardEntry]:
    """``e`` cut by rows into pieces of at most ``max_bytes`` file bytes (at least one row each)."""
    rows, cols = e.shape
    per = max(1, max_bytes // max(1, cols * t.dtype.itemsize))
    if per >= rows:
        return [e]
    return [e._replace(rows=slice(e.rows.start + i, e.rows.start + min(rows, i + per)),
                       shape=(min(rows, i + per) - i, cols), offset=e.offset + i * cols)
            for i in range(0, rows, per)]


def plan_tasks(index: Mapping[str, FileTensor], entries: Sequence[ShardEntry], dtype: torch.dtype, task_bytes: int,
               direct: bool = True) -> list[Task]:
    """The tasks that read ``entries`` into a packed buffer of ``dtype``, in the layout's order, each of about
    ``task_bytes`` file bytes (one matrix piece at least). ``direct`` False: every piece is a conversion (for
    the probe's comparison: the single reader's mapped-file copies, split over threads)."""
    tasks: list[Task] = []
    runs: list[Run] = []
    strided: list[Strided] = []
    converts: list[ShardEntry] = []
    held = 0
    for e in entries:
        t = index[e.key]
        for piece in row_pieces(e, t, task_bytes):
            if not direct or t.dtype != dtype:
                converts.append(piece)
            elif contiguous(piece, t):
                run = run_of(piece, t)
                last = runs[-1] if runs else None
                if last is not None and last.start + last.nbytes == run.start and last.at + last.nbytes == run.at:
                    runs[-1] = Run(last.start, last.at, last.nbytes + run.nbytes)  # adjacent in file and buffer
                else:
                    runs.append(run)
            else:
                strided.append(strided_of(piece, t))
            held += piece.numel * t.dtype.itemsize
            if held >= task_bytes:
                tasks.append(Task(tuple(runs), tuple(strided), tuple(converts), held))
                runs, strided, converts, held = [], [], [], 0
    if runs or strided or converts:
        tasks.append(Task(tuple(runs), tuple(strided), tuple(converts), held))
    return tasks


def task_bytes_for(nbytes: int, readers: int, least: int = 256 << 10, most: int = 8 << 20) -> int:
    """A task size that gives each of ``readers`` threads about one task of an ``nbytes`` chunk, within
    ``least`` (a task's overhead, tens of microseconds, stays small) and ``most``."""
    return max(least, min(most, -(-nbytes // max(1, readers))))
