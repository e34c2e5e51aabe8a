"""The threads a push's passes over its bytes share (lifecycle step 0; issue 44 item 5).

A push's bytes are copied and hashed several times on their way (the client's payload, the content version and
block CRCs, the write into node memory, a node copy's proof), each pass one core's memory bandwidth on one thread.
``passes()`` is one pool per process that those passes split their bytes over, ``PASS_BYTES`` a task: numpy's
copies, blake2b and CRC-32 free the GIL, so the pass runs on as many cores as the pool has (up to
``PASS_THREADS``: past that, memory bandwidth, not cores, bounds them). A task never waits for another task of
the pool, so passes may run at once.

An operator may run the pool's threads at a lower CPU priority than the process's others (``LORA_CACHE_PUSH_NICE``,
``pass_nice()``): a push is background work beside the engines of its node, whose eager kernel launches (prefill)
need a core the moment they run; where cores are idle a nice thread runs as fast as any, where an engine's thread
and a pass contend, the engine's runs first. Off by default (``PASS_NICE`` 0): on one H200 with 16 cores, a push
every second beside the 8B reference engine, prefill steps overlapping a push were 1.01-1.10x the others at
niceness 0 and at 10 alike (bench/reports/issue-44.md, "Item 5: do a push's passes stall prefill? Their CPU
priority").
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from lora_cache.adapters.files import BLOCK_BYTES
from lora_cache.errors import ConfigError

PASS_THREADS = 16  # threads at most in the pool (unless THREADS_ENV says otherwise)
THREADS_ENV = "LORA_CACHE_PUSH_THREADS"
PASS_NICE = 0  # the pool threads' niceness over the process's own (unless NICE_ENV says otherwise)
NICE_ENV = "LORA_CACHE_PUSH_NICE"
PASS_BYTES = 8 * BLOCK_BYTES  # the bytes one task takes (whole blocks, so a block's hash is one task's)
_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []  # made at the first pass (not at import: a forked process makes its own)


def task_bytes(nbytes: int, limit: int = 0) -> int:
    """The bytes of one task of a CPU-bound pass over ``nbytes`` (hashing): whole blocks, up to ``limit``
    (``PASS_BYTES``), but few enough that every thread of the pool gets some (an 8B rank-16 push, 84 MB, in 8 MiB
    tasks is 11 tasks for 16 threads: its hash took 35 ms on one H200, in 1 MiB tasks 24 ms)."""
    threads = passes()._max_workers  # the pool's own (a test may set one of its own size)
    blocks = -(-nbytes // (threads * BLOCK_BYTES))  # blocks a thread, rounded up
    return max(BLOCK_BYTES, min(limit or PASS_BYTES, blocks * BLOCK_BYTES))


def _env_int(name: str, low: int, high: int, what: str, unset: str) -> int | None:
    """The whole number ``name`` holds, from ``low`` to ``high``; None where it is unset or blank. Anything else is
    refused naming the variable, its value, ``what`` the number is and ``unset`` (what leaving it unset gives)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ConfigError(f"{name}={raw!r} is not {what}: give a whole number from {low} to {high}, "
                          f"or leave it unset for {unset}")
    return int(raw)


def pass_threads() -> int:
    """The pool's threads: ``LORA_CACHE_PUSH_THREADS`` if set (an operator leaving cores to a node's engines), else
    one per core this process may run on, up to ``PASS_THREADS``."""
    n = _env_int(THREADS_ENV, 1, 256, "a thread count (the threads a push's passes over its bytes use)", "one per core")
    if n is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return min(PASS_THREADS, cores)
    return n


def pass_nice() -> int:
    """How much nicer than the process a pool thread runs: ``LORA_CACHE_PUSH_NICE`` if set (0: the same priority as
    the engine beside it; 19: only what the engines leave), else ``PASS_NICE``."""
    n = _env_int(NICE_ENV, 0, 19, "a niceness (0: a push's passes at the engines' priority; 19: only on idle cores)",
                 str(PASS_NICE))
    return PASS_NICE if n is None else n


def _lower_priority(nice: int) -> None:
    """A pool thread's start: its own niceness raised by ``nice`` (Linux keeps one per thread; raising it needs no
    privilege). Where the platform has none, the thread runs at the process's priority."""
    if nice and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):  # a sandbox that refuses it: the pass still runs, at the process's priority
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def passes() -> ThreadPoolExecutor:
    """This process's pool for passes over a push's bytes (``pass_threads()`` threads, ``pass_nice()`` nicer)."""
    if not _POOL:
        with _LOCK:
            if not _POOL:
                _POOL.append(ThreadPoolExecutor(pass_threads(), "push-pass", _lower_priority, (pass_nice(),)))
    return _POOL[0]
