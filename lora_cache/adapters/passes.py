"""The threads a push's passes over its bytes share (lifecycle step 0; issue 44 item 5).

A push's bytes are copied and hashed several times on their way (the client's payload, the content version and
block CRCs, the write into node memory, a node copy's proof), each pass one core's memory bandwidth on one thread.
``passes()`` is one pool per process that those passes split their bytes over, ``PASS_BYTES`` a task: numpy's
copies, blake2b and CRC-32 free the GIL, so the pass runs on as many cores as the pool has (up to
``PASS_THREADS``: past that, memory bandwidth, not cores, bounds them). A task never waits for another task of
the pool, so passes may run at once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from lora_cache.adapters.files import BLOCK_BYTES
from lora_cache.errors import ConfigError

PASS_THREADS = 16  # threads at most in the pool (unless THREADS_ENV says otherwise)
THREADS_ENV = "LORA_CACHE_PUSH_THREADS"
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


def pass_threads() -> int:
    """The pool's threads: ``LORA_CACHE_PUSH_THREADS`` if set (an operator leaving cores to a node's engines), else
    one per core this process may run on, up to ``PASS_THREADS``."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return min(PASS_THREADS, cores)
    if not raw.isdigit() or not 1 <= int(raw) <= 256:
        raise ConfigError(f"{THREADS_ENV}={raw!r} is not a thread count: give a whole number from 1 to 256 (the "
                          "threads a push's passes over its bytes use), or leave it unset for one per core")
    return int(raw)


def passes() -> ThreadPoolExecutor:
    """This process's pool for passes over a push's bytes (``pass_threads()`` threads)."""
    if not _POOL:
        with _LOCK:
            if not _POOL:
                _POOL.append(ThreadPoolExecutor(pass_threads(), "push-pass"))
    return _POOL[0]
