"""An attached rank's link through the gateway (``AttachConfig(gateway="host:port")``): one ``AttachRank``
gRPC stream, for an engine process outside the Ray cluster. Ray is never imported here.

The gateway hosts the rank's endpoint in the cluster and relays the controller's calls down the stream
(``lora_cache/api/rank_link.py``); this side answers them, sends the rank's residency deltas and its
signs of life (``RankAlive``) up the same stream, and the waiting queue through the gateway's
``ReportQueue`` RPC on the same channel. Threads: a reader thread takes the messages down (calls into
a queue the serve thread takes from); gRPC's own thread sends what the request queue holds, in order.
Closing the stream is the detach: the gateway tells the controller and kills the endpoint; a process
that dies closes it too (its socket), with the same effect.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.api import relay_codec as codec
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc
from lora_cache.errors import (
    CapacityError,
    ConfigError,
    ConflictError,
    LoraCacheError,
    NotFoundError,
    ResolveTimeoutError,
)
from lora_cache.vocab import Answer, Call, DeltaRow
from workers.attach.transport import Hello, RankTransport
from workers.control.node_copies import PAYLOAD_S

OPEN_S = 60.0  # the gateway answers a hello within this (plus the hello's name_wait_s)
ADOPT_S = 120.0  # the controller adopts the rank within this (the Ray transport's wait too)
CLOSE_S = 30.0  # a detach waits this long for the gateway to drop the rank

_DOMAIN = {grpc.StatusCode.NOT_FOUND: NotFoundError, grpc.StatusCode.FAILED_PRECONDITION: ConflictError,
           grpc.StatusCode.INVALID_ARGUMENT: ConfigError, grpc.StatusCode.UNAUTHENTICATED: ConfigError,
           grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError, grpc.StatusCode.DEADLINE_EXCEEDED: ResolveTimeoutError}


# HTTP/2 pings on the AttachRank stream, as the routers' client sends them (lora_cache/api/client.py KEEPALIVE;
# workers/ does not import the client): a connection a NAT or load balancer dropped is found within 40 s.
KEEPALIVE = (("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0))


class GatewayLinkError(LoraCacheError, ConnectionError):
    """The gateway cannot be reached, or the rank's stream to it ended."""


class GrpcTransport(RankTransport):
    """The rank's ``AttachRank`` stream to the gateway at ``target`` (see the module docstring)."""

    def __init__(self, target: str, name: str, token: str | None = None, tls_ca: str | None = None,
                 client_pair: tuple[str, str] | None = None) -> None:
        """``client_pair``: the PEM certificate and key files this rank presents (mutual TLS; with ``tls_ca``)."""
        self.target, self.name, self.node = target, name, socket.gethostname()
        cert, key = (Path(client_pair[0]).read_bytes(), Path(client_pair[1]).read_bytes()) if client_pair else (None,
                                                                                                               None)
        credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes(), key, cert) if tls_ca else None
        options = KEEPALIVE  # an idle AttachRank stream through a NAT or load balancer stays up, or is found dead
        self._channel = (grpc.secure_channel(target, credentials, options) if credentials
                         else grpc.insecure_channel(target, options))
        self._stub = pb_grpc.LoraCacheServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._up: queue.Queue[pb.AttachRankRequest | None] = queue.Queue()  # None: half-close (the detach)
        self._calls: queue.Queue[Call | None] = queue.Queue()  # None: the stream ended
        self._lock = threading.Lock()  # protects _methods and _last_sign
        self._methods: dict[int, str] = {}  # call id -> method, of calls taken and not answered
        self._last_sign = 0.0  # monotonic time of the last answer or RankAlive sent
        self._attached, self._adopted, self._ended = threading.Event(), threading.Event(), threading.Event()
        self._catalog: CatalogConfig | None = None
        self._error: BaseException | None = None  # why the stream ended, if it failed
        self._responses: Any = None
        self._closed = False

    # -- opening ------------------------------------------------------------------------------------
    def open(self, hello: Hello) -> CatalogConfig:
        self._up.put(pb.AttachRankRequest(hello=pb.AttachHello(**hello._asdict())))
        self._responses = self._stub.AttachRank(self._requests(), metadata=self._metadata)
        threading.Thread(target=self._read, name=f"lora-attach-grpc-{self.name}", daemon=True).start()
        self._wait(self._attached, OPEN_S + hello.name_wait_s, "answer the hello")
        assert self._catalog is not None
        return self._catalog

    def adopted(self, hello: Hello) -> None:
        self._wait(self._adopted, ADOPT_S, "have the controller adopt the rank")

    def _wait(self, event: threading.Event, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not event.is_set():
            if self._ended.is_set() and not event.is_set():
                raise self.failure()
            if time.monotonic() > deadline:
                raise GatewayLinkError(f"{self.name}: the gateway at {self.target} did not {what} within "
                                       f"{timeout_s:.0f} s; is the controller running and the gateway healthy?")
            event.wait(0.05)

    def _requests(self) -> Any:
        while (message := self._up.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for message in self._responses:
                kind = message.WhichOneof("message")
                if kind == "call":
                    call = codec.from_call(message.call)
                    with self._lock:
                        self._methods[call[0]] = call[1]
                    self._calls.put(call)
                elif kind == "attached":
                    self._catalog = codec.from_attached(message.attached)
                    self.service = message.attached.service  # "" from an older gateway
                    self._attached.set()
                elif kind == "adopted":
                    self._adopted.set()
        except grpc.RpcError as e:  # the gateway's refusal, or the link lost
            self._error = e
        except Exception as e:  # a message this side cannot read: end the stream, so the gateway drops the rank
            self._error = e
            self._responses.cancel()
        finally:
            self._ended.set()
            self._calls.put(None)

    def failure(self) -> BaseException:
        """The domain error for the stream's end: the gateway's refusal as its own error class."""
        e = self._error
        if isinstance(e, grpc.RpcError) and isinstance(e, grpc.Call):
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.UNAVAILABLE:
                return GatewayLinkError(f"{self.name}: the gateway at {self.target} is unreachable ({details}); "
                                        "check AttachConfig.gateway and that `lora-cache serve` runs there")
            return _DOMAIN.get(code, GatewayLinkError)(f"{details} (gateway {self.target}, {code.name})")
        if e is not None:
            return GatewayLinkError(f"{self.name}: the stream to the gateway at {self.target} failed: {e}")
        return GatewayLinkError(f"{self.name}: the gateway at {self.target} ended the rank's stream")

    # -- serving ------------------------------------------------------------------------------------
    def take(self, timeout_s: float) -> list[Call]:
        with self._lock:
            due = time.monotonic() - self._last_sign >= timeout_s / 2
        if due:
            self.alive()
        try:
            first = self._calls.get(timeout=timeout_s)
        except queue.Empty:
            return []
        calls = [first]
        while not self._calls.empty():
            calls.append(self._calls.get_nowait())
        if None in calls:
            self._calls.put(None)  # every later take sees the end too
            raise self.failure()
        return [c for c in calls if c is not None]

    def answer(self, results: list[Answer]) -> None:
        for ident, ok, value in results:
            with self._lock:
                method = self._methods.pop(ident)
                self._last_sign = time.monotonic()
            try:
                message = codec.answer(ident, method, ok, value)
            except Exception as e:  # a result that does not encode: the controller's call fails with why
                message = codec.answer(ident, method, False, e)
            self._up.put(pb.AttachRankRequest(answer=message))

    def alive(self) -> None:
        with self._lock:
            self._last_sign = time.monotonic()
        self._up.put(pb.AttachRankRequest(alive=pb.RankAlive()))

    def send_deltas(self, name: str, incarnation: int, batch: list[DeltaRow]) -> None:
        if self._ended.is_set():
            raise self.failure()
        self._up.put(pb.AttachRankRequest(deltas=codec.deltas(incarnation, batch)))

    def send_queue(self, replica: str, entries: list[tuple[str, float]]) -> None:
        requests = []
        for adapter, arrival in entries:
            stamp = Timestamp()
            stamp.FromNanoseconds(int(arrival * 1e9))
            requests.append(pb.QueuedRequest(adapter=adapter, arrival_time=stamp))
        self._stub.ReportQueue(pb.ReportQueueRequest(replica=replica, requests=requests), metadata=self._metadata,
                               timeout=30)

    def resolve(self, name: str, timeout_s: float) -> str:
        try:
            answer = self._stub.ResolveAdapter(pb.ResolveAdapterRequest(name=name), metadata=self._metadata,
                                               timeout=timeout_s)
        except grpc.RpcError as e:
            if not isinstance(e, grpc.Call) or e.code() == grpc.StatusCode.UNAVAILABLE:
                raise GatewayLinkError(f"{self.name}: resolving {name!r}: the gateway at {self.target} is "
                                       f"unreachable ({e})") from e
            raise _DOMAIN.get(e.code(), GatewayLinkError)(f"{e.details()} (gateway {self.target}, "
                                                            f"{e.code().name})") from e
        return str(answer.version)

    def fetch_pushed(self, name: str, tag: str) -> tuple[bytes, np.ndarray]:
        """The gateway's ``FetchPushed`` stream gathered: (config, weights as uint8); a stream that ends short of
        the size its first message announced (or runs past it) is a ``GatewayLinkError``, nothing taken."""
        first, weights, filled, overrun = None, np.empty(0, dtype=np.uint8), 0, False
        try:
            stream = self._stub.FetchPushed(pb.FetchPushedRequest(name=name, tag=tag), metadata=self._metadata,
                                            timeout=PAYLOAD_S)
            for message in stream:
                if first is None:  # the config and the whole size
                    first, weights = message, np.empty(message.total_bytes, dtype=np.uint8)
                chunk = np.frombuffer(message.weights, dtype=np.uint8)
                overrun = filled + chunk.size > weights.size  # past the size announced
                if overrun:
                    stream.cancel()
                    break
                weights[filled:filled + chunk.size] = chunk
                filled += chunk.size
        except grpc.RpcError as e:
            if not isinstance(e, grpc.Call) or e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise GatewayLinkError(f"{self.name}: fetching pushed {name}@{tag}: the gateway at {self.target} is "
                                       f"unreachable ({e})") from e
            raise _DOMAIN.get(e.code(), GatewayLinkError)(f"{e.details()} (gateway {self.target}, "
                                                          f"{e.code().name})") from e
        if first is None or overrun or filled != weights.size:
            raise GatewayLinkError(f"{self.name}: the gateway's bytes of pushed {name}@{tag} were not the "
                                   f"{weights.size} it announced; nothing was copied, the next registration retries")
        return bytes(first.config_json), weights

    # -- leaving ------------------------------------------------------------------------------------
    def close(self, hello: Hello) -> None:
        """Half-close the stream (the detach) and wait for the gateway to drop the rank and end it."""
        if self._closed:
            return
        self._closed = True
        self._up.put(None)
        if self._responses is not None and not self._ended.wait(CLOSE_S):
            self._responses.cancel()  # the gateway's own end of the stream drops the rank all the same
        self._channel.close()
