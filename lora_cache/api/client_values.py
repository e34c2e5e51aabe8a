"""The Python client's values and their gRPC messages (``lora_cache.api.client``'s, shared by its sync and async
clients): what a router passes in (``Hint``, ``RouteItem``) and gets back (``Lookup``, ``Route``, ``Registered``,
readiness events, ``ClientError``), and the conversions to and from ``lora_cache_service.proto``'s messages. Plain
data: no channel, no call."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.errors import LoraCacheError


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
    """One request to route (``adapter`` ``A`` or ``A@REF`` for one kept version; ``version`` empty: the current
    one, else a kept version of ``A``; ``request_id`` is echoed back)."""

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


class Pushed(NamedTuple):
    """A push's answer: its tag, its version in the catalog (a content hash), the version it replaced."""

    name: str
    tag: str
    version: str
    previous_version: str  # "" if the name was new
    rank_pending: tuple[str, ...] = ()  # ranks that did not answer (restarting): given it when back


PUSH_CHUNK_BYTES = 1 << 20  # weights per PushAdapter message: well under any gateway's max_message_bytes


def push_payload(tensors: Any, config: Any) -> tuple[bytes, bytes | memoryview]:
    """(adapter_config.json's bytes, safetensors bytes) of a push. ``tensors``: a dict of PEFT-named tensors (on the
    CPU or a GPU; each copied once into the payload, ``serialize.safetensors_bytes``, a view of one buffer) or
    safetensors bytes already; ``config``: PEFT's LoraConfig as a dict, JSON text or bytes, or
    an object with ``to_dict()`` (``peft.LoraConfig``)."""
    if isinstance(tensors, (bytes, bytearray, memoryview)):
        return push_config(config), bytes(tensors)
    if not isinstance(tensors, dict) or not tensors:
        raise ClientError("INVALID_ARGUMENT", f"push tensors must be a non-empty dict of name -> tensor (PEFT's "
                          f"names, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight) or "
                          f"safetensors bytes, got {type(tensors).__name__}")
    from lora_cache.adapters.serialize import safetensors_bytes

    weights = safetensors_bytes({str(k): v for k, v in tensors.items()}, {"format": "pt"})
    return push_config(config), memoryview(weights.data)


def push_config(config: Any) -> bytes:
    """adapter_config.json's bytes of a push: ``config`` is PEFT's LoraConfig as a dict, JSON text or bytes, or an
    object with ``to_dict()`` (``peft.LoraConfig``)."""
    from lora_cache.adapters.pushed import config_json

    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, dict):
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}  # PEFT keeps sets
    return config_json(config)


def push_messages(name: str, tag: str | int | None, config: bytes, weights: bytes | memoryview,
                  chunk_bytes: int = PUSH_CHUNK_BYTES) -> Iterator[Any]:
    """The ``PushAdapterRequest`` stream of one push: the name, tag, config and size first, then the weights."""
    view = memoryview(weights).cast("B")
    yield first_message(name, tag, config, view, chunk_bytes)
    for chunk in byte_chunks(view[chunk_bytes:], chunk_bytes):
        yield pb.PushAdapterRequest(weights=chunk)


def first_message(name: str, tag: str | int | None, config: bytes, view: memoryview, chunk_bytes: int) -> Any:
    """A push's first message: the name, tag, config and size, and the weights' first chunk."""
    return pb.PushAdapterRequest(name=name, tag="" if tag is None else str(tag), config_json=config,
                                 total_bytes=len(view), weights=bytes(view[:chunk_bytes]))


WEIGHTS_FIELD = b"\x2a"  # PushAdapterRequest.weights on the wire: field 5, length-delimited (protobuf's encoding)


def push_wire(name: str, tag: str | int | None, config: bytes, weights: bytes | memoryview,
              chunk_bytes: int = PUSH_CHUNK_BYTES) -> Iterator[bytes]:
    """``push_messages`` as the bytes on the wire: the first message serialized, each later one built straight
    from the weights (``weights_wire``: one copy of them, where a message object costs three: the chunk, the
    message, its serialization). Byte for byte what protobuf writes for the same messages."""
    view = memoryview(weights).cast("B")
    yield first_message(name, tag, config, view, chunk_bytes).SerializeToString()
    for start in range(chunk_bytes, len(view), chunk_bytes):
        yield weights_wire(view[start:start + chunk_bytes])


def weights_wire(chunk: memoryview) -> bytes:
    """A ``PushAdapterRequest`` of ``chunk`` alone, serialized: field 5's tag, the length as a varint, the bytes."""
    n, length = len(chunk), bytearray()
    while n > 0x7F:
        length.append(n & 0x7F | 0x80)
        n >>= 7
    length.append(n)
    return b"".join((WEIGHTS_FIELD, length, chunk))


def byte_chunks(view: memoryview, chunk_bytes: int = PUSH_CHUNK_BYTES) -> Iterator[bytes]:
    """``view``'s bytes in messages' worth of ``chunk_bytes`` (a push's weights, up or down the wire)."""
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start:start + chunk_bytes])


def pushed(r: Any) -> Pushed:
    return Pushed(r.name, r.tag, r.version, r.previous_version, tuple(r.pending_ranks))


# -- messages <-> Python values, shared by both clients ---------------------------------------------------
def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def hint_result(r: pb.HintResponse) -> HintResult:
    return HintResult(r.accepted, r.ignored, tuple(HintRejected(x.index, x.hint_id, ClientError(
        _CODE_NAMES.get(x.code, "UNKNOWN"), x.message)) for x in r.rejections))


def hint_request(hints: Iterable[Hint | tuple[Any, ...]]) -> pb.HintRequest:
    out = []
    for h in (Hint(*x) for x in hints):
        msg = pb.PrefetchHint(hint_id=h.hint_id, adapter=h.adapter, replica=h.replica,
                              priority=pb.HINT_PRIORITY_HIGH if h.high_priority else pb.HINT_PRIORITY_NORMAL)
        if h.expected_in_s is not None:
            msg.expected_in.CopyFrom(duration(h.expected_in_s))
        out.append(msg)
    return pb.HintRequest(hints=out)


def queue_request(replica: str, queue: Iterable[tuple[str, float]]) -> pb.ReportQueueRequest:
    entries = []
    for adapter, arrival_s in queue:
        ts = Timestamp()
        ts.FromNanoseconds(round(arrival_s * 1e9))
        entries.append(pb.QueuedRequest(adapter=adapter, arrival_time=ts))
    return pb.ReportQueueRequest(replica=replica, requests=entries)


def watch_request(replica: str | None, adapter: str | None, after_seq: int | None) -> pb.WatchReadinessRequest:
    request = pb.WatchReadinessRequest(replica=replica or "", adapter=adapter or "")
    if after_seq is not None:
        request.after_seq = after_seq
    return request


def events(response: pb.WatchReadinessResponse) -> list[ReadinessEvent | Resync]:
    if response.HasField("resync"):
        r = response.resync
        ready = tuple((x.replica, x.adapter, x.version) for x in r.ready_residencies)
        return [Resync(r.resume_after_seq, r.lost_after_seq, ready, r.reason)]
    return [ReadinessEvent(e.seq, e.replica, e.adapter, e.version, e.state == pb.READINESS_STATE_READY)
            for e in response.events]


def lookup(r: pb.LookupResponse) -> Lookup:
    return Lookup(r.adapter, r.version, tuple(r.ready_replicas), tuple(r.loading_replicas))


_REASONS = {pb.ROUTE_REASON_READY: "ready", pb.ROUTE_REASON_LOADING: "loading", pb.ROUTE_REASON_STAGED: "staged",
            pb.ROUTE_REASON_COLD: "cold"}


def route_request(items: Iterable[str | RouteItem | tuple[Any, ...]], outstanding: dict[str, int] | None,
                   max_replicas: int, finished: Iterable[tuple[str, str]] = ()) -> pb.RouteRequest:
    out = [RouteItem(x) if isinstance(x, str) else RouteItem(*x) for x in items]
    return pb.RouteRequest(items=[pb.RouteItem(**i._asdict()) for i in out], outstanding_requests=outstanding or {},
                           max_replicas=max_replicas,
                           finished_requests=[pb.FinishedRequest(replica=r, adapter=a) for r, a in finished])


def routes(r: pb.RouteResponse) -> list[Route]:
    out = []
    for a in r.items:
        code = _CODE_NAMES.get(a.error.code, "UNKNOWN")
        error = ClientError(code, a.error.message) if a.HasField("error") else None
        replicas = tuple(RoutedReplica(x.replica, _REASONS.get(x.reason, "unspecified"),
                                       x.expected_wait.ToNanoseconds() / 1e9, x.within_bound) for x in a.replicas)
        out.append(Route(a.adapter, a.version, a.request_id, replicas, error))
    return out


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def register_request(items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> pb.RegisterAdaptersRequest:
    """Each (name, path[, request id]) item; an item without an id gets a fresh one (a retry of this request,
    by the channel or by the caller with the same request, is then answered as the first was)."""
    return pb.RegisterAdaptersRequest(adapters=[register_item(*item) for item in items])


def register_item(name: str, path: str, request_id: str | None = None) -> pb.RegisterAdapterRequest:
    return pb.RegisterAdapterRequest(name=name, path=path, request_id=request_id or uuid.uuid4().hex)


def registered(r: pb.RegisterAdaptersResponse) -> list[Registered]:
    return [Registered(a.name, a.version, a.previous_version,
                       ClientError(_CODE_NAMES.get(a.error.code, "UNKNOWN"), a.error.message)
                       if a.HasField("error") else None, tuple(a.rank_errors), tuple(a.pending_ranks))
            for a in r.adapters]


def unregister_request(name: str, drain_timeout_s: float | None) -> pb.UnregisterAdapterRequest:
    request = pb.UnregisterAdapterRequest(name=name)
    if drain_timeout_s is not None:
        request.drain_timeout.CopyFrom(duration(drain_timeout_s))
    return request
