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

from lora_cache.runtime.ports import free_port


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


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request '
             b'rate.</Message></Error>')


class ThrottleProxy:
    """127.0.0.1:``port`` -> ``upstream``, an HTTP proxy that admits ``rate`` requests a second (a token bucket of
    ``burst``) and at most ``concurrent`` at once (0: no bound), and answers the rest ``503 SlowDown`` with S3's XML
    error, as a store asked too fast does. Requests
    pass whole, their headers (the signature's ``Host`` included) as sent; each answer is read whole and passed on.
    It counts what it ``passed`` and ``throttled``."""

    def __init__(self, upstream: str, rate: float, burst: int, concurrent: int = 0) -> None:
        import http.client
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.rate, self.burst, self.concurrent = rate, burst, concurrent
        self.passed = self.throttled = self.in_flight = 0
        self._tokens, self._at = float(burst), time.monotonic()
        self._lock = threading.Lock()
        host, _, port = upstream.removeprefix("http://").partition(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as botocore's pool expects

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not proxy._admit():
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                up = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in ("connection", "keep-alive"):
                            up.putheader(k, v)
                    up.endheaders(body or None)
                    answer = up.getresponse()
                    data = answer.read()
                    self.send_response(answer.status, answer.reason)
                    for k, v in answer.getheaders():
                        if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                            self.send_header(k, v)
                    length = answer.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    up.close()
                    with proxy._lock:
                        proxy.in_flight -= 1

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="throttle-proxy", daemon=True)

    def _admit(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= 1.0 and (not self.concurrent or self.in_flight < self.concurrent):
                self._tokens -= 1.0
                self.passed += 1
                self.in_flight += 1
                return True
            self.throttled += 1
            return False

    def __enter__(self) -> ThrottleProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
