"""``--store``: where the benchmark's adapters come from, the same on both engines (issue 42 item 2).

- ``page-cache`` (the default): the adapter files on local disk, their pages left in the page cache after the
  first read (every read after it is a memory copy);
- ``device``: the files on local disk with the page cache bypassed: every worker drops a file's pages after it
  reads its shard (``HostTierConfig.drop_page_cache``, ``workers.staging.host_tier.drop_pages``), and the
  benchmark drops
  every adapter file's pages before each policy's run (``drop_all_pages``), so a host-tier miss reads the device;
- ``s3:BANDWIDTH,LATENCY`` (e.g. ``s3:200MBps,30ms``): the adapters served by a real S3-compatible server
  (moto's server mode, its own process) behind a throttling TCP proxy (``bench.proxy``, its own process): every
  response waits LATENCY before its first byte, and all responses share BANDWIDTH (MB/s, 10^6 bytes). The
  service registers ``s3://BUCKET/adapters`` and every worker fetches through the proxy
  (``AWS_ENDPOINT_URL``) into its node's disk tier (a fresh directory per policy), then reads its shard from
  there (``workers.staging.disk_tier``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from lora_cache.errors import ConfigError
from lora_cache.runtime.ports import free_port

STORES = ("page-cache", "device", "s3:BANDWIDTH,LATENCY")
BUCKET = "bench-adapters"
UPLOADS = 16  # the catalog's files put into moto at once
_BW = re.compile(r"^(\d+(?:\.\d+)?)\s*(MB|GB)(?:ps|/s)$", re.IGNORECASE)
_LAT = re.compile(r"^(\d+(?:\.\d+)?)\s*ms$", re.IGNORECASE)


class StoreModel(NamedTuple):
    """A parsed ``--store``: ``kind`` page-cache | device | s3; s3's bandwidth (MB/s) and latency (ms)."""

    kind: str = "page-cache"
    mbps: float = 0.0
    latency_ms: float = 0.0

    def describe(self) -> str:
        if self.kind == "s3":
            return f"s3 ({self.mbps:g} MB/s shared, {self.latency_ms:g} ms to each response's first byte)"
        return self.kind


def parse_store(text: str) -> StoreModel:
    """``--store``'s value, or a ConfigError naming the option, the value and the fix."""
    fix = "use --store page-cache, --store device or --store s3:BANDWIDTH,LATENCY (e.g. --store s3:200MBps,30ms)"
    if text in ("page-cache", "device"):
        return StoreModel(text)
    kind, sep, arg = text.partition(":")
    if kind != "s3":
        raise ConfigError(f"--store {text!r} is not a storage model; {fix}")
    parts = [p.strip() for p in arg.split(",")] if sep else []
    if len(parts) != 2:
        raise ConfigError(f"--store {text!r}: s3 needs a bandwidth and a latency, s3:BANDWIDTH,LATENCY; {fix}")
    bw, lat = _BW.match(parts[0]), _LAT.match(parts[1])
    if bw is None:
        raise ConfigError(f"--store {text!r}: bandwidth {parts[0]!r} is not MB/s or GB/s (e.g. 200MBps, 1.5GBps); "
                          f"{fix}")
    if lat is None:
        raise ConfigError(f"--store {text!r}: latency {parts[1]!r} is not milliseconds (e.g. 30ms); {fix}")
    mbps = float(bw.group(1)) * (1000.0 if bw.group(2).upper() == "GB" else 1.0)
    if mbps <= 0:
        raise ConfigError(f"--store {text!r}: bandwidth must be > 0 MB/s; {fix}")
    return StoreModel("s3", mbps, float(lat.group(1)))


class Dropped(NamedTuple):
    """What ``drop_all_pages`` did: the files it dropped, and of their pages how many the page cache still held
    after (``mincore``; 0 on a quiet local file system, all of them on tmpfs, which keeps no page cache)."""

    files: int
    cached: int
    pages: int

    def describe(self) -> str:
        return f"dropped the pages of {self.files} adapter files ({self.cached} of {self.pages} pages still cached)"


def drop_all_pages(root: str | Path) -> Dropped:
    """Every file under ``root`` out of the page cache, each written to the device first (``fsync``, then
    ``POSIX_FADV_DONTNEED``). A dirty page is not dropped: without the write, the adapters a fresh machine has just
    made stayed partly cached, and the device wrote the rest back while the first policy's reads waited on it (a
    quarter of a fresh file's pages stayed on this machine's ext4; on the H100 host the first run's rank-64 reads
    took a median 302 ms against 229-233 in the runs after it, whichever policy ran first)."""
    files = cached = pages = 0
    for path in _files(root):
        _write(path, os.POSIX_FADV_DONTNEED)
        held, total = cached_pages(path)
        files, cached, pages = files + 1, cached + held, pages + total
    return Dropped(files, cached, pages)


def write_back(root: str | Path) -> int:
    """Every file under ``root`` written to the device (``fsync``), so that nothing made before a run is still being
    written during it; how many files."""
    paths = _files(root)
    for path in paths:
        _write(path)
    return len(paths)


def _files(root: str | Path) -> list[Path]:
    return [p for p in sorted(Path(root).rglob("*")) if p.is_file()]


def _write(path: Path, advice: int | None = None) -> None:
    """``path``'s dirty pages written to the device, then ``advice`` (``posix_fadvise``) on the whole file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        if advice is not None:
            os.posix_fadvise(fd, 0, 0, advice)
    finally:
        os.close(fd)


_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore's byte per page: bit 0 is "resident", the others reserved


def cached_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, its pages), by ``mincore`` over a mapping no byte of which is read."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        base = ctypes.c_char.from_buffer(mapped)
        vec = (ctypes.c_ubyte * pages)()
        if _libc().mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        del base
        return bytes(vec).translate(_LOW_BIT).count(1), pages  # in C: an 8B catalog has ~5 million pages
    finally:
        mapped.close()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class Proxy:
    """``bench.proxy`` as its own process, forwarding to ``target`` (host:port) at ``mbps``, ``latency_ms``."""

    def __init__(self, target: str, mbps: float, latency_ms: float, timeout_s: float = 30.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.proxy", "--target", target, "--mbps", str(mbps),
                                      "--latency-ms", str(latency_ms)], stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[1], text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the bound port, once listening
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"bench.proxy did not start (exit {self.proc.poll()})")
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """moto's S3 server (``python -m moto.server``) as its own process on 127.0.0.1, no authentication; its URL."""
    import socket

    port = free_port()
    # every object in the server's memory (moto spools one past 5 MB to a temporary file): a benchmark catalog of
    # 20 GB would otherwise take a third copy of it on the machine's disk, beside the files and the disk tier
    env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 40)}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start; pip install 'moto[server]'") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


STORE_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_store(model: StoreModel, root: str | Path, names: list[str]) -> Iterator[tuple[str, dict[str, str]]]:
    """moto's server and the proxy in front of it, ``names`` (directories of ``root``) uploaded under
    ``s3://BUCKET/adapters/NAME``: yields that prefix's URL and the environment a process needs to fetch through
    the proxy (``AWS_ENDPOINT_URL`` the proxy's; moto without authentication)."""
    import boto3

    with moto_server() as direct, Proxy(direct.rpartition("//")[2], model.mbps, model.latency_ms) as proxy:
        s3 = boto3.session.Session().client("s3", endpoint_url=direct, region_name="us-east-1",
                                            aws_access_key_id="bench", aws_secret_access_key="bench")
        s3.create_bucket(Bucket=BUCKET)
        files = [(name, f) for name in names for f in sorted((Path(root) / name).iterdir()) if f.is_file()]

        def put(item: tuple[str, Path]) -> int:
            name, f = item
            body = f.read_bytes()
            s3.put_object(Bucket=BUCKET, Key=f"adapters/{name}/{f.name}", Body=body)
            return len(body)

        t0 = time.perf_counter()
        # Several uploads at once: moto's server takes each PUT at ~60-150 MB/s of one core, so one at a time a
        # benchmark catalog of 20 GB took minutes before the first request (boto3's clients are thread-safe).
        with ThreadPoolExecutor(UPLOADS) as pool:
            total = sum(pool.map(put, files))
        took = time.perf_counter() - t0
        print(f"store: {len(names)} adapters ({total / 1e9:.2f} GB) uploaded to moto in {took:.1f} s "
              f"({total / 1e6 / max(took, 1e-9):.0f} MB/s); served through the proxy at {proxy.url}: "
              f"{model.describe()}", file=sys.stderr)
        yield f"s3://{BUCKET}/adapters", {**STORE_ENV, "AWS_ENDPOINT_URL": proxy.url}
