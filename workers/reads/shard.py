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

An identity version (``lora_cache.adapters.files.identity_version``) has no block CRCs until its first read on
this machine pins them (``_pin_first``, once per machine: later reads, in any process, take the pin).

A read returns only the bytes its version was registered with (``lora_cache.adapters.files``), or refuses with
``AdapterChangedError``: the file is stat'ed and compared with the registered identity before it is
opened (a FIFO or device swapped in is never opened), read through one fd that is ``fstat``'ed against it
(a rename-over between the two is caught), its header's CRC is compared, the blocks it read are CRC-checked
as ``verify`` says, and the fd is ``fstat``'ed again after the copy (a write during the read is caught).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import mmap
import os
import random
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from lora_cache.adapters.files import (
    BLOCK_BYTES,
    BlockCrcs,
    FileIdentity,
    WeightsSource,
    content_crcs,
    file_kind,
    load_pin,
    publish_pin,
    same_file,
)
from lora_cache.adapters.peft import FLOAT_DTYPES, AdapterSpec, parse_tensors
from lora_cache.adapters.shards import ShardEntry, ShardLayout
from lora_cache.errors import AdapterChangedError, AdapterFormatError
from lora_cache.vocab import AdapterKey
from workers import faults
from workers.reads.plan import FileTensor, Run, Task, plan_tasks, task_bytes_for
from workers.reads.positioned import FileShrank, bad_block, block_crc, crc32, read_task
from workers.reads.threads import ReadPool, run_in_order

# How much of what a read copied it checks against the version's CRCs (hashed at registration, or, for an
# identity version, pinned on this machine by its first read: ``_pin_first``), on top of the identity and
# header checks every read makes (bench/RESULTS.md, "What the content check costs"). A racy version (changed
# within RACY_NS of its registration) is checked in full whatever the mode, until a check after its window.
VERIFY = {
    "identity": "identity and header only: catches any change a file system records in stat",
    "sample": "plus one of the blocks read, at random: catches an overwrite by other content even where "
              "stat does not show it (a coarse or lying file system) for one 1 MiB CRC (under 0.5 ms)",
    "content": "plus every block read: no change of the bytes read goes unseen; costs a CRC of the shard",
}


def read_shard(spec: AdapterSpec, layout: ShardLayout, dest: torch.Tensor, verify: str = "sample",
               chunks: Sequence[slice] | None = None, on_chunk: Callable[[int], None] | None = None,
               pool: ReadPool | None = None, marks: list[tuple[str, float]] | None = None) -> int:
    """Fill ``dest`` (1-D, ``layout.dtype``, >= ``layout.numel``) with the shard; returns bytes read.
    Fault point ``mid_read`` (``workers.faults``): the file is open and checked, nothing read yet.

    A rank reads only its parts of each matrix; a file tensor of another dtype is converted as it is copied.
    ``chunks``: ranges of the layout's entries read one after another (default: one); ``on_chunk(k)`` runs
    once the first ``k`` are in ``dest``, so their host-to-GPU copies can start while the rest is read
    (``lora_cache.adapters.chunks``). ``pool``: reader threads that split the read (``workers.reads.threads``);
    None: this thread alone. ``marks``: as ``read_slices``'s.
    """
    if spec.source is None:
        raise AdapterFormatError(f"adapter {spec.name}@{spec.version} was not registered from a file; "
                                 "register it from its directory to read it")
    key = AdapterKey(spec.name, spec.version)
    return read_slices(spec.source, layout.entries, dest, f"TP {layout.rank}/{layout.tp}", verify, chunks, on_chunk,
                       pool, opened=lambda: faults.hit("mid_read", key), marks=marks)


HOW = {  # how a split read moves its bytes (bench/RESULTS.md, issue 30: "preadv" was the fastest measured)
    "preadv": "positioned reads straight into the buffer; a column slice by one read over its span (the default)",
    "rows": "positioned reads; a column slice row by row (fewer bytes, a call per row)",
    "mmap": "mapped-file copies, split over the threads (probes only: a file cut short under the map raises SIGBUS)",
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
    fd, source = _open_unchanged(source)
    spans = chunks or (slice(0, len(entries)),)

    def proven(k: int) -> None:  # chunk k is in place and its blocks checked: the file must be the one opened
        same_file(weights, source.identity, FileIdentity.of(os.fstat(fd)), "while it was read, after", source.version)
        if marks is not None:
            marks.append((f"proven {k}", time.perf_counter()))
        if on_chunk is not None:
            on_chunk(k + 1)

    try:
        index = _checked_index(fd, source)
        if marks is not None:
            marks.append(("opened", time.perf_counter()))
        if opened is not None:
            opened()
        if how == "mmap":
            with _mapped(fd) as mapped:
                return _read_parallel(pool, fd, source, index, entries, spans, dest, verify, how, proven, mapped,
                                      marks)
        # this rank's slices, in file bytes (the plan's: summing the entries again took ~0.1 ms after the last chunk)
        return _read_parallel(pool, fd, source, index, entries, spans, dest, verify, how, proven, None, marks, part,
                              readers)
    except AdapterChangedError:
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


_PLANS_LOCK = threading.Lock()  # protects _PLANS
_PLANS: collections.OrderedDict[tuple[object, ...], tuple[object, object, list[_Chunk]]] = collections.OrderedDict()
_PLANS_KEPT = 64  # rank patterns x chunkings: a fleet's adapters share a few


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
    (``_parse_index``) and their layout's entries (``shards``), so a cold read of any of them plans nothing.
    Keyed by identity, with the index and entries kept alive beside the plan (an id is never reused while
    its plan is kept)."""
    key = (id(index), id(entries), tuple((s.start, s.stop) for s in spans), dtype, readers, direct, size)
    with _PLANS_LOCK:
        kept = _PLANS.get(key)
        if kept is not None:
            _PLANS.move_to_end(key)
            return kept[2]
    plan = []
    for span in spans:
        part = entries[span]
        nbytes = sum(e.numel * index[e.key].dtype.itemsize for e in part)
        tasks = plan_tasks(index, part, dtype, task_bytes_for(nbytes, readers), direct)
        runs = tuple(sorted((r for t in tasks for r in t.runs), key=lambda r: r.start))
        plan.append(_Chunk(tuple(tasks), tuple(sorted({b for e in part for b in _span(index[e.key], e)})), nbytes,
                           runs, _covered(runs, size)))
    with _PLANS_LOCK:
        _PLANS[key] = (index, entries, plan)
        while len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


def _chunk_checks(source: WeightsSource, blocks: tuple[int, ...], verify: str) -> list[int]:
    """The blocks of a chunk (``blocks``: all it touches) that a split read checks: as ``_blocks_to_check``."""
    if verify not in VERIFY:
        raise AdapterFormatError(f"verify {verify!r} is not one of {', '.join(VERIFY)}")
    if source.racy and verify != "content":
        with _SETTLED_LOCK:
            done = _SETTLED.get((source.path, source.version, source.identity), set())
        return [b for b in blocks if b not in done]
    if verify != "content":  # identity; sample: checked once the chunk is in the buffer (``_sample``)
        return []
    return list(blocks)


class _Part(NamedTuple):
    """One part's share of one chunk of a split read (``part`` (i, n): every n-th of its block checks and tasks)."""

    work: tuple[tuple[tuple[int, ...], Task | None], ...]  # (blocks to check, None) or ((), the task), in order
    settles: tuple[int, ...]  # the blocks this part checks (settled once checked)
    runs: tuple[Run, ...]  # the runs this part reads, by file offset (a split read's sample uses only these)
    covered: tuple[int, ...]  # the blocks those runs hold whole


_PARTS_LOCK = threading.Lock()  # protects _PARTS
_PARTS: collections.OrderedDict[tuple[object, ...], tuple[object, list[_Part]]] = collections.OrderedDict()


def _parts(plan: list[_Chunk], checks: list[list[int]], readers: int, part: tuple[int, int],
           size: int) -> list[_Part]:
    """Each chunk's share for ``part``; kept per (plan, part) when no chunk has block checks (verify sample or
    identity of a settled version: every read of the pattern then takes the same share, and building it again
    was most of a small shard's ``plan`` phase; bench/RESULTS.md, issue 30 item 1, fourth round)."""
    key = (id(plan), part, readers, size)
    static = not any(checks)
    if static:
        with _PARTS_LOCK:
            kept = _PARTS.get(key)
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
        with _PARTS_LOCK:
            _PARTS[key] = (plan, out)
            while len(_PARTS) > _PLANS_KEPT * 4:  # a few parts of each plan kept
                _PARTS.popitem(last=False)
    return out


def _read_parallel(pool: ReadPool | None, fd: int, source: WeightsSource, index: dict[str, FileTensor],
                   entries: tuple[ShardEntry, ...], spans: Sequence[slice], dest: torch.Tensor, verify: str, how: str,
                   proven: Callable[[int], None], mapped: mmap.mmap | None = None,
                   marks: list[tuple[str, float]] | None = None, part: tuple[int, int] = (0, 1),
                   readers: int = 0) -> int:
    """Every chunk's slices and block checks as tasks on ``pool`` (None: run here, one after another), the checks
    first in each chunk; ``proven(k)`` once chunk k and those before it are done, in order. ``part`` (i, n): only
    every n-th task of each chunk from the i-th (``read_slices``). Returns the file bytes of the slices (all parts'
    together: what the rank reads)."""
    raw = memoryview(dest.view(torch.uint8).numpy())  # type: ignore[arg-type]  # dest's bytes, for preadv
    mine, parts = part
    readers = readers or (pool.size if pool is not None else 1)
    plan = _plan(index, entries, spans, dest.dtype, readers, how != "mmap", source.identity.size)
    checked_at = time.time_ns()  # before any check: the bytes seen are at least this recent
    shares = _parts(plan, [_chunk_checks(source, c.blocks, verify) for c in plan], readers, part, source.identity.size)
    chunks: list[list[Callable[[], None]]] = []
    for share in shares:
        tasks: list[Callable[[], None]] = [
            functools.partial(_check_task, fd, source, list(b)) if t is None
            else functools.partial(_run_task, fd, raw, dest, index, t, source, how, mapped) for b, t in share.work]
        chunks.append(tasks if marks is None else [_timed(t, marks) for t in tasks])
    if marks is not None:
        marks.append(("planned", time.perf_counter()))

    sample = verify == "sample" and not source.racy  # racy: every block not yet settled, checked by tasks

    def done(k: int) -> None:
        share = shares[k]
        if sample and plan[k].blocks and k % parts == mine:  # one part checks each chunk, from its own runs
            _sample(fd, raw, source, plan[k].blocks, share.covered, share.runs)
        _settle(source, list(share.settles), checked_at)
        proven(k)

    if pool is not None:
        run_in_order(pool, chunks, done, loops=-(-readers // parts))
    else:
        for k, tasks in enumerate(chunks):
            for task in tasks:
                task()
            done(k)
    return sum(c.nbytes for c in plan)


def _sample(fd: int, raw: memoryview, source: WeightsSource, blocks: Sequence[int], covered: Sequence[int],
            runs: Sequence[Run]) -> None:
    """``verify`` sample's check of one chunk, in place: one of its blocks at random, one that ``runs`` (what was
    read into ``raw``) hold whole where there is one (``covered``: its CRC taken from the buffer, the bytes the
    GPU will get, no read), else one of ``blocks`` (its CRC from the bytes read and the rest of the block read
    from the file) (``read_io.block_crc``)."""
    block = random.choice(covered or _best_covered(runs, blocks))
    try:
        crc = block_crc(fd, raw, runs, block, BLOCK_BYTES, source.identity.size)
    except FileShrank as e:
        raise AdapterChangedError(f"{source.path} shrank while it was read (it ended before byte {e.offset}) since "
                                  f"it was registered as version {source.version}; the read is refused") from e
    if crc != source.block_crcs[block]:
        raise _changed_block(source, block)


def _timed(task: Callable[[], None], marks: list[tuple[str, float]]) -> Callable[[], None]:
    """``task`` (a partial of ``_check_task`` or ``_run_task``), noting its thread time in ``marks`` as
    ("busy read" or "busy crc", seconds)."""
    what = "busy crc" if getattr(task, "func", None) is _check_task else "busy read"

    def run() -> None:
        t0 = time.perf_counter()
        try:
            task()
        finally:
            marks.append((what, time.perf_counter() - t0))

    return run


def _run_task(fd: int, raw: memoryview, dest: torch.Tensor, index: dict[str, FileTensor], task: Task,
              source: WeightsSource, how: str, mapped: mmap.mmap | None) -> None:
    """One reader thread's share of a chunk (``workers.reads.positioned``); ``mapped`` (``how`` mmap): its pieces copied
    from the mapped file instead."""
    try:
        if mapped is not None:
            _copy_slices(mapped, index, task.converts, dest)
        read_task(fd, raw, dest, index, task._replace(converts=()) if mapped is not None else task, how == "rows")
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
        raise _changed_block(source, bad)


_ACCEPTED_LOCK = threading.Lock()  # protects _ACCEPTED
_ACCEPTED: collections.OrderedDict[tuple[str, str], WeightsSource] = collections.OrderedDict()  # LRU, bounded
_ACCEPTED_VERSIONS = 1024


def _open_unchanged(registered: WeightsSource) -> tuple[int, WeightsSource]:
    """An fd of the registered file and the identity it is checked against from now on.

    The path is stat'ed before the open (a FIFO, a device or a file of another size put in its place is never
    opened) and the fd after it (so a file renamed over it in between is not read). A file of the registered
    size whose identity changed (copied back, touched, re-synced) is checked in full against the registered
    CRCs: the same bytes are accepted under their new identity, other bytes refused."""
    registered = _pinned(registered)
    weights, key = Path(registered.path), (registered.path, registered.version)
    with _ACCEPTED_LOCK:
        source = _ACCEPTED.get(key, registered)
    try:
        st = os.stat(weights)
        _regular(weights, st, registered.version)
        if source.identity.changes(now := FileIdentity.of(st)) and now.size != registered.identity.size:
            same_file(weights, source.identity, now, "since", source.version)
        fd = os.open(weights, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise AdapterChangedError(f"{weights} is gone ({e}); it was registered as version {registered.version}: "
                                  "register the adapter again") from e
    try:
        fst = os.fstat(fd)
        _regular(weights, fst, registered.version)
        now = FileIdentity.of(fst)
        if source.identity.changes(now):
            if now.size != registered.identity.size:
                same_file(weights, source.identity, now, "since", source.version)
            source = _revalidated(fd, registered, now)
        if not source.pinned:
            source = _pin_first(fd, source)
        return fd, source
    except BaseException:
        os.close(fd)
        raise


def _regular(weights: Path, st: os.stat_result, version: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise AdapterChangedError(f"{weights} is now a {file_kind(st.st_mode)}, not the regular file registered as "
                                  f"version {version}: refused without reading it; put the adapter file back and "
                                  "register it again")


def _revalidated(fd: int, registered: WeightsSource, now: FileIdentity) -> WeightsSource:
    """``registered`` under the file's new identity ``now``, if every block still has its registered CRC."""
    checked_at = time.time_ns()
    change = registered.identity.changes(now)
    if not registered.pinned:  # an identity version no read has pinned: nothing proves these bytes are its own
        raise AdapterChangedError(f"{registered.path} changed since it was registered as version "
                                  f"{registered.version}: {change}; that version was taken from the file's identity "
                                  "and no read pinned its content before the change, so nothing proves these bytes "
                                  "are its own: the read is refused; register it again for a new version "
                                  "(lora-cache register NAME PATH)")
    try:  # by preadv, no page mapped: a file cut short now is refused, never a SIGBUS
        bad = bad_block(fd, registered.block_crcs, now.size, range(len(registered.block_crcs)), BLOCK_BYTES)
    except FileShrank as e:
        raise AdapterChangedError(f"{registered.path} shrank while it was checked (it ended before byte {e.offset}) "
                                  f"since it was registered as version {registered.version}; the read is "
                                  "refused: register it again") from e
    if bad is not None or crc32(os.pread(fd, registered.header_bytes, 0)) != registered.header_crc:
        raise AdapterChangedError(f"{registered.path} changed since it was registered as version "
                                  f"{registered.version}: {change}, and its bytes are not the ones registered "
                                  f"(block {bad} of {BLOCK_BYTES} bytes differs); a read under that version would "
                                  "return other bytes, so it is refused: register it again for a new version "
                                  "(lora-cache register NAME PATH)")
    source = registered._replace(identity=now, registered_ns=checked_at)  # racy again if ``now`` is recent
    with _ACCEPTED_LOCK:
        _ACCEPTED[(registered.path, registered.version)] = source
        while len(_ACCEPTED) > _ACCEPTED_VERSIONS:
            _ACCEPTED.popitem(last=False)
    return source


_PINS_LOCK = threading.Lock()  # protects _PINS
_PINS: collections.OrderedDict[tuple[str, str], BlockCrcs] = collections.OrderedDict()  # this process's, LRU
_PINS_KEPT = 1024


def _pinned(registered: WeightsSource) -> WeightsSource:
    """``registered`` with its content's CRCs, if they are known: hashed at registration (a content version), or
    pinned on this machine by a read of its identity version (this process's, or another's through the pin
    directory); as it is if no read pinned it yet."""
    if registered.pinned:
        return registered
    key = (registered.path, registered.version)
    with _PINS_LOCK:
        crcs = _PINS.get(key)
    if crcs is None:
        crcs = load_pin(registered)
        if crcs is None:
            return registered
        _keep_pin(key, crcs)
    return registered._replace(block_crcs=crcs)


def _keep_pin(key: tuple[str, str], crcs: BlockCrcs) -> None:
    with _PINS_LOCK:
        _PINS[key] = crcs
        _PINS.move_to_end(key)
        while len(_PINS) > _PINS_KEPT:
            _PINS.popitem(last=False)


def _pin_first(fd: int, source: WeightsSource) -> WeightsSource:
    """The first read of an identity version on this machine pins its content: every block's CRC, taken through
    the open ``fd`` whose identity is the registered one before and after (so, stat being honest, the bytes the
    file held at registration), published for every process of this machine; if another read published first,
    its CRCs are the version's, and other bytes here are refused (never two contents under one version)."""
    weights = Path(source.path)
    crcs = content_crcs(fd, source.identity.size, weights)
    if zlib.crc32(os.pread(fd, source.header_bytes, 0)) != source.header_crc:
        raise AdapterChangedError(f"{weights} changed since it was registered as version {source.version}: its "
                                  "header is not the one registered; the read is refused: register it again")
    same_file(weights, source.identity, FileIdentity.of(os.fstat(fd)), "while its content was pinned, after",
              source.version)
    pinned = publish_pin(source, crcs)
    if pinned != crcs:
        bad = next(b for b in range(len(crcs)) if crcs[b] != pinned[b])
        raise AdapterChangedError(f"{weights} holds other bytes (block {bad} of {BLOCK_BYTES} bytes differs) than "
                                  f"another read pinned as the content of version {source.version} on this machine, "
                                  "though its stat did not change (a file system that does not show every write): "
                                  "the read is refused; register it again for a new version")
    _keep_pin((source.path, source.version), pinned)
    return source._replace(block_crcs=pinned)


def _checked_index(fd: int, source: WeightsSource) -> dict[str, FileTensor]:
    """Where every tensor is, from the header this fd holds now, if it is the one registered."""
    head = os.pread(fd, source.header_bytes, 0)
    if crc32(head) != source.header_crc:
        raise AdapterChangedError(f"{source.path} changed since it was registered as version {source.version}: its "
                                  "header is not the one registered (rewritten in place, same size and stat "
                                  "times); the read is refused: register it again for a new version")
    return _parse_index(head, source.identity.size)


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


# -- the content check ------------------------------------------------------------------------------------

_SETTLED_LOCK = threading.Lock()  # protects _SETTLED
_SETTLED: collections.OrderedDict[tuple[str, str, FileIdentity], set[int]] = collections.OrderedDict()  # racy blocks
_SETTLED_VERSIONS = 1024  # proven after their racy window: LRU-bounded


def _span(t: FileTensor, e: ShardEntry) -> range:
    """The blocks holding the bytes ``e`` reads of ``t`` (from its first byte read to its last)."""
    row = t.shape[-1] * t.dtype.itemsize
    first = t.start + e.rows.start * row + e.cols.start * t.dtype.itemsize
    end = t.start + (e.rows.stop - 1) * row + e.cols.stop * t.dtype.itemsize
    return range(first // BLOCK_BYTES, (end - 1) // BLOCK_BYTES + 1)


def _blocks_to_check(source: WeightsSource, index: dict[str, FileTensor], entries: tuple[ShardEntry, ...],
                     verify: str) -> list[int]:
    if verify not in VERIFY:
        raise AdapterFormatError(f"verify {verify!r} is not one of {', '.join(VERIFY)}")
    if source.racy and verify != "content":
        with _SETTLED_LOCK:
            done = _SETTLED.get((source.path, source.version, source.identity), set())
        return sorted({b for e in entries for b in _span(index[e.key], e)} - done)
    if verify == "identity" or not entries:
        return []
    if verify == "sample":
        e = random.choice(entries)
        return [random.choice(_span(index[e.key], e))]
    return sorted({b for e in entries for b in _span(index[e.key], e)})


def _bad_block(mapped: mmap.mmap, source: WeightsSource, blocks: Iterable[int]) -> int | None:
    """The first of ``blocks`` whose CRC is not the registered one, or None."""
    with memoryview(mapped) as view:
        return next((b for b in blocks
                     if crc32(view[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES]) != source.block_crcs[b]), None)


def _check_blocks(mapped: mmap.mmap, source: WeightsSource, blocks: list[int], settle: bool = True) -> None:
    """Refuse the read if one of ``blocks`` is not as registered; ``settle``: remember the blocks proven (the
    single reader's check, from the mapped file)."""
    checked_at = time.time_ns()  # before the check: the bytes seen are at least this recent
    bad = _bad_block(mapped, source, blocks)
    if bad is not None:
        raise _changed_block(source, bad)
    if settle:
        _settle(source, blocks, checked_at)


def _changed_block(source: WeightsSource, bad: int) -> AdapterChangedError:
    return AdapterChangedError(
        f"{source.path} changed since it was registered as version {source.version}: bytes "
        f"{bad * BLOCK_BYTES}-{(bad + 1) * BLOCK_BYTES} are not the ones registered (rewritten in place with "
        "the same size and stat times); the read is refused: register it again for a new version")


def _settle(source: WeightsSource, blocks: list[int], checked_at: int) -> None:
    """A racy version's ``blocks``, checked at ``checked_at``, stay proven if the racy window was over by then:
    later writes must show in stat."""
    if source.racy and blocks and source.settled(checked_at):
        with _SETTLED_LOCK:
            key = (source.path, source.version, source.identity)  # proofs hold for this identity only
            _SETTLED.setdefault(key, set()).update(blocks)
            _SETTLED.move_to_end(key)
            while len(_SETTLED) > _SETTLED_VERSIONS:
                _SETTLED.popitem(last=False)


# -- the header ------------------------------------------------------------------------------------------


def tensor_index(path: str, version: str, size: int) -> dict[str, FileTensor]:
    """key -> where its bytes are, from the safetensors header of ``path`` (of ``version``, ``size`` bytes)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise AdapterFormatError(f"its safetensors header length {n} does not fit the {size}-byte file")
        f.seek(0)
        return _parse_index(f.read(8 + n), size)


@functools.lru_cache(maxsize=512)  # ~50 KiB of header and its index per 8B adapter
def _parse_index(head: bytes, size: int) -> dict[str, FileTensor]:
    """key -> where its bytes are, from a safetensors header (its 8-byte length and its JSON), parsed once per
    header by registration's own parser (``peft.parse_tensors``: every tensor inside the ``size``-byte file)."""
    try:
        tensors = parse_tensors(head[8:], size)
    except (ValueError, KeyError, TypeError) as e:  # the file changed since registration
        raise AdapterFormatError(f"the safetensors header no longer parses ({e}); register the adapter again") from e
    index = {}
    for key, (dtype, shape, begin) in tensors.items():
        if dtype not in FLOAT_DTYPES:  # registration refuses these; the file changed since
            raise AdapterFormatError(f"tensor {key!r} is {dtype}, not one of {sorted(FLOAT_DTYPES)}")
        index[key] = FileTensor(getattr(torch, FLOAT_DTYPES[dtype]), shape, len(head) + begin)
    return index
