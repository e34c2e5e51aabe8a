"""A real small file system for tests of a full disk: a tmpfs at a short path, mounted where this process may
(root, or CAP_SYS_ADMIN); the test is skipped elsewhere."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: ``256m``) under /tmp (short: Ray's socket paths stay under 108 bytes)."""
    if shutil.which("mount") is None:
        pytest.skip("needs mount(8)")
    where = Path(tempfile.mkdtemp(prefix="lcfd-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode:
        where.rmdir()
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def fill(directory: Path) -> None:
    """Write ``directory``'s file system full (a file ``fill`` in it)."""
    fd = os.open(directory / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(1 << 20))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
