"""A real ``redis-server`` process for the tests of Ray's GCS fault tolerance (issue 46 item 5).

Found, in order: ``$LORA_CACHE_TEST_REDIS`` (the server's path), ``redis-server`` on ``PATH``, or Debian's packages
unpacked into ``.ci-redis/`` at the repository's root, as ``.ci/run`` does without root::

    apt-get download redis-server redis-tools liblzf1 libjemalloc2
    for f in *.deb; do dpkg-deb -x "$f" .ci-redis; done

The server listens on loopback at a free port, keeps nothing on disk (a test's Redis lives as long as its test) and
is stopped when the context ends. ``ping`` speaks the protocol itself: no Redis client is a dependency.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_cache.runtime.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
UNPACKED = ROOT / ".ci-redis"


def find_server() -> tuple[str, dict[str, str]] | None:
    """The server's path and the environment it runs in (its unpacked libraries), or None."""
    env = dict(os.environ)
    if given := os.environ.get("LORA_CACHE_TEST_REDIS"):
        return given, env
    if on_path := shutil.which("redis-server"):
        return on_path, env
    server = UNPACKED / "usr" / "bin" / "redis-server"
    if server.is_file():
        libs = [str(p) for p in (UNPACKED / "usr" / "lib").glob("*-linux-gnu")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        return str(server), env
    return None


def ping(port: int) -> bool:
    """Whether a Redis server answers PING on loopback at ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(timeout_s: float = 30.0) -> Iterator[str]:
    """A running ``redis-server``; yields its address (``127.0.0.1:PORT``). Skips the test if none is found."""
    found = find_server()
    if found is None:
        pytest.skip("no redis-server: install Debian's redis-server, set LORA_CACHE_TEST_REDIS to one, or unpack "
                    "Debian's packages into .ci-redis/ as .ci/run does (tests/redis_local.py)")
    server, env = found
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--protected-mode", "yes"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not ping(port):
            if process.poll() is not None:
                out = process.stdout.read().decode(errors="replace") if process.stdout else ""
                raise RuntimeError(f"redis-server {server} exited with {process.returncode}: {out[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server {server} did not answer PING on port {port} in {timeout_s} s")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
