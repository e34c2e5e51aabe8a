"""A helper for the tests of direct reads (``tests/test_direct_reads.py``, the cold-device probe's test): whether a
file system takes ``O_DIRECT``. How many of a file's pages the page cache holds is ``bench.store.cached_pages``."""

from __future__ import annotations

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
