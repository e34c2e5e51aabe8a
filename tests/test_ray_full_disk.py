"""A worker actor SIGKILLed while Ray's temp disk is full restarts (issue 46).

Ray writes a worker process's markers to its stdout file in the session's logs; on a full disk that write raised in
Ray's task executor and the process exited, so a restarted actor died on its first call until space was freed
(``lora_cache/runtime/full_disk.py``). A real small file system (tmpfs, mounted where this process may:
tests/small_fs.py) holds an embedded cluster's temp dir; ``/dev/full`` is the stream test's full disk (no mount).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_cache.runtime.full_disk import TolerantStream, tolerate_full_disk
from tests.small_fs import mounted_tmpfs

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import errno, os, signal, sys, time
import ray
from lora_cache.runtime.cluster import connect

connect("", "full-disk")

@ray.remote(max_restarts=-1)
class Rank:
    def pid(self):
        return os.getpid()

rank = Rank.remote()
pid = ray.get(rank.pid.remote(), timeout=120)
fd = os.open(os.path.join(sys.argv[1], "fill"), os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, bytes(1 << 20))
except OSError as e:
    assert e.errno == errno.ENOSPC, e
os.close(fd)
print("FULL", flush=True)
os.kill(pid, signal.SIGKILL)
start = time.monotonic()
while time.monotonic() - start < 90:
    try:
        new = ray.get(rank.pid.remote(), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        time.sleep(0.2)
        continue
    print(f"RESTARTED {pid} -> {new} after {time.monotonic() - start:.1f} s", flush=True)
    break
else:
    print("NOT RESTARTED within 90 s", flush=True)
ray.shutdown()
"""


@pytest.fixture
def small_fs() -> Iterator[Path]:
    with mounted_tmpfs("256m") as where:
        yield where


@pytest.mark.ray
def test_an_actor_sigkilled_while_rays_temp_disk_is_full_restarts(small_fs: Path) -> None:
    # No PYTHONPATH: the driver imports this checkout's lora_cache from its cwd, as `serve` run from a clone does,
    # and the worker runs the hook before that path is on its own (the hook must not need it).
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "PYTHONPATH")}
    env.update(RAY_TMPDIR=str(small_fs), TMPDIR=str(small_fs))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(small_fs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("FULL", "RESTARTED", "NOT RESTARTED"))]
    assert lines[:1] == ["FULL"], done.stdout[-2000:] + done.stderr[-3000:]
    assert len(lines) == 2 and lines[1].startswith("RESTARTED"), lines


def test_output_that_finds_a_full_disk_is_dropped_and_counted_other_errors_raise() -> None:
    full = open("/dev/full", "w", buffering=1)  # noqa: SIM115 - every write and flush of it: ENOSPC
    stream = TolerantStream(full)
    print(":job_id:01000000", file=stream, flush=True)
    assert stream.dropped >= 1
    assert stream.fileno() == full.fileno()
    with pytest.raises(OSError):  # the line still pending: closing flushes it (the fd is closed all the same)
        full.close()
    assert full.closed
    closed = TolerantStream(open(os.devnull, "w"))  # noqa: SIM115 - closed below, on purpose
    os.close(closed.fileno())
    with pytest.raises(OSError) as info:
        print("x", file=closed, flush=True)
    assert info.value.errno == errno.EBADF
    before = sys.stdout, sys.stderr
    try:
        tolerate_full_disk()
        tolerate_full_disk()  # once: not wrapped twice
        assert isinstance(sys.stdout, TolerantStream) and sys.stdout.stream is before[0]
    finally:
        sys.stdout, sys.stderr = before
