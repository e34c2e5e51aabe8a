"""How the host tier reads a miss (``HostTierConfig.reads``): on its own threads (``ThreadReads``), or in reader
processes that map the shared arena (``ProcessReads``: a GPU worker, no GIL shared with the engine beside it)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lora_cache.adapters.peft import AdapterSpec
from lora_cache.errors import ConfigError
from workers.reads.processes import ReaderProcess, SplitRead
from workers.reads.shard import read_shard
from workers.reads.threads import ReadPool
from workers.staging.arena import HostArena

if TYPE_CHECKING:
    from workers.staging.host_tier import HostEntry

class ThreadReads:
    """Reads in this process, on the tier's threads: where nothing launches GPU work beside them. A read is
    split over ``parallel`` threads of one pool that the tier's reads share (none for 1)."""

    def __init__(self, arena: HostArena, count: int, verify: str, parallel: int = 1) -> None:
        self.verify = verify
        self.pool = ReadPool(parallel) if parallel > 1 else None

    def begin(self, spec: AdapterSpec, entry: HostEntry) -> Callable[[], int] | None:
        """Nothing starts before a pool thread runs the read (``ProcessReads.begin``)."""
        return None

    def read(self, spec: AdapterSpec, entry: HostEntry) -> int:
        return read_shard(spec, entry.layout, entry.tensor, self.verify, entry.chunks, entry.progress, self.pool,
                          entry.marks, entry.how)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class ProcessReads:
    """Reads in ``count`` reader processes that map the (shared) arena: each tier thread takes the idle one used
    last, and up to ``split`` - 1 more if they are idle, which split the read (``processes.read_split``), each
    over ``parallel`` threads of its own. A stack, last used first: what a process keeps per rank pattern (its
    layout's entries, the header's index and the read's plan) is warm there; taken in turn, every process paid
    for those once per pattern, and the probe's one read at a time went to a cold process each time
    (bench/RESULTS.md, issue 30 item 1)."""

    def __init__(self, arena: HostArena, count: int, verify: str, parallel: int = 1, split: int = 1,
                 readers: int = 0) -> None:
        """``readers``: the threads of a read split ``split`` ways, for the tasks' size (0: ``parallel``)."""
        self.verify, self.split, self.readers = verify, max(1, split), readers or parallel
        if arena.fd is None:
            raise ConfigError("process reads need a shared arena (HostArena(shared=True))")
        self._all = [ReaderProcess(arena.fd, arena.capacity, parallel) for _ in range(count)]
        self._idle: queue.LifoQueue[ReaderProcess] = queue.LifoQueue()
        self._taking = threading.Lock()  # one read takes its processes at a time
        for proc in reversed(self._all):
            self._idle.put(proc)

    def _take(self, wait: bool = True) -> list[ReaderProcess]:
        """One process (waiting for it; ``wait`` False: none if none is idle or another read is taking), and up
        to ``split`` - 1 more that are idle now."""
        if not self._taking.acquire(blocking=wait):
            return []
        try:
            try:
                procs = [self._idle.get(block=wait)]
            except queue.Empty:
                return []
            while len(procs) < self.split:
                try:
                    procs.append(self._idle.get_nowait())
                except queue.Empty:
                    break
        finally:
            self._taking.release()
        return procs

    def _give_back(self, procs: Sequence[ReaderProcess]) -> None:
        for proc in reversed(procs):  # the first one taken back on top
            self._idle.put(proc)

    def begin(self, spec: AdapterSpec, entry: HostEntry) -> Callable[[], int] | None:
        """Send ``entry``'s read to idle, started reader processes from the calling thread (no hop through the
        tier's pool before a reader has the job); what finishes it (``read``'s result), to call on the pool. None
        (nothing sent) if no process is idle and started now: the read then waits on the pool (``read``)."""
        procs = self._take(wait=False)
        if not procs or not all(p.warm() for p in procs):
            self._give_back(procs)
            return None
        entry.marks.append(("read", time.perf_counter()))
        return self._start(procs, spec, entry)

    def _start(self, procs: list[ReaderProcess], spec: AdapterSpec, entry: HostEntry) -> Callable[[], int]:
        entry.marks.append(("reader", time.perf_counter()))
        split = SplitRead(procs, spec, entry.layout, entry.block.offset, self.verify, entry.chunks,
                          self.readers if len(procs) > 1 else 0, entry.how)
        split.begin()

        def collect() -> int:
            try:
                return split.collect(entry.progress, entry.marks)
            finally:
                self._give_back(procs)

        return collect

    def read(self, spec: AdapterSpec, entry: HostEntry) -> int:
        return self._start(self._take(), spec, entry)()

    def close(self) -> None:
        for proc in self._all:
            proc.close()


READS: dict[str, type[ThreadReads] | type[ProcessReads]] = {"thread": ThreadReads, "process": ProcessReads}
