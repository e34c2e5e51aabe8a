"""Read only this rank's slices of an adapter file into a packed staging buffer (lifecycle step 5).

Every slice is read by ``os.preadv`` into its place, with no page of the file mapped (``workers.reads.plan``,
``workers.reads.positioned``), planned once per rank pattern, each chunk's block checks beside its reads; the header is
parsed once per file version. A read is split over a ``ReadPool``'s threads (``workers.reads.threads``), or runs
in the calling thread alone (no ``pool``). The single reader used to copy from a mapped file (2-5 GB/s from
the page cache, issue 30), and a file cut short under a mapping raises SIGBUS, which killed the whole worker
when its reads ran in threads (issue 35): no read of the service maps an adapter file now; ``how="mmap"``
remains for the probes that measure it. What is left under the GIL (the single reader's views, 5-8 ms per
Llama-3.1-8B shard; a split read's calls, microseconds each) makes a step launched from Python beside it wait
at every kernel. So a GPU worker runs this in reader processes (``workers.reads.processes``), and threads run it
only where there is no GPU (bench/RESULTS.md, ``python -m bench.probes.reader``). A file cut short or grown
while it is read fails the read with ``AdapterChangedError`` (a short ``preadv``, or the ``fstat`` after each
chunk); no process dies of it.

The version proof (the file's identity before and after, its header, the blocks read, as ``verify`` says) is
``workers.reads.proof``'s; this module reads, and publishes a chunk only once it is proven.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from lora_cache.adapters.files import (
    BLOCK_BYTES,
    FileIdentity,
    WeightsSource,
    same_file,
)
from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardEntry, ShardLayout
from lora_cache.errors import AdapterChangedError, AdapterFormatError, NonFiniteWeightsError
from lora_cache.vocab import AdapterKey
from workers import faults
from workers.lru import BoundedLRU
from workers.reads.plan import FileTensor, Run, Task, plan_tasks, task_bytes_for
from workers.reads.positioned import FileShrank, bad_block, block_crc, read_task
from workers.reads.proof import (
    blocks_of,
    changed_block,
    checked_index,
    chunk_checks,
    open_unchanged,
    settle_blocks,
)
from workers.reads.threads import ReadPool, run_in_order

log = logging.getLogger(__name__)


def read_shard(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor, verify: str = "sample",
               chunks: Sequence[slice] | None = None, on_chunk: Callable[[int], None] | None = None,
               pool: ReadPool | None = None, marks: list[tuple[str, float]] | None = None, how: str = "preadv") -> int:
    """Fill ``dest`` (1-D, ``layout.dtype``, >= ``layout.numel``) with the shard; returns bytes read.
    Fault point ``mid_read`` (``workers.faults``): the file is open and checked, nothing read yet.

    A rank reads only its parts of each matrix; a file tensor of another dtype is converted as it is copied.
    ``chunks``: ranges of the layout's entries read one after another (default: one); ``on_chunk(k)`` runs
    once the first ``k`` are in ``dest``, so their host-to-GPU copies can start while the rest is read
    (``lora_cache.adapters.chunks``). ``pool``: reader threads that split the read (``workers.reads.threads``);
    None: this thread alone. ``marks``, ``how``: as ``read_slices``'s.
    """
    if spec.source is None:
        raise AdapterFormatError(f"adapter {spec.name}@{spec.version} was not registered from a file; "
                                 "register it from its directory to read it")
    key = AdapterKey(spec.name, spec.version)
    return read_slices(spec.source, layout.entries, dest, f"TP {layout.rank}/{layout.tp}", verify, chunks, on_chunk,
                       pool, how, opened=lambda: faults.hit("mid_read", key), marks=marks)


HOW = {  # how a split read moves its bytes (bench/RESULTS.md, issue 30: "preadv" was the fastest measured)
    "preadv": "positioned reads straight into the buffer; a column slice by one read over its span (the default)",
    "rows": "positioned reads; a column slice row by row (fewer bytes, a call per row)",
    "mmap": "mapped-file copies, split over the threads (probes only: a file cut short under the map raises SIGBUS)",
    "direct": "as preadv, but the runs by O_DIRECT reads through an aligned bounce buffer (for a file out of the "
              "page cache: HostTierConfig.direct_reads); preadv where the file system refuses O_DIRECT",
}


def read_slices(source: WeightsSource, entries: tuple[ShardEntry, ...], dest: torch.Tensor, shard: str,
                verify: str = "sample", chunks: Sequence[slice] | None = None,
                on_chunk: Callable[[int], None] | None = None, pool: ReadPool | None = None,
                how: str = "preadv", opened: Callable[[], None] | None = None,
                marks: list[tuple[str, float]] | None = None, part: tuple[int, int] = (0, 1),
                readers: int = 0) -> int:
    """``read_shard`` from what a reader process is sent: the registered weights file, the layout's entries;
    ``shard`` names the shard in errors; ``how``: one of ``HOW``; ``opened``: called once the file is open and
    its header checked, before any slice is read (a fault point). ``marks``: gets (phase, ``time.perf_counter``)
    of its steps (opened, planned, each chunk proven) and ("busy read" / "busy crc", seconds) of each task, for
    the probes' phase breakdown (``bench.probes.cold_read``). ``part`` (i, n): this call does only part i of n
    of every chunk's tasks (its slices and checks; ``on_chunk`` then tells that its part of the chunks is in
    place), the other parts done by other reader processes into the same buffer (``workers.staging.host_tier``:
    ``ProcessReads``); ``readers``: the threads of all parts together, for the tasks' size (0: ``pool``'s).

    A chunk is published (``on_chunk``: its copy to the GPU may start, and a ``pipelined`` step may read it)
    only once it is proven as the whole read would be: its blocks checked as ``verify`` says and the file's
    identity unchanged since the open. A change found later fails the read before READY; what was published
    was the registered version's bytes."""
    if how not in HOW:
        raise ValueError(f"how {how!r} is not one of {', '.join(HOW)}")
    weights = Path(source.path)
    fd, source = open_unchanged(source)
    spans = chunks or (slice(0, len(entries)),)

    def proven(k: int) -> None:  # chunk k is in place and its blocks checked: the file must be the one opened
        same_file(weights, source.identity, FileIdentity.of(os.fstat(fd)), "while it was read, after", source.version)
        if marks is not None:
            marks.append((f"proven {k}", time.perf_counter()))
        if on_chunk is not None:
            on_chunk(k + 1)

    try:
        index = checked_index(fd, source)
        if marks is not None:
            marks.append(("opened", time.perf_counter()))
        if opened is not None:
            opened()
        if how == "mmap":
            with _mapped(fd) as mapped:
                return _read_parallel(pool, fd, source, index, entries, spans, dest, verify, how, proven, mapped,
                                      marks)
        with _direct(fd, weights) if how == "direct" else contextlib.nullcontext() as dfd:
            if marks is not None and dfd is not None:
                marks.append(("direct", time.perf_counter()))  # its runs by O_DIRECT (the probes count these)
            # this rank's slices, in file bytes (the plan's: summing the entries again took ~0.1 ms after the last
            # chunk)
            return _read_parallel(pool, fd, source, index, entries, spans, dest, verify, how, proven, None, marks,
                                  part, readers, dfd)
    except (AdapterChangedError, NonFiniteWeightsError):  # already name the file and the fix
        raise
    except (AdapterFormatError, OSError, KeyError, ValueError, TypeError, RuntimeError) as e:
        why = str(e) if isinstance(e, AdapterFormatError) else f"{type(e).__name__}: {e}"
        raise AdapterFormatError(f"{weights}: reading the {shard} shard failed ({why}); "
                                 "the file may be truncated or corrupt: re-copy it and register again") from e
    finally:
        os.close(fd)


class _Chunk(NamedTuple):
    """A chunk's share of a split read, as planned once per (header, layout, chunking, dtype, threads)."""

    tasks: tuple[Task, ...]
    blocks: tuple[int, ...]  # every block its slices touch
    nbytes: int
    runs: tuple[Run, ...] = ()  # its contiguous slices read straight into the buffer, by file offset
    covered: tuple[int, ...] = ()  # the blocks those runs hold whole: a check of one reads nothing more


_PLANS_KEPT = 64  # rank patterns x chunkings: a fleet's adapters share a few
# (ids of the index and entries, chunking, dtype, threads, direct, size) -> (index, entries, the plan) (``_plan``)
_PLANS: BoundedLRU[tuple[object, ...], tuple[object, object, list[_Chunk]]] = BoundedLRU(_PLANS_KEPT)


def _best_covered(runs: Sequence[Run], blocks: Sequence[int]) -> list[int]:
    """Those of ``blocks`` of which ``runs`` hold at least half as many bytes as of the block they hold most of
    (a sample check then reads the least of the file again), or ``blocks`` if the runs hold none."""
    held = dict.fromkeys(blocks, 0)
    for run in runs:
        for b in range(run.start // BLOCK_BYTES, (run.start + run.nbytes - 1) // BLOCK_BYTES + 1):
            if b in held:
                held[b] += min(run.start + run.nbytes, (b + 1) * BLOCK_BYTES) - max(run.start, b * BLOCK_BYTES)
    most = max(held.values(), default=0)
    return [b for b, n in held.items() if n * 2 >= most] if most else list(blocks)


def _covered(runs: Sequence[Run], size: int) -> tuple[int, ...]:
    """The blocks of a ``size``-byte file that ``runs`` (by file offset) hold whole."""
    blocks: list[int] = []
    lo = hi = -1  # the run of file bytes read so far, merged over adjacent runs
    for run in [*runs, Run(size + 1, 0, 0)]:
        if run.start != hi:  # a gap: the merged range ends; its whole blocks
            first = -(-lo // BLOCK_BYTES)
            blocks += [b for b in range(first, hi // BLOCK_BYTES + 1)
                       if lo >= 0 and b * BLOCK_BYTES >= lo and min((b + 1) * BLOCK_BYTES, size) <= hi]
            lo = run.start
        hi = run.start + run.nbytes
    return tuple(blocks)


def _plan(index: dict[str, FileTensor], entries: tuple[ShardEntry, ...], spans: Sequence[slice], dtype: torch.dtype,
          readers: int, direct: bool, size: int) -> list[_Chunk]:
    """The chunks' tasks and blocks, planned once: adapters of one rank pattern share their header's index
    (``proof.parse_index``) and their layout's entries (``shards``), so a cold read of any of them plans nothing.
    Keyed by identity, with the index and entries kept alive beside the plan (an id is never reused while
    its plan is kept)."""
    key = (id(index), id(entries), tuple((s.start, s.stop) for s in spans), dtype, readers, direct, size)
    kept = _PLANS.get(key)
    if kept is not None:
        return kept[2]
    plan = []
    for span in spans:
        part = entries[span]
        nbytes = sum(e.numel * index[e.key].dtype.itemsize for e in part)
        tasks = plan_tasks(index, part, dtype, task_bytes_for(nbytes, readers), direct)
        runs = tuple(sorted((r for t in tasks for r in t.runs), key=lambda r: r.start))
        plan.append(_Chunk(tuple(tasks), tuple(sorted({b for e in part for b in blocks_of(index[e.key], e)})), nbytes,
                           runs, _covered(runs, size)))
    _PLANS.put(key, (index, entries, plan), refresh=False)
    return plan


class _Part(NamedTuple):
    """One part's share of one chunk of a split read (``part`` (i, n): every n-th of its block checks and tasks)."""

    work: tuple[tuple[tuple[int, ...], Task | None], ...]  # (blocks to check, None) or ((), the task), in order
    settles: tuple[int, ...]  # the blocks this part checks (settled once checked)
    runs: tuple[Run, ...]  # the runs this part reads, by file offset (a split read's sample uses only these)
    covered: tuple[int, ...]  # the blocks those runs hold whole


# (id of the plan, part, threads, size) -> (the plan, its shares) (``_parts``): a few parts of each plan kept
_PARTS: BoundedLRU[tuple[object, ...], tuple[object, list[_Part]]] = BoundedLRU(_PLANS_KEPT * 4)


def _parts(plan: list[_Chunk], checks: list[list[int]], readers: int, part: tuple[int, int],
           size: int) -> list[_Part]:
    """Each chunk's share for ``part``; kept per (plan, part) when no chunk has block checks (verify sample or
    identity of a settled version: every read of the pattern then takes the same share, and building it again
    was most of a small shard's ``plan`` phase; bench/RESULTS.md, issue 30 item 1, fourth round)."""
    key = (id(plan), part, readers, size)
    static = not any(checks)
    if static:
        kept = _PARTS.peek(key)
        if kept is not None and kept[0] is plan:
            return kept[1]
    mine, parts = part
    out = []
    for c, blocks in zip(plan, checks, strict=True):
        per = max(1, task_bytes_for(c.nbytes, readers) // BLOCK_BYTES)
        batches = [tuple(blocks[i : i + per]) for i in range(0, len(blocks), per)]
        work = tuple([*((b, None) for b in batches), *(((), t) for t in c.tasks)][mine::parts])
        runs = c.runs if parts == 1 else tuple(sorted((r for _, t in work if t is not None for r in t.runs),
                                                      key=lambda r: r.start))
        out.append(_Part(work, tuple(b for bs, t in work if t is None for b in bs), runs,
                         c.covered if parts == 1 else _covered(runs, size)))
    if static:
        _PARTS.put(key, (plan, out), refresh=False)
    return out


def _read_parallel(pool: ReadPool | None, fd: int, source: WeightsSource, index: dict[str, FileTensor],
                   entries: tuple[ShardEntry, ...], spans: Sequence[slice], dest: torch.Tensor, verify: str, how: str,
                   proven: Callable[[int], None], mapped: mmap.mmap | None = None,
                   marks: list[tuple[str, float]] | None = None, part: tuple[int, int] = (0, 1),
                   readers: int = 0, direct: int | None = None) -> int:
    """Every chunk's slices and block checks as tasks on ``pool`` (None: run here, one after another), the checks
    first in each chunk; ``proven(k)`` once chunk k and those before it are done, in order. ``part`` (i, n): only
    every n-th task of each chunk from the i-th (``read_slices``). ``direct``: the file's ``O_DIRECT`` fd, the runs
    read by it (``_direct``). Returns the file bytes of the slices (all parts' together: what the rank reads)."""
    raw = memoryview(dest.view(torch.uint8).numpy())  # type: ignore[arg-type]  # dest's bytes, for preadv
    mine, parts = part
    readers = readers or (pool.size if pool is not None else 1)
    plan = _plan(index, entries, spans, dest.dtype, readers, how != "mmap", source.identity.size)
    checked_at = time.time_ns()  # before any check: the bytes seen are at least this recent
    shares = _parts(plan, [chunk_checks(source, c.blocks, verify) for c in plan], readers, part, source.identity.size)
    chunks: list[Sequence[Callable[[], object]]] = []
    for share in shares:
        tasks: list[Callable[[], bool | None]] = [
            functools.partial(_check_task, fd, source, list(b)) if t is None
            else functools.partial(_run_task, fd, raw, dest, index, t, source, how, mapped, direct)
            for b, t in share.work]
        chunks.append(tasks if marks is None else [_timed(t, marks) for t in tasks])
    if marks is not None:
        marks.append(("planned", time.perf_counter()))

    sample = verify == "sample" and not source.racy  # racy: every block not yet settled, checked by tasks

    def done(k: int) -> None:
        share = shares[k]
        if sample and plan[k].blocks and k % parts == mine:  # one part checks each chunk, from its own runs
            _sample(fd, raw, source, plan[k].blocks, share.covered, share.runs)
        settle_blocks(source, list(share.settles), checked_at)
        proven(k)

    if pool is not None:
        run_in_order(pool, chunks, done, loops=-(-readers // parts))
    else:
        for k, chunk in enumerate(chunks):
            for task in chunk:
                task()
            done(k)
    return sum(c.nbytes for c in plan)


def _sample(fd: int, raw: memoryview, source: WeightsSource, blocks: Sequence[int], covered: Sequence[int],
            runs: Sequence[Run]) -> None:
    """``verify`` sample's check of one chunk, in place: one of its blocks at random, one that ``runs`` (what was
    read into ``raw``) hold whole where there is one (``covered``: its CRC taken from the buffer, the bytes the
    GPU will get, no read), else one of ``blocks`` (its CRC from the bytes read and the rest of the block read
    from the file) (``positioned.block_crc``)."""
    block = random.choice(covered or _best_covered(runs, blocks))
    try:
        crc = block_crc(fd, raw, runs, block, BLOCK_BYTES, source.identity.size)
    except FileShrank as e:
        raise AdapterChangedError(f"{source.path} shrank while it was read (it ended before byte {e.offset}) since "
                                  f"it was registered as version {source.version}; the read is refused") from e
    if crc != source.block_crcs[block]:
        raise changed_block(source, block)


def _timed(task: Callable[[], bool | None], marks: list[tuple[str, float]]) -> Callable[[], None]:
    """``task`` (a partial of ``_check_task`` or ``_run_task``), noting its thread time in ``marks`` as
    ("busy read" or "busy crc", seconds), and ("direct refused", when) where the device refused its ``O_DIRECT``
    runs (``positioned.read_task``): the read then did not go the way it was sent, and is not timed as that way."""
    what = "busy crc" if getattr(task, "func", None) is _check_task else "busy read"

    def run() -> None:
        t0 = time.perf_counter()
        try:
            if task():
                marks.append(("direct refused", time.perf_counter()))
        finally:
            marks.append((what, time.perf_counter() - t0))

    return run


def _run_task(fd: int, raw: memoryview, dest: torch.Tensor, index: dict[str, FileTensor], task: Task,
              source: WeightsSource, how: str, mapped: mmap.mmap | None, direct: int | None = None) -> bool:
    """One reader thread's share of a chunk (``workers.reads.positioned``); ``mapped`` (``how`` mmap): its pieces copied
    from the mapped file instead; ``direct``: its runs by ``O_DIRECT`` reads of that fd. True where the device
    refused those (``positioned.read_task``)."""
    try:
        if mapped is not None:
            _copy_slices(mapped, index, task.converts, dest)
        return read_task(fd, raw, dest, index, task._replace(converts=()) if mapped is not None else task,
                         how == "rows", direct)
    except FileShrank as e:
        raise AdapterChangedError(f"{source.path} shrank while it was read (it ended before byte {e.offset} of "
                                  f"{source.identity.size}) since it was registered as version {source.version}; "
                                  "the read is refused: register it again") from e


def _check_task(fd: int, source: WeightsSource, blocks: list[int]) -> None:
    """Some of a chunk's blocks, read by ``preadv`` and CRC-checked (no page mapped)."""
    try:
        bad = bad_block(fd, source.block_crcs, source.identity.size, blocks, BLOCK_BYTES)
    except FileShrank as e:
        raise AdapterChangedError(f"{source.path} shrank while it was read (it ended before byte {e.offset}) since "
                                  f"it was registered as version {source.version}; the read is refused") from e
    if bad is not None:
        raise changed_block(source, bad)




_NO_DIRECT: set[int] = set()  # file systems (st_dev) that refused O_DIRECT: told once each


@contextlib.contextmanager
def _direct(fd: int, weights: Path):  # type: ignore[no-untyped-def]
    """``how="direct"``: the proven file ``fd`` opened again with ``O_DIRECT`` (through ``/proc/self/fd``: the same
    open file's inode, whatever the path names now, so every proof of ``fd`` holds for it), or None (the read's
    runs then go by ``preadv``) where the file system refuses it (tmpfs) or the platform has no ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    dfd = None
    if flag:
        try:
            dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | os.O_CLOEXEC)
        except OSError as e:
            dev = os.fstat(fd).st_dev
            if dev not in _NO_DIRECT:
                _NO_DIRECT.add(dev)
                log.info("%s: O_DIRECT refused (%s); reads of that file system go through the page cache", weights, e)
    try:
        yield dfd
    finally:
        if dfd is not None:
            os.close(dfd)


@contextlib.contextmanager
def _mapped(fd: int):  # type: ignore[no-untyped-def]
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private: nothing is written back
    try:
        yield mapped
    finally:
        with contextlib.suppress(BufferError):  # a view still alive in a traceback: unmapped when it dies
            mapped.close()


def _copy_slices(mapped: mmap.mmap, index: dict[str, FileTensor], entries: tuple[ShardEntry, ...],
                 dest: torch.Tensor) -> int:
    if not entries:
        return 0
    file = torch.frombuffer(mapped, dtype=torch.uint8)
    sources, targets, read = [], [], 0
    for e in entries:
        t = index[e.key]
        numel = math.prod(t.shape)
        if t.start % t.dtype.itemsize:  # not aligned to its element: a view of its own
            whole = torch.frombuffer(mapped, dtype=t.dtype, count=numel, offset=t.start)
        else:
            whole = file[t.start : t.start + numel * t.dtype.itemsize].view(t.dtype)
        sources.append(whole.view(t.shape)[e.rows, e.cols])
        targets.append(dest[e.offset : e.offset + e.numel].view(e.shape))
        read += e.numel * t.dtype.itemsize
    torch._foreach_copy_(targets, sources)  # one call, the GIL released for every copy
    return read


def is_cold(spec: AdapterSpec) -> bool:
    """Whether ``spec``'s weights file is out of the page cache: its middle page is not there (one non-blocking
    one-byte read, ``RWF_NOWAIT``: ~10 us). False where it cannot tell (no such flag or file system support, the file
    gone: the read itself says what is wrong)."""
    path = spec.source.path if spec.source is not None else None
    if path is None or not hasattr(os, "RWF_NOWAIT"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.preadv(fd, [bytearray(1)], (os.fstat(fd).st_size // 2) & ~4095, os.RWF_NOWAIT)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    except OSError as e:
        log.debug("could not tell whether %s is in the page cache: %s", path, e)
        return False


def ask_ahead(spec: AdapterSpec) -> None:
    """``read_ahead``: a weights file out of the page cache (``is_cold``) asked for whole at once
    (``POSIX_FADV_WILLNEED``), so the kernel queues every page's read now, as deep as the device takes them, and the
    readers' positioned reads find their pages arriving instead of each waiting on its own readahead window. Run off
    the read's own threads: the call returns once the reads are queued, which on a deep file can take most of the
    read's time. A failure is logged, never the read's."""
    _advise(spec, os.POSIX_FADV_WILLNEED, "ask ahead for")


def drop_pages(spec: AdapterSpec) -> None:
    """``drop_page_cache``: the pages of ``spec``'s weights file leave the page cache (``POSIX_FADV_DONTNEED``,
    after its read is served, on the host tier's one drop thread), so its next read comes from the device. The page
    cache is the file's, not the fd's: readers in other processes need not do it themselves. A file system that
    keeps no page cache (tmpfs) ignores it; a failure is logged, never the read's."""
    _advise(spec, os.POSIX_FADV_DONTNEED, "drop the pages of")


def _advise(spec: AdapterSpec, advice: int, what: str) -> None:
    """``posix_fadvise`` on the whole of ``spec``'s weights file; a failure logged as could not ``what`` it."""
    path = spec.source.path if spec.source is not None else None
    if path is None or not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)
    except FileNotFoundError:  # gone since its read (a node disk copy let go): its pages went with it
        return
    except OSError as e:
        log.warning("could not %s %s: %s", what, path, e)
