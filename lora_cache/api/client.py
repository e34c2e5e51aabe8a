"""A small Python client of the gateway for routers: ``LoraCacheClient`` (sync) and ``AsyncLoraCacheClient``.

    with LoraCacheClient("127.0.0.1:50051", token="...") as lc:
        lc.hint([Hint("req-17", "adapter-003", "replica-1", expected_in_s=0.2)])
        lc.lookup("adapter-003").ready          # ('replica-1',) once loaded
        lc.route(["adapter-003"])[0].replicas[0]   # RoutedReplica('replica-1', 'ready', 0.0, True)
        for event in lc.watch(replica="replica-1"): ...   # ReadinessEvent, or a Resync if events were lost

Errors come back as ClientError with the gRPC status code name and the server's message. The channel
(``CHANNEL_OPTIONS``) retries calls that are safe to repeat when the gateway is UNAVAILABLE (a restart, a
dropped connection; ``RETRY_POLICY``), and keeps long streams (``WatchReadiness``, ``AttachRank``) alive
through idle proxies and load balancers with HTTP/2 pings (``KEEPALIVE``).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lora_cache.api import client_values as msg
from lora_cache.api.client_values import (
    ClientError,
    Hint,
    HintRejected,
    HintResult,
    Lookup,
    Pushed,
    ReadinessEvent,
    Registered,
    Resync,
    Route,
    RoutedReplica,
    RouteItem,
)
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc
from lora_cache.errors import ConfigError

__all__ = [
    "CHANNEL_OPTIONS",
    "KEEPALIVE",
    "AsyncLoraCacheClient",
    "ClientConfig",
    "ClientError",
    "Hint",
    "HintRejected",
    "HintResult",
    "Lookup",
    "LoraCacheClient",
    "ReadinessEvent",
    "Registered",
    "Resync",
    "Route",
    "RouteItem",
    "RoutedReplica",
]  # the values are client_values', named here as before

TOKEN_ENV = "LORA_CACHE_TOKEN"
PUSH_BYTES_PER_S = 50e6  # a push's deadline grows by its bytes at this rate (the gateway, the hash, the ranks)
PUSH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['LoraCacheService'].full_name}/PushAdapter"


def push_call(channel: Any) -> Any:
    """``PushAdapter`` on ``channel`` (sync or asyncio) taking its messages as the bytes on the wire
    (``client_values.push_wire``: no message objects for the weights)."""
    return channel.stream_stream(PUSH_METHOD, request_serializer=None,
                                 response_deserializer=pb.PushAdapterResponse.FromString)
REGISTER_S_PER_ITEM = 0.5  # RegisterAdapters' deadline grows by this per item (an 8B adapter hashes in ~0.13 s)

# Calls that change nothing, or that the server deduplicates (hint ids; registrations by their request id, which
# this client gives every item), are retried on UNAVAILABLE; ReportQueue (a replica's queue now) is too: the next
# report replaces it. UnregisterAdapter is not.
IDEMPOTENT = ("Hint", "CancelHint", "ReportQueue", "Lookup", "Route", "Status", "RegisterAdapter", "RegisterAdapters",
              "ResolveAdapter")
# Three attempts within ~0.15 s of backoff: a gateway that restarts or a connection that was reset is
# covered; one that stays down answers UNAVAILABLE well within the call's deadline (not DEADLINE_EXCEEDED).
RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}
SERVICE_CONFIG = {"methodConfig": [
    {"name": [{"service": "lora_cache.v1.LoraCacheService", "method": m} for m in IDEMPOTENT],
     "retryPolicy": RETRY_POLICY},
    {"name": [{"service": "grpc.health.v1.Health", "method": "Check"}], "retryPolicy": RETRY_POLICY},
]}
# A ping every 30 s on an open connection (a stream with nothing to say included): a connection that a
# NAT or load balancer dropped is found within 30 + 10 s, not at the next message. The gateway allows it
# (``GatewayConfig``'s server options: pings without data every 10 s at most).
KEEPALIVE = (("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0))
CHANNEL_OPTIONS = (("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1), *KEEPALIVE)


@dataclass(frozen=True)
class ClientConfig:
    """How to reach a lora-cache gateway."""

    server: str = field(default="127.0.0.1:50051", metadata={"help": "gateway address host:port"})
    token_file: str = field(default="", metadata={"path": True,
        "help": f"file holding the bearer token (default: ${TOKEN_ENV} if set, else none)"})
    tls_ca: str = field(default="", metadata={
        "path": True, "help": "PEM file of the CA that signed the gateway's certificate (uses TLS)"})
    tls: bool = field(default=False, metadata={"help": "use TLS with the system's root certificates"})
    tls_client_cert: str = field(default="", metadata={
        "path": True, "help": "PEM certificate this client presents (a gateway with --tls-client-ca; uses TLS)"})
    tls_client_key: str = field(default="", metadata={"path": True, "help": "PEM private key of --tls-client-cert"})
    timeout_s: float = field(default=10.0, metadata={"help": "deadline of each call, in seconds"})

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s is {self.timeout_s}; give a positive number of seconds, e.g. 10")
        if self.tls_ca and not Path(self.tls_ca).is_file():
            raise ConfigError(f"tls_ca {self.tls_ca!r} is not a file; give the CA's PEM certificate file")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ConfigError(f"tls_client_cert ({self.tls_client_cert!r}) and tls_client_key "
                              f"({self.tls_client_key!r}) go together; give both to present a client certificate")
        for name in ("tls_client_cert", "tls_client_key"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ConfigError(f"{name} {getattr(self, name)!r} is not a file; give a PEM file path")
        if self.token_file and not Path(self.token_file).is_file():
            raise ConfigError(f"--token-file {self.token_file!r} is not a file; write the gateway's bearer token into "
                              f"it, or leave it out (then ${TOKEN_ENV} is used, if set)")

    def token(self) -> str | None:
        if self.token_file:
            return Path(self.token_file).read_text().strip() or None
        return os.environ.get(TOKEN_ENV) or None


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


C = TypeVar("C", bound="_Base")


class _Base:
    def __init__(self, server: str = "127.0.0.1:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None,
                 client_key: bytes | None = None, timeout_s: float = 10.0) -> None:
        """``client_cert``/``client_key``: the PEM certificate chain and key this client presents to a gateway
        that asks for one (mutual TLS, ``--tls-client-ca``); they imply TLS."""
        if (client_cert is None) != (client_key is None):
            raise ConfigError("client_cert and client_key go together; give both to present a client certificate")
        self.server, self.timeout_s = server, timeout_s
        self._metadata = _metadata(token)
        self._options = [("grpc.max_receive_message_length", 64 << 20), *CHANNEL_OPTIONS]
        secure = tls or root_certificates is not None or client_cert is not None
        self._credentials = grpc.ssl_channel_credentials(root_certificates, client_key, client_cert) if secure else None

    @classmethod
    def from_config(cls: type[C], config: ClientConfig) -> C:
        root = Path(config.tls_ca).read_bytes() if config.tls_ca else None
        cert, key = ((Path(config.tls_client_cert).read_bytes(), Path(config.tls_client_key).read_bytes())
                     if config.tls_client_cert else (None, None))
        return cls(config.server, token=config.token(), tls=config.tls, root_certificates=root, client_cert=cert,
                   client_key=key, timeout_s=config.timeout_s)


class LoraCacheClient(_Base):
    """Blocking client; one channel, closed by ``close()`` or the ``with`` block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        creds, server = self._credentials, self.server
        self.channel = (grpc.secure_channel(server, creds, self._options) if creds
                        else grpc.insecure_channel(server, self._options))
        self.stub = pb_grpc.LoraCacheServiceStub(self.channel)

    def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from e

    def hint(self, hints: Iterable[Hint | tuple[Any, ...]]) -> HintResult:
        r = self._call(self.stub.Hint, msg.hint_request(hints))
        return msg.hint_result(r)

    def cancel_hint(self, *hint_ids: str) -> int:
        return int(self._call(self.stub.CancelHint, pb.CancelHintRequest(hint_ids=hint_ids)).cancelled)

    def report_queue(self, replica: str, queue: Iterable[tuple[str, float]]) -> int:
        """``queue``: (adapter, arrival time in seconds since the epoch), in queue order."""
        return int(self._call(self.stub.ReportQueue, msg.queue_request(replica, queue)).queue_depth)

    def lookup(self, adapter: str) -> Lookup:
        return msg.lookup(self._call(self.stub.Lookup, pb.LookupRequest(adapter=adapter)))

    def route(self, items: Iterable[str | RouteItem | tuple[Any, ...]], outstanding: dict[str, int] | None = None,
              max_replicas: int = 0, finished: Iterable[tuple[str, str]] = ()) -> list[Route]:
        """Replicas ranked for each request's adapter (an adapter name or a ``RouteItem``), in order;
        ``outstanding``: your own in-flight count per replica; ``max_replicas``: per item (0: all); ``finished``:
        with ``outstanding``, your requests that finished since your last call, each once, as (replica, adapter
        as routed): Route then knows which adapters still run where (a replica's adapter lanes)."""
        return msg.routes(self._call(self.stub.Route, msg.route_request(items, outstanding, max_replicas, finished)))

    def watch(self, replica: str | None = None, adapter: str | None = None, after_seq: int | None = None,
              duration_s: float | None = None) -> Iterator[ReadinessEvent | Resync]:
        """Readiness events until the caller stops iterating (the stream is then cancelled), or for
        ``duration_s`` (the stream's deadline; then the iteration ends). A ``Resync`` in the stream says
        events were lost: take its ``ready`` set as the state, then go on."""
        stream = self.stub.WatchReadiness(msg.watch_request(replica, adapter, after_seq), metadata=self._metadata,
                                          timeout=duration_s)
        try:
            for response in stream:
                yield from msg.events(response)
        except grpc.RpcError as e:
            if duration_s is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                return  # the watch ran its time
            raise ClientError.from_rpc(e) from e
        finally:
            stream.cancel()

    def status(self) -> pb.StatusResponse:
        return self._call(self.stub.Status, pb.StatusRequest())

    def resize_pool(self, replica: str, lent_bytes: int, keep: Iterable[str] = ()) -> pb.ResizePoolResponse:
        """Every rank of ``replica`` lends ``lent_bytes`` of its GPU adapter pool to its engine in all, whole pages
        (0: every page back); ``keep``: adapters needed soon, evicted last. Each rank's pool afterwards."""
        return self._call(self.stub.ResizePool, pb.ResizePoolRequest(replica=replica, lent_bytes=lent_bytes,
                                                                      keep_adapters=list(keep)))

    def register(self, name: str, path: str, request_id: str | None = None) -> Registered:
        """Register ``name`` at ``path``. ``request_id`` (default: a fresh one): a call again with the same id, name
        and path, after an answer was lost, is answered as the first was and registers nothing."""
        r = self._call(self.stub.RegisterAdapter, msg.register_item(name, path, request_id))
        return Registered(r.name, r.version, r.previous_version, rank_pending=tuple(r.pending_ranks))

    def register_many(self, items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> list[Registered]:
        """Register (name, path[, request id]) items in one call, each by itself: an item's ``error`` says why it
        was not."""
        request = msg.register_request(items)
        wait = self.timeout_s + REGISTER_S_PER_ITEM * len(request.adapters)
        return msg.registered(self._call(self.stub.RegisterAdapters, request, wait))

    def push(self, name: str, tensors: Any, config: Any, tag: str | int | None = None,
             timeout_s: float | None = None) -> Pushed:
        """Push a new version of ``name`` from this process's memory (no file written): ``tensors`` PEFT-named
        (CPU or GPU) or safetensors bytes, ``config`` PEFT's LoraConfig (a dict, JSON, or ``peft.LoraConfig``),
        ``tag`` the trainer's version (a step number; None: the content's hash). It becomes the current version
        once every rank has it registered; a refused push (INVALID_ARGUMENT naming the tensor) changes nothing."""
        config_bytes, weights = msg.push_payload(tensors, config)
        wait = (timeout_s or self.timeout_s) + len(weights) / PUSH_BYTES_PER_S
        try:
            stream = push_call(self.channel)(msg.push_wire(name, tag, config_bytes, weights), timeout=wait,
                                             metadata=self._metadata)
            return msg.pushed(next(iter(stream)))
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from e

    def resolve(self, name: str, timeout_s: float | None = None) -> str:
        """The current version of ``name``, registered on demand if nobody did and it lies under an adapter root
        (NOT_FOUND, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED as a ClientError otherwise)."""
        return str(self._call(self.stub.ResolveAdapter, pb.ResolveAdapterRequest(name=name),
                              timeout_s or self.timeout_s).version)

    def unregister(self, name: str, drain_timeout_s: float | None = None) -> list[str]:
        """Remove ``name`` once no running batch uses it; the versions evicted."""
        wait = (drain_timeout_s or 30.0) + self.timeout_s
        r = self._call(self.stub.UnregisterAdapter, msg.unregister_request(name, drain_timeout_s), wait)
        return list(r.evicted_versions)

    def health(self, service: str = "") -> str:
        """The health service's answer (SERVING, NOT_SERVING, ...); needs no token."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> LoraCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLoraCacheClient(_Base):
    """The same calls for asyncio routers (grpc.aio); ``await client.close()`` or ``async with``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        creds, server = self._credentials, self.server
        self.channel = (grpc.aio.secure_channel(server, creds, self._options) if creds
                        else grpc.aio.insecure_channel(server, self._options))
        self.stub = pb_grpc.LoraCacheServiceStub(self.channel)

    async def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from e

    async def hint(self, hints: Iterable[Hint | tuple[Any, ...]]) -> HintResult:
        r = await self._call(self.stub.Hint, msg.hint_request(hints))
        return msg.hint_result(r)

    async def cancel_hint(self, *hint_ids: str, timeout_s: float | None = None) -> int:
        return int((await self._call(self.stub.CancelHint, pb.CancelHintRequest(hint_ids=hint_ids),
                                     timeout_s)).cancelled)

    async def report_queue(self, replica: str, queue: Iterable[tuple[str, float]]) -> int:
        return int((await self._call(self.stub.ReportQueue, msg.queue_request(replica, queue))).queue_depth)

    async def lookup(self, adapter: str) -> Lookup:
        return msg.lookup(await self._call(self.stub.Lookup, pb.LookupRequest(adapter=adapter)))

    async def route(self, items: Iterable[str | RouteItem | tuple[Any, ...]], outstanding: dict[str, int] | None = None,
                    max_replicas: int = 0, timeout_s: float | None = None,
                    finished: Iterable[tuple[str, str]] = ()) -> list[Route]:
        """As ``LoraCacheClient.route``; ``timeout_s``: this call's deadline (a router's is short)."""
        request = msg.route_request(items, outstanding, max_replicas, finished)
        return msg.routes(await self._call(self.stub.Route, request, timeout_s))

    async def hint_within(self, hints: Iterable[Hint | tuple[Any, ...]], timeout_s: float) -> HintResult:
        """``hint`` with this call's own deadline."""
        r = await self._call(self.stub.Hint, msg.hint_request(hints), timeout_s)
        return msg.hint_result(r)

    async def watch(self, replica: str | None = None, adapter: str | None = None, after_seq: int | None = None,
                    duration_s: float | None = None) -> AsyncIterator[ReadinessEvent | Resync]:
        stream = self.stub.WatchReadiness(msg.watch_request(replica, adapter, after_seq), metadata=self._metadata,
                                          timeout=duration_s)
        try:
            async for response in stream:
                for event in msg.events(response):
                    yield event
        except grpc.RpcError as e:
            if duration_s is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise ClientError.from_rpc(e) from e
        finally:
            stream.cancel()

    async def status(self) -> pb.StatusResponse:
        return await self._call(self.stub.Status, pb.StatusRequest())

    async def resize_pool(self, replica: str, lent_bytes: int, keep: Iterable[str] = ()) -> pb.ResizePoolResponse:
        """``LoraCacheClient.resize_pool``."""
        return await self._call(self.stub.ResizePool, pb.ResizePoolRequest(replica=replica, lent_bytes=lent_bytes,
                                                                            keep_adapters=list(keep)))

    async def push(self, name: str, tensors: Any, config: Any, tag: str | int | None = None,
                   timeout_s: float | None = None) -> Pushed:
        """``LoraCacheClient.push``."""
        config_bytes, weights = msg.push_payload(tensors, config)
        wait = (timeout_s or self.timeout_s) + len(weights) / PUSH_BYTES_PER_S
        try:
            stream = push_call(self.channel)(msg.push_wire(name, tag, config_bytes, weights), timeout=wait,
                                             metadata=self._metadata)
            async for response in stream:
                return msg.pushed(response)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e) from e
        raise ClientError("UNKNOWN", f"push of {name!r} ended with no answer; push again")

    async def resolve(self, name: str, timeout_s: float | None = None) -> str:
        r = await self._call(self.stub.ResolveAdapter, pb.ResolveAdapterRequest(name=name), timeout_s or self.timeout_s)
        return str(r.version)

    async def register(self, name: str, path: str, request_id: str | None = None) -> Registered:
        r = await self._call(self.stub.RegisterAdapter, msg.register_item(name, path, request_id))
        return Registered(r.name, r.version, r.previous_version, rank_pending=tuple(r.pending_ranks))

    async def register_many(self, items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> list[Registered]:
        request = msg.register_request(items)
        wait = self.timeout_s + REGISTER_S_PER_ITEM * len(request.adapters)
        return msg.registered(await self._call(self.stub.RegisterAdapters, request, wait))

    async def unregister(self, name: str, drain_timeout_s: float | None = None) -> list[str]:
        wait = (drain_timeout_s or 30.0) + self.timeout_s
        r = await self._call(self.stub.UnregisterAdapter, msg.unregister_request(name, drain_timeout_s), wait)
        return list(r.evicted_versions)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncLoraCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
