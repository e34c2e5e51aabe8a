"""An S3-compatible store on this machine for probes: moto's server mode as a process of its own, and a TCP proxy
in front of it that adds a fixed latency to every request (a store 20-50 ms away, as production's is).

``LatencyProxy`` holds each chunk a client sends for ``latency_s`` before passing it on, in order, per connection
(the server's answers pass at once): a request whose headers go in one write, every GET and HEAD of botocore's,
arrives ``latency_s`` late; its answer is not delayed again. It counts the connections and chunks it passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server process on 127.0.0.1 (no IAM: any keys); its URL. This process's AWS_* variables point at
    it while it runs (so a Ray cluster started inside inherits them)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_REGION", "AWS_DEFAULT_REGION")}
    try:
        for _ in range(150):
            if proc.poll() is not None:
                raise SystemExit("moto's server exited: pip install 'moto[server]'")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.2)
        os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="probe", AWS_SECRET_ACCESS_KEY="probe",
                          AWS_REGION="us-east-1", AWS_DEFAULT_REGION="us-east-1")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def upload(directories: list[Path], bucket: str, prefix: str, threads: int = 32) -> None:
    """Every file of each adapter directory to ``s3://bucket/prefix/<dir name>/<file>`` (the bucket made)."""
    import boto3

    s3 = boto3.client("s3")
    with contextlib.suppress(Exception):
        s3.create_bucket(Bucket=bucket)
    files = [(d.name, f) for d in directories for f in sorted(d.iterdir())]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda nf: s3.put_object(Bucket=bucket, Key=f"{prefix}/{nf[0]}/{nf[1].name}",
                                               Body=nf[1].read_bytes()), files))


class LatencyProxy:
    """127.0.0.1:``port`` -> ``upstream``, each client chunk held ``latency_s`` (see the module docstring)."""

    def __init__(self, upstream: str, latency_s: float) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream, self.latency_s = (host, int(port)), latency_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = self.chunks = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:  # the connections still open (a client's pool) end with the proxy
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def take() -> None:  # client -> held, stamped with when it may go
            while data := await reader.read(1 << 16):
                self.chunks += 1
                held.put_nowait((time.monotonic() + self.latency_s, data))
            held.put_nowait((0.0, b""))

        async def send() -> None:  # held -> server, each at its time, in order
            while True:
                due, data = await held.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                up_writer.write(data)
                await up_writer.drain()
            with contextlib.suppress(OSError):
                up_writer.write_eof()

        async def answer() -> None:  # server -> client, at once
            while data := await up_reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
            writer.close()

        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            await asyncio.gather(take(), send(), answer())
        up_writer.close()
        writer.close()
