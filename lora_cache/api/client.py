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
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc
from lora_cache.errors import ConfigError, LoraCacheError

TOKEN_ENV = "LORA_CACHE_TOKEN"
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


class ClientError(LoraCacheError):
    """A call failed: ``code`` is the gRPC status code name (NOT_FOUND, INVALID_ARGUMENT, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> ClientError:
        code, details = error.code(), error.details()  # type: ignore[attr-defined]
        return cls(code.name if code is not None else "UNKNOWN", details or "")


class Hint(NamedTuple):
    """A request for ``adapter`` is heading to ``replica`` (``expected_in_s`` from now; None: now)."""

    hint_id: str
    adapter: str
    replica: str
    expected_in_s: float | None = None
    high_priority: bool = False


@dataclass(frozen=True)
class HintRejected:  # a dataclass: a NamedTuple field may not be called ``index``
    """One hint of a call that was not taken: its position in the call, its id, why (a NOT_FOUND or
    INVALID_ARGUMENT ClientError whose message says the fix). The other hints of the call were answered as usual."""

    index: int
    hint_id: str
    error: ClientError


class HintResult(NamedTuple):
    accepted: int
    ignored: int  # known ids (retries), stale, or the replica's hint table full
    rejections: tuple[HintRejected, ...] = ()  # wrong hints, each by itself: fix and send them again


class Lookup(NamedTuple):
    adapter: str
    version: str
    ready: tuple[str, ...]
    loading: tuple[str, ...]


class RouteItem(NamedTuple):
    """One request to route (``version`` empty: the current one; ``request_id`` is echoed back)."""

    adapter: str
    version: str = ""
    request_id: str = ""
    tokens: int = 0


class RoutedReplica(NamedTuple):
    replica: str
    reason: str  # ready | loading | staged | cold
    expected_wait_s: float
    within_bound: bool  # False: over the load bound (ranked after every replica with room)


class Route(NamedTuple):
    """The advice for one item: replicas best first, or this item's own error (the others are routed)."""

    adapter: str
    version: str
    request_id: str
    replicas: tuple[RoutedReplica, ...]
    error: ClientError | None = None


class ReadinessEvent(NamedTuple):
    seq: int
    replica: str
    adapter: str
    version: str
    ready: bool


class Resync(NamedTuple):
    """The watch fell behind (or its cursor was from before a controller restart): events after
    ``lost_after`` may be missing. ``ready`` is the whole ready set now, (replica, adapter, version);
    the stream goes on with the events after ``seq``."""

    seq: int
    lost_after: int
    ready: tuple[tuple[str, str, str], ...]
    reason: str


class Registered(NamedTuple):
    name: str
    version: str  # "" when ``error`` is set
    previous_version: str  # "" if the name was new
    error: ClientError | None = None  # a RegisterAdapters item that was not registered (its name is unchanged)
    rank_errors: tuple[str, ...] = ()  # ranks that refused the version (registered; their loads of it fail)
    rank_pending: tuple[str, ...] = ()  # ranks that did not answer (restarting): registered, given it when back


# -- messages <-> Python values, shared by both clients ---------------------------------------------------
def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def _hint_result(r: pb.HintResponse) -> HintResult:
    return HintResult(r.accepted, r.ignored, tuple(HintRejected(x.index, x.hint_id, ClientError(
        _CODE_NAMES.get(x.code, "UNKNOWN"), x.message)) for x in r.rejections))


def _hint_request(hints: Iterable[Hint | tuple[Any, ...]]) -> pb.HintRequest:
    out = []
    for h in (Hint(*x) for x in hints):
        msg = pb.PrefetchHint(hint_id=h.hint_id, adapter=h.adapter, replica=h.replica,
                              priority=pb.HINT_PRIORITY_HIGH if h.high_priority else pb.HINT_PRIORITY_NORMAL)
        if h.expected_in_s is not None:
            msg.expected_in.CopyFrom(_duration(h.expected_in_s))
        out.append(msg)
    return pb.HintRequest(hints=out)


def _queue_request(replica: str, queue: Iterable[tuple[str, float]]) -> pb.ReportQueueRequest:
    entries = []
    for adapter, arrival_s in queue:
        ts = Timestamp()
        ts.FromNanoseconds(round(arrival_s * 1e9))
        entries.append(pb.QueuedRequest(adapter=adapter, arrival_time=ts))
    return pb.ReportQueueRequest(replica=replica, requests=entries)


def _watch_request(replica: str | None, adapter: str | None, after_seq: int | None) -> pb.WatchReadinessRequest:
    request = pb.WatchReadinessRequest(replica=replica or "", adapter=adapter or "")
    if after_seq is not None:
        request.after_seq = after_seq
    return request


def _events(response: pb.WatchReadinessResponse) -> list[ReadinessEvent | Resync]:
    if response.HasField("resync"):
        r = response.resync
        ready = tuple((x.replica, x.adapter, x.version) for x in r.ready_residencies)
        return [Resync(r.resume_after_seq, r.lost_after_seq, ready, r.reason)]
    return [ReadinessEvent(e.seq, e.replica, e.adapter, e.version, e.state == pb.READINESS_STATE_READY)
            for e in response.events]


def _lookup(r: pb.LookupResponse) -> Lookup:
    return Lookup(r.adapter, r.version, tuple(r.ready_replicas), tuple(r.loading_replicas))


_REASONS = {pb.ROUTE_REASON_READY: "ready", pb.ROUTE_REASON_LOADING: "loading", pb.ROUTE_REASON_STAGED: "staged",
            pb.ROUTE_REASON_COLD: "cold"}


def _route_request(items: Iterable[str | RouteItem | tuple[Any, ...]], outstanding: dict[str, int] | None,
                   max_replicas: int) -> pb.RouteRequest:
    out = [RouteItem(x) if isinstance(x, str) else RouteItem(*x) for x in items]
    return pb.RouteRequest(items=[pb.RouteItem(**i._asdict()) for i in out], outstanding_requests=outstanding or {},
                           max_replicas=max_replicas)


def _routes(r: pb.RouteResponse) -> list[Route]:
    out = []
    for a in r.items:
        code = _CODE_NAMES.get(a.error.code, "UNKNOWN")
        error = ClientError(code, a.error.message) if a.HasField("error") else None
        replicas = tuple(RoutedReplica(x.replica, _REASONS.get(x.reason, "unspecified"),
                                       x.expected_wait.ToNanoseconds() / 1e9, x.within_bound) for x in a.replicas)
        out.append(Route(a.adapter, a.version, a.request_id, replicas, error))
    return out


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _register_request(items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> pb.RegisterAdaptersRequest:
    """Each (name, path[, request id]) item; an item without an id gets a fresh one (a retry of this request,
    by the channel or by the caller with the same request, is then answered as the first was)."""
    return pb.RegisterAdaptersRequest(adapters=[_register_item(*item) for item in items])


def _register_item(name: str, path: str, request_id: str | None = None) -> pb.RegisterAdapterRequest:
    return pb.RegisterAdapterRequest(name=name, path=path, request_id=request_id or uuid.uuid4().hex)


def _registered(r: pb.RegisterAdaptersResponse) -> list[Registered]:
    return [Registered(a.name, a.version, a.previous_version,
                       ClientError(_CODE_NAMES.get(a.error.code, "UNKNOWN"), a.error.message)
                       if a.HasField("error") else None, tuple(a.rank_errors), tuple(a.pending_ranks))
            for a in r.adapters]


def _unregister_request(name: str, drain_timeout_s: float | None) -> pb.UnregisterAdapterRequest:
    request = pb.UnregisterAdapterRequest(name=name)
    if drain_timeout_s is not None:
        request.drain_timeout.CopyFrom(_duration(drain_timeout_s))
    return request


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
        r = self._call(self.stub.Hint, _hint_request(hints))
        return _hint_result(r)

    def cancel_hint(self, *hint_ids: str) -> int:
        return int(self._call(self.stub.CancelHint, pb.CancelHintRequest(hint_ids=hint_ids)).cancelled)

    def report_queue(self, replica: str, queue: Iterable[tuple[str, float]]) -> int:
        """``queue``: (adapter, arrival time in seconds since the epoch), in queue order."""
        return int(self._call(self.stub.ReportQueue, _queue_request(replica, queue)).queue_depth)

    def lookup(self, adapter: str) -> Lookup:
        return _lookup(self._call(self.stub.Lookup, pb.LookupRequest(adapter=adapter)))

    def route(self, items: Iterable[str | RouteItem | tuple[Any, ...]], outstanding: dict[str, int] | None = None,
              max_replicas: int = 0) -> list[Route]:
        """Replicas ranked for each request's adapter (an adapter name or a ``RouteItem``), in order;
        ``outstanding``: your own in-flight count per replica; ``max_replicas``: per item (0: all)."""
        return _routes(self._call(self.stub.Route, _route_request(items, outstanding, max_replicas)))

    def watch(self, replica: str | None = None, adapter: str | None = None, after_seq: int | None = None,
              duration_s: float | None = None) -> Iterator[ReadinessEvent | Resync]:
        """Readiness events until the caller stops iterating (the stream is then cancelled), or for
        ``duration_s`` (the stream's deadline; then the iteration ends). A ``Resync`` in the stream says
        events were lost: take its ``ready`` set as the state, then go on."""
        stream = self.stub.WatchReadiness(_watch_request(replica, adapter, after_seq), metadata=self._metadata,
                                          timeout=duration_s)
        try:
            for response in stream:
                yield from _events(response)
        except grpc.RpcError as e:
            if duration_s is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                return  # the watch ran its time
            raise ClientError.from_rpc(e) from e
        finally:
            stream.cancel()

    def status(self) -> pb.StatusResponse:
        return self._call(self.stub.Status, pb.StatusRequest())

    def register(self, name: str, path: str, request_id: str | None = None) -> Registered:
        """Register ``name`` at ``path``. ``request_id`` (default: a fresh one): a call again with the same id, name
        and path, after an answer was lost, is answered as the first was and registers nothing."""
        r = self._call(self.stub.RegisterAdapter, _register_item(name, path, request_id))
        return Registered(r.name, r.version, r.previous_version, rank_pending=tuple(r.pending_ranks))

    def register_many(self, items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> list[Registered]:
        """Register (name, path[, request id]) items in one call, each by itself: an item's ``error`` says why it
        was not."""
        request = _register_request(items)
        wait = self.timeout_s + REGISTER_S_PER_ITEM * len(request.adapters)
        return _registered(self._call(self.stub.RegisterAdapters, request, wait))

    def resolve(self, name: str, timeout_s: float | None = None) -> str:
        """The current version of ``name``, registered on demand if nobody did and it lies under an adapter root
        (NOT_FOUND, RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED as a ClientError otherwise)."""
        return str(self._call(self.stub.ResolveAdapter, pb.ResolveAdapterRequest(name=name),
                              timeout_s or self.timeout_s).version)

    def unregister(self, name: str, drain_timeout_s: float | None = None) -> list[str]:
        """Remove ``name`` once no running batch uses it; the versions evicted."""
        wait = (drain_timeout_s or 30.0) + self.timeout_s
        r = self._call(self.stub.UnregisterAdapter, _unregister_request(name, drain_timeout_s), wait)
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
        r = await self._call(self.stub.Hint, _hint_request(hints))
        return _hint_result(r)

    async def cancel_hint(self, *hint_ids: str, timeout_s: float | None = None) -> int:
        return int((await self._call(self.stub.CancelHint, pb.CancelHintRequest(hint_ids=hint_ids),
                                     timeout_s)).cancelled)

    async def report_queue(self, replica: str, queue: Iterable[tuple[str, float]]) -> int:
        return int((await self._call(self.stub.ReportQueue, _queue_request(replica, queue))).queue_depth)

    async def lookup(self, adapter: str) -> Lookup:
        return _lookup(await self._call(self.stub.Lookup, pb.LookupRequest(adapter=adapter)))

    async def route(self, items: Iterable[str | RouteItem | tuple[Any, ...]], outstanding: dict[str, int] | None = None,
                    max_replicas: int = 0, timeout_s: float | None = None) -> list[Route]:
        """As ``LoraCacheClient.route``; ``timeout_s``: this call's deadline (a router's is short)."""
        request = _route_request(items, outstanding, max_replicas)
        return _routes(await self._call(self.stub.Route, request, timeout_s))

    async def hint_within(self, hints: Iterable[Hint | tuple[Any, ...]], timeout_s: float) -> HintResult:
        """``hint`` with this call's own deadline."""
        r = await self._call(self.stub.Hint, _hint_request(hints), timeout_s)
        return _hint_result(r)

    async def watch(self, replica: str | None = None, adapter: str | None = None, after_seq: int | None = None,
                    duration_s: float | None = None) -> AsyncIterator[ReadinessEvent | Resync]:
        stream = self.stub.WatchReadiness(_watch_request(replica, adapter, after_seq), metadata=self._metadata,
                                          timeout=duration_s)
        try:
            async for response in stream:
                for event in _events(response):
                    yield event
        except grpc.RpcError as e:
            if duration_s is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise ClientError.from_rpc(e) from e
        finally:
            stream.cancel()

    async def status(self) -> pb.StatusResponse:
        return await self._call(self.stub.Status, pb.StatusRequest())

    async def resolve(self, name: str, timeout_s: float | None = None) -> str:
        r = await self._call(self.stub.ResolveAdapter, pb.ResolveAdapterRequest(name=name), timeout_s or self.timeout_s)
        return str(r.version)

    async def register(self, name: str, path: str, request_id: str | None = None) -> Registered:
        r = await self._call(self.stub.RegisterAdapter, _register_item(name, path, request_id))
        return Registered(r.name, r.version, r.previous_version, rank_pending=tuple(r.pending_ranks))

    async def register_many(self, items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> list[Registered]:
        request = _register_request(items)
        wait = self.timeout_s + REGISTER_S_PER_ITEM * len(request.adapters)
        return _registered(await self._call(self.stub.RegisterAdapters, request, wait))

    async def unregister(self, name: str, drain_timeout_s: float | None = None) -> list[str]:
        wait = (drain_timeout_s or 30.0) + self.timeout_s
        r = await self._call(self.stub.UnregisterAdapter, _unregister_request(name, drain_timeout_s), wait)
        return list(r.evicted_versions)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncLoraCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
