"""Page-cache helpers for the tests of direct reads (``tests/test_direct_reads.py``, the cold-device probe's test):
whether a file system takes ``O_DIRECT``, and how many of a file's pages the page cache holds."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def direct_refused(path: Path) -> str:
    """Why ``O_DIRECT`` cannot be tested at ``path`` ("" if it can)."""
    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    probe = path / ".direct-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        return f"the file system under {path} refuses O_DIRECT ({e})"
    finally:
        probe.unlink()
    return ""


def cached_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, its pages), by ``mincore`` over a mapping no byte of which is read."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        base = ctypes.c_char.from_buffer(mapped)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        del base
        return sum(v & 1 for v in vec), pages
    finally:
        mapped.close()
