"""Reader threads that split one rank's read, chunk by chunk, in order (lifecycle step 5).

A single reader moved ~3.6 GB/s from the page cache to pinned memory (one core's copy; issue 30), a
parallel sequential read of the same file several times that. ``ReadPool`` holds ``size`` threads; a read's
tasks (``workers.reads.plan``: positioned reads, conversions, block checks), chunk after chunk, are taken in
order by one loop per thread, so a thread that finishes chunk k's share starts on chunk k+1's while the
others finish k.
``run_in_order`` calls ``done(k)`` in the reading thread once chunk k and every chunk before it are in place:
chunks are still published in layer order, one after another. The tasks release the GIL while they move
bytes (``os.preadv``, torch copies, ``zlib.crc32``); what they hold it for is microseconds per task.

The first task that fails fails the read: tasks of it not yet started are skipped, and ``run_in_order``
raises only once none of them is running, so no thread writes into the buffer after the read gave it back.
A reader process (``workers.reads.processes``) holds one pool; the host tier's reader threads share one.

How many threads a read gets (``HostTierConfig.read_parallel``, 0: ``auto_readers``): the host's cores shared
by the GPU ranks on it, at most ``AUTO_MAX`` in one process (bench/RESULTS.md, issue 30); a read split over reader
processes (``workers.staging.host_tier``'s ``read_split``) takes up to 16, a few per process.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

AUTO_MAX = 8  # readers of one read, at most, by default: 16 threads read slower than 8 (the GIL; issue 30)
GPU_DIR = Path("/proc/driver/nvidia/gpus")  # one entry per GPU of the host, whatever this process may see
Task = Callable[[], object]  # its value, if any, is the caller's (a reader thread ignores it)


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_on_host(tp: int) -> int:
    """GPU ranks that share this host's cores: its GPUs (a TP group fills a host's, and a rank that sees one
    GPU still shares the host with the others), and at least the TP size."""
    try:
        gpus = sum(1 for _ in GPU_DIR.iterdir())
    except OSError:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, tp, gpus)


def auto_readers(cores: int, ranks: int, most: int = AUTO_MAX) -> int:
    """Reader threads per read by default: the host's cores over its ranks, in 1..``most``."""
    return max(1, min(most, cores // max(1, ranks)))


class ReadPool:
    """``size`` daemon threads that run read tasks, first queued first run; shared by concurrent reads."""

    def __init__(self, size: int, name: str = "lora-read-part") -> None:
        if size < 1:
            raise ValueError(f"a read pool needs at least one thread, got {size}")
        self.size = size
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            task()  # a read's loop (run_in_order): never raises

    def submit(self, task: Task) -> None:
        self._queue.put(task)

    def close(self) -> None:
        """End the threads once the tasks queued before this have run."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


class _Tally:
    """Tasks left per chunk, the first error, the read's loops still on a thread, and whether the read gave up
    (then what has not started is skipped)."""

    def __init__(self, counts: Sequence[int], loops: int) -> None:
        self.cond = threading.Condition()  # protects everything below
        self.left = list(counts)
        self.loops = loops  # worker loops of this read not yet ended
        self.error: BaseException | None = None
        self.cancelled = False

    def run(self, k: int, task: Task) -> None:
        error = None
        try:
            task()
        except BaseException as e:  # the read's error, raised in the reading thread
            error = e
        with self.cond:
            if error is not None and self.error is None:
                self.error, self.cancelled = error, True
            self.left[k] -= 1
            self.cond.notify_all()

    def ended(self) -> None:
        with self.cond:
            self.loops -= 1
            self.cond.notify_all()

    def wait_chunk(self, k: int) -> None:
        """Until chunk k's tasks have all run; raises the read's first error."""
        with self.cond:
            while self.left[k] and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error

    def drain(self) -> None:
        """Skip what has not started and wait for what has."""
        with self.cond:
            self.cancelled = True
            while self.loops:
                self.cond.wait()


def run_in_order(pool: ReadPool, chunks: Sequence[Sequence[Task]], done: Callable[[int], None],
                 loops: int = 0) -> None:
    """Run every chunk's tasks on ``pool`` and call ``done(k)`` here once chunk k's tasks and every earlier
    chunk's have finished, k = 0, 1, ... in order. One loop per thread takes the next task (in chunk order)
    until none is left, so the reading thread queues ``pool.size`` loops, not every task. The first error (a
    task's, or ``done``'s) is raised once no task of this call runs. ``loops``: at most this many threads of the
    pool (0: all of them)."""
    flat = [(k, task) for k, tasks in enumerate(chunks) for task in tasks]
    take = itertools.count().__next__  # atomic: one C call under the GIL
    tally = _Tally([len(tasks) for tasks in chunks], min(loops or pool.size, pool.size, len(flat)))

    def loop() -> None:
        try:
            while not tally.cancelled and (i := take()) < len(flat):
                tally.run(*flat[i])
        finally:
            tally.ended()

    for _ in range(tally.loops):
        pool.submit(loop)
    try:
        for k in range(len(chunks)):
            tally.wait_chunk(k)
            done(k)
    finally:
        tally.drain()
