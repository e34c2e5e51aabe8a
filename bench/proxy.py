"""A throttling TCP proxy, run as its own process: the benchmark's slow object store (``--store s3:...``).

    python -m bench.proxy --listen 127.0.0.1:0 --target 127.0.0.1:9000 --mbps 200 --latency-ms 30 [--port-file F]

Every connection to ``--listen`` is forwarded to ``--target`` (an S3-compatible server: moto's). Bytes from the
target to the client (responses) pass one token bucket shared by every connection: ``--mbps`` megabytes
(10^6 bytes) per second in all, as one network link to a store; each response waits ``--latency-ms`` before
its first byte (a response is what the target sends after the client last sent something: per request on a
keep-alive connection). Requests (client to target) pass unthrottled. The bound port is printed on stdout
(and written to ``--port-file``) once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

CHUNK = 64 << 10


class TokenBucket:
    """``rate`` bytes/s shared by every caller, at most ``burst`` bytes ahead; callers served in FIFO order."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            self.tokens -= n
            if self.tokens < 0:  # owe it: wait until the bucket has refilled what we took
                await asyncio.sleep(-self.tokens / self.rate)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, bool],
                bucket: TokenBucket | None, latency_s: float, response: bool) -> None:
    try:
        while data := await reader.read(CHUNK):
            if response:
                if state["awaiting"]:  # the first byte of a response: the store's latency
                    state["awaiting"] = False
                    if latency_s > 0:
                        await asyncio.sleep(latency_s)
                if bucket is not None:
                    await bucket.take(len(data))
            else:
                state["awaiting"] = True
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):  # the peer may be gone already
            writer.close()


async def serve(listen: tuple[str, int], target: tuple[str, int], mbps: float, latency_ms: float,
                port_file: str = "") -> None:
    bucket = TokenBucket(mbps * 1e6, max(CHUNK, int(mbps * 1e6 * 0.005))) if mbps > 0 else None

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        state = {"awaiting": False}
        await asyncio.gather(_pump(client_r, server_w, state, None, 0.0, False),
                             _pump(server_r, client_w, state, bucket, latency_ms / 1e3, True))

    server = await asyncio.start_server(handle, *listen)
    port = server.sockets[0].getsockname()[1]
    if port_file:
        Path(port_file).write_text(str(port))
    print(port, flush=True)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--target", required=True)
    p.add_argument("--mbps", type=float, default=0.0, help="MB/s shared by all connections (0: unthrottled)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay before each response's first byte")
    p.add_argument("--port-file", default="")
    ns = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(_addr(ns.listen), _addr(ns.target), ns.mbps, ns.latency_ms, ns.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
