"""Reads in child processes, into a host arena they share with the worker (lifecycle step 5).

A worker's engine launches a step's kernels from Python on one thread; a reader thread in the same
process takes the GIL to build its views of the file (5-8 ms per Llama-3.1-8B shard on the H200's host),
and every launch then waits for the GIL behind it: a launch-bound step ran 2.0x slower beside three
such reads in flight and 17x beside three readers doing nothing but build views (``python -m
bench.probes.reader``, bench/RESULTS.md). A reader process shares no GIL with the engine. The arena is
one ``memfd`` mapped by the worker and by every reader process (pinned in the worker with
``cudaHostRegister``), so a read lands where the host-to-GPU copy reads it: no second copy. Each process
splits its read over ``PARALLEL`` threads of its own (``workers.reads.threads``; 1: it reads alone).

Protocol, one job at a time per process over a socket: the worker sends the registered weights file
(``WeightsSource``: path, version, identity, CRCs), how much to verify, a name for the shard, where in the
arena it goes and the chunks (ranges of the entries) to read one after another (pickled once for every part of a
split read), the layout's entries (once per process for each rank pattern, then by id: adapters of one pattern
share them) and its part; it gets
back ``("chunk", k)`` each time the first ``k`` chunks are in the arena and proven (their copies to the
GPU may start), then ``("ok", bytes, marks)`` or ``("error", kind, message)``, ``kind`` one of ``ERRORS`` (a
changed file stays an ``AdapterChangedError`` across the process boundary; a file cut short mid-read is one,
since no read maps the file). The last chunk has no ``("chunk", n)`` of its own: its ``("ok", ...)`` says that
all ``n`` are in place and proven (one message, and one wake-up of the worker, fewer per process and read: a small
shard's fixed cost, bench/RESULTS.md, issue 30 item 1, fourth round). A process that dies mid-read fails only
that read, with an error naming the file; the next read starts a new process.

    python -m workers.reads.processes CONN_FD ARENA_FD ARENA_BYTES PARALLEL     (started by ReaderProcess only)
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.peft import AdapterSpec
from lora_cache.adapters.shards import ShardEntry, ShardLayout
from lora_cache.errors import AdapterChangedError, AdapterFormatError
from workers.reads.shard import read_slices
from workers.reads.threads import ReadPool

STARTUP_TIMEOUT_S = 120.0  # importing torch on a loaded machine
ROOT = Path(__file__).resolve().parent.parent  # the directory that holds the workers package
ERRORS: dict[str, type[AdapterFormatError]] = {e.__name__: e for e in (AdapterFormatError, AdapterChangedError)}


class ReaderProcess:
    """One child process that reads shards into the shared arena; used by one thread at a time."""

    def __init__(self, arena_fd: int, arena_bytes: int, parallel: int = 1) -> None:
        self.arena_fd, self.arena_bytes, self.parallel = arena_fd, arena_bytes, parallel
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._sent: dict[int, tuple[ShardEntry, ...]] = {}  # entries this process holds, by id (kept: ids stay unique)
        self.restarts = 0  # processes started after the first
        self._start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "workers.reads.processes", str(theirs.fileno()), str(self.arena_fd),
             str(self.arena_bytes), str(self.parallel)],
            pass_fds=(theirs.fileno(), self.arena_fd), env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._ready, self._sent = False, {}

    def warm(self) -> bool:
        """Whether the process is up and has said so (a ``begin`` now sends at once, never waiting for it)."""
        if self._proc is None or self._conn is None or self._proc.poll() is not None:
            return False
        try:
            if not self._ready and self._conn.poll(0):
                self._conn.recv()
                self._ready = True
        except (EOFError, OSError):
            return False
        return self._ready

    @property
    def conn(self) -> Connection | None:
        """Its end of the socket (``multiprocessing.connection.wait`` on several processes' reads)."""
        return self._conn

    @staticmethod
    def job(spec: AdapterSpec, layout: ShardLayout, offset: int, verify: str = "sample",
            chunks: Sequence[slice] | None = None, readers: int = 0, how: str = "preadv") -> bytes:
        """What every part of a read is sent, pickled once for all of them (``begin``'s ``job``); ``how``: as
        ``reader.read_slices``' ("direct": decided once for the read by its host tier, the same for every part)."""
        return pickle.dumps((spec.source, verify, id(layout.entries), f"TP {layout.rank}/{layout.tp}",
                             str(layout.dtype).removeprefix("torch."), layout.numel, offset,
                             [(c.start, c.stop) for c in chunks or ()], readers, how), pickle.HIGHEST_PROTOCOL)

    def begin(self, spec: AdapterSpec, layout: ShardLayout, offset: int, verify: str = "sample",
              chunks: Sequence[slice] | None = None, part: tuple[int, int] = (0, 1), readers: int = 0,
              job: bytes | None = None, how: str = "preadv") -> None:
        """Send the process a read (``read``'s arguments; ``part``, ``readers``: as ``reader.read_slices``'s),
        starting a new process if this one died; its replies come from ``reply``. ``job``: ``job(...)`` of these
        arguments, pickled once by a read split over several processes (their sends follow one another, and each
        part starts only once it has its job)."""
        if spec.source is None:
            raise AdapterFormatError(f"adapter {spec.name}@{spec.version} was not registered from a file; "
                                     "register it from its directory to read it")
        if self._proc is None or self._proc.poll() is not None:
            self.restarts += 1
            self._start()
        assert self._conn is not None
        try:
            if not self._ready:
                if not self._conn.poll(STARTUP_TIMEOUT_S):
                    raise TimeoutError(f"no word from reader process {self.pid} in {STARTUP_TIMEOUT_S:.0f} s")
                self._conn.recv()
                self._ready = True
            key = id(layout.entries)
            if job is None:
                job = self.job(spec, layout, offset, verify, chunks, readers, how)
            self._conn.send((job, None if key in self._sent else layout.entries, part))
            self._sent[key] = layout.entries
        except (EOFError, OSError, TimeoutError) as e:
            raise self._died(spec, layout, e) from e

    def reply(self, spec: AdapterSpec, layout: ShardLayout) -> tuple[Any, ...]:
        """The process's next reply to the read ``begin`` sent: ("chunk", k), or its end ("ok", ...) or ("error",
        ...) (``finish`` reads it); ``AdapterFormatError`` if the process died."""
        assert self._conn is not None
        try:
            return tuple(self._conn.recv())
        except (EOFError, OSError) as e:
            raise self._died(spec, layout, e) from e

    @staticmethod
    def finish(reply: tuple[Any, ...], marks: list[tuple[str, float]] | None = None) -> int:
        """The bytes a read's last reply says it read, or its error raised (an ``AdapterChangedError`` stays one)."""
        status, *value = reply
        if status != "ok":
            kind, message = value
            raise ERRORS[kind](message)
        if marks is not None:
            marks += value[1]
            marks.append(("reply", time.perf_counter()))
        return int(value[0])

    def _died(self, spec: AdapterSpec, layout: ShardLayout, e: BaseException) -> AdapterFormatError:
        code = self._stop()
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return AdapterFormatError(
            f"{spec.weights}: the reader process died reading the TP {layout.rank}/{layout.tp} shard ({how}; "
            f"{type(e).__name__}); a file cut short while it is read does this: re-copy it and register again")

    def read(self, spec: AdapterSpec, layout: ShardLayout, offset: int, verify: str = "sample",
             chunks: Sequence[slice] | None = None, on_chunk: Callable[[int], None] | None = None,
             marks: list[tuple[str, float]] | None = None) -> int:
        """Read ``spec``'s shard of ``layout`` into the arena at byte ``offset``; returns bytes read.
        ``chunks`` / ``on_chunk``: as ``reader.read_shard``'s (called here, as the process reports them).
        ``marks``: gets (phase, ``time.perf_counter``) of the read's steps, this process's and the reader's
        (one clock: CLOCK_MONOTONIC), for the probes' phase breakdown."""
        self.begin(spec, layout, offset, verify, chunks)
        while (reply := self.reply(spec, layout))[0] == "chunk":
            if marks is not None:
                marks.append((f"got {reply[1] - 1}", time.perf_counter()))
            if on_chunk is not None:
                on_chunk(int(reply[1]))
        if reply[0] == "ok":  # the end says the last chunk is in place too (it has no reply of its own)
            total = len(chunks or ()) or 1
            if marks is not None:
                marks.append((f"got {total - 1}", time.perf_counter()))
            if on_chunk is not None:
                on_chunk(total)
        return self.finish(reply, marks)

    def _stop(self) -> int | None:
        """End the process (it exits when its socket closes); its exit code, None if it had to be killed."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None

    def close(self) -> None:
        self._stop()


def read_split(procs: Sequence[ReaderProcess], spec: AdapterSpec, layout: ShardLayout, offset: int,
               verify: str = "sample", chunks: Sequence[slice] | None = None,
               on_chunk: Callable[[int], None] | None = None, marks: list[tuple[str, float]] | None = None,
               readers: int = 0, how: str = "preadv") -> int:
    """One read split over several reader processes (as ``ReaderProcess.read``): process i of n reads part i of
    every chunk (``reader.read_slices``' ``part``) into the same arena block, each proving the version for its
    part (the file's identity after each chunk, its share of the block checks; one of them each chunk's sample),
    so no GIL is shared by the threads of different parts. Chunk k is published once every part has it. The
    first error (a changed file stays an ``AdapterChangedError``) is raised once every process has ended its
    part (none writes into the block after the read gave it back); no chunk is published after it."""
    read = SplitRead(procs, spec, layout, offset, verify, chunks, readers, how)
    read.begin()
    return read.collect(on_chunk, marks)


class SplitRead:
    """``read_split`` in two steps: ``begin`` sends every process its part (from any thread: it never waits for
    a reply), ``collect`` takes the replies until every part has ended (the tier's read thread). The host tier
    begins a read in the thread that fetched it, so the readers have the job before a pool thread wakes
    (``workers.staging.host_tier``: a small shard's fixed cost, bench/RESULTS.md, issue 30 item 1, fourth round)."""

    def __init__(self, procs: Sequence[ReaderProcess], spec: AdapterSpec, layout: ShardLayout, offset: int,
                 verify: str = "sample", chunks: Sequence[slice] | None = None, readers: int = 0,
                 how: str = "preadv") -> None:
        self.procs, self.spec, self.layout, self.offset = procs, spec, layout, offset
        self.verify, self.chunks, self.readers, self.how = verify, chunks, readers, how
        self.error: BaseException | None = None  # the first error, raised by ``collect``
        self.live: dict[Any, ReaderProcess] = {}  # the processes that have a part and have not ended it

    def begin(self) -> None:
        """Send each process its part; a process that cannot take it fails the read (in ``collect``)."""
        n = len(self.procs)
        job = None
        for i, proc in enumerate(self.procs):
            try:
                if job is None and self.spec.source is not None:
                    job = ReaderProcess.job(self.spec, self.layout, self.offset, self.verify, self.chunks, self.readers,
                                            self.how)
                proc.begin(self.spec, self.layout, self.offset, self.verify, self.chunks, (i, n), self.readers, job)
            except Exception as e:  # e.g. it died (AdapterFormatError): the parts sent end before it is raised
                self.error = e
                break
            self.live[proc.conn] = proc

    def collect(self, on_chunk: Callable[[int], None] | None = None,
                marks: list[tuple[str, float]] | None = None) -> int:
        """Publish chunk k (``on_chunk(k + 1)``) once every part has it; the bytes read, or the first error."""
        spec, layout, live = self.spec, self.layout, self.live
        n, total = len(self.procs), len(self.chunks or ()) or 1
        have = {id(p): 0 for p in live.values()}  # chunks each part has in place
        published, read = 0, 0
        while live:
            for conn in wait(list(live)):
                proc = live[conn]
                try:
                    reply = proc.reply(spec, layout)
                except AdapterFormatError as e:
                    self.error = self.error or e
                    del live[conn]
                    continue
                if reply[0] in ("chunk", "ok"):  # "ok": its part of every chunk is in place (no last "chunk")
                    have[id(proc)] = int(reply[1]) if reply[0] == "chunk" else total
                    low = min(have.values())
                    if low > published and self.error is None and len(have) == n:
                        published = low
                        if marks is not None:
                            marks.append((f"got {low - 1}", time.perf_counter()))
                        try:
                            if on_chunk is not None:
                                on_chunk(low)
                        except AdapterFormatError as e:  # refused here (non-finite weights): the parts still
                            self.error = e  # write into the block, so their replies are drained before it raises
                    if reply[0] == "chunk":
                        continue
                del live[conn]
                try:
                    read = max(read, ReaderProcess.finish(reply, marks))
                except AdapterFormatError as e:
                    self.error = self.error or e
        if self.error is not None:
            raise self.error
        return read


def _serve(conn: Connection, arena: torch.Tensor, pool: ReadPool | None) -> None:
    torch.set_num_threads(1)
    held: dict[int, tuple[ShardEntry, ...]] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job, entries, part = conn.recv()
        except (EOFError, ConnectionResetError):
            return
        source, verify, key, shard, dtype, numel, offset, spans, readers, how = pickle.loads(job)
        marks: list[tuple[str, float]] = [("received", time.perf_counter())]  # the job in hand, as before
        if entries is not None:
            held[key] = entries
        try:
            width = getattr(torch, dtype).itemsize
            dest = arena[offset : offset + numel * width].view(getattr(torch, dtype))
            chunks = [slice(a, b) for a, b in spans] or None
            last = len(spans) or 1  # told by the "ok" below, not a "chunk" of its own

            def report(k: int, last: int = last) -> None:
                if k < last:
                    conn.send(("chunk", k))

            read = read_slices(source, held[key], dest, shard, verify, chunks, report, pool, how, marks=marks,
                               part=tuple(part), readers=readers)
            marks.append(("done", time.perf_counter()))
            conn.send(("ok", read, marks))
        except AdapterFormatError as e:
            conn.send(("error", type(e).__name__ if type(e).__name__ in ERRORS else "AdapterFormatError", str(e)))
        except Exception as e:
            conn.send(("error", "AdapterFormatError",
                       f"{source.path}: reading the {shard} shard failed ({type(e).__name__}: {e})"))


def main(argv: list[str]) -> None:
    conn_fd, arena_fd, arena_bytes, parallel = (int(a) for a in argv)
    # MAP_SHARED: the worker sees every byte written. MAP_POPULATE maps every page now: a process's first
    # write to a page of its own mapping faults, which on the H200 host made each read ~10 ms slower
    # (a shard is ~20k pages) until every block of the arena had been written once by every process.
    mapped = mmap.mmap(arena_fd, arena_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    arena = torch.frombuffer(mapped, dtype=torch.uint8)
    pool = ReadPool(parallel, "lora-reader-part") if parallel > 1 else None  # splits each read (workers.reads.threads)
    with Connection(conn_fd) as conn:
        _serve(conn, arena, pool)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the worker; it closes the socket
    main(sys.argv[1:])
