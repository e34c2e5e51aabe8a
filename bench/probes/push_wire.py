"""A push's ``PushAdapter`` stream alone (issue 44 item 5): protobuf message objects against the wire form.

Both sides in this process, over loopback: a bare ``grpc.aio`` server whose handler gathers the stream as the gateway
does (``push_stream.gather``), the body of each message decoded by protobuf (``validate.parse``, before) or taken in
place where it holds weights alone (``push_stream.parse_request``, now); the sync client sending
``client_values.push_messages`` through protobuf's serializer (before) or ``push_wire`` as they are (now). No
controller, no hash, no write: what the stream itself costs, alternately, ``--repeats`` times each.

    python -m bench.probes.push_wire --mib 216 --repeats 5 --out /tmp/push_wire.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from lora_cache.api import client_values as msg
from lora_cache.api import validate
from lora_cache.api.push_stream import gather, parse_request
from lora_cache.api.v1 import lora_cache_service_pb2 as pb

SERVICE = "probe.PushWire"


def _handler(parse: Callable[[bytes], Any], got: list[int]) -> Callable[..., AsyncIterator[bytes]]:
    async def handle(raw_requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async def requests() -> AsyncIterator[Any]:
            async for raw in raw_requests:
                yield parse(raw)

        body = await gather(requests(), 1 << 40)
        got.append(len(body.weights))
        yield pb.PushAdapterResponse(name=body.name).SerializeToString()

    return handle


async def _serve(port: list[int], ready: threading.Event, stop: threading.Event, got: list[int]) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Messages": grpc.stream_stream_rpc_method_handler(
            _handler(lambda raw: validate.parse(pb.PushAdapterRequest, raw), got)),
        "Wire": grpc.stream_stream_rpc_method_handler(_handler(parse_request, got)),
    }),))
    port.append(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.05)
    await server.stop(0)


def measure(nbytes: int, repeats: int) -> dict[str, Any]:
    """Median and every time (ms) of one push's stream of ``nbytes`` of weights, each form in turn."""
    port: list[int] = []
    got: list[int] = []
    ready, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=lambda: asyncio.run(_serve(port, ready, stop, got)), daemon=True)
    server.start()
    ready.wait(30)
    weights = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).data)
    times: dict[str, list[float]] = {"messages": [], "wire": []}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
            messages = channel.stream_stream(f"/{SERVICE}/Messages",
                                             request_serializer=pb.PushAdapterRequest.SerializeToString)
            wire = channel.stream_stream(f"/{SERVICE}/Wire", request_serializer=None)
            for _ in range(repeats):
                for form, call, stream in (("messages", messages, msg.push_messages), ("wire", wire, msg.push_wire)):
                    t0 = time.perf_counter()
                    list(call(stream("probe", 1, b"{}", weights)))
                    times[form].append((time.perf_counter() - t0) * 1e3)
                    assert got.pop() == nbytes, form
    finally:
        stop.set()
        server.join(10)
    medians = {form: statistics.median(v) for form, v in times.items()}
    return {"bytes": nbytes, "chunk_bytes": msg.PUSH_CHUNK_BYTES, "ms": times, "median_ms": medians,
            "wire_over_messages": medians["wire"] / medians["messages"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=84, help="the weights' size (84: an 8B rank-16 adapter in bf16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    result = {**measure(args.mib << 20, args.repeats), "host": platform.node(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
