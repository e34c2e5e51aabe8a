"""The AttachRank stream's messages <-> the Python values of the relay (docs/integrating.md, "Outside the
Ray cluster"): the controller's calls on a rank and their answers, residency deltas, the catalog config.

Plain functions shared by the gateway (``lora_cache/api/rank_link.py``) and the engine's side
(``workers/attach/grpc_transport.py``). A call's answer is decoded by the method it answers (the caller knows which
call it made). An error answer carries its class name: lora-cache's own error classes are raised again
as themselves in the controller (a ``ConfigError`` stays one), any other class as ``RelayedCallError``.
Malformed input is a ``RequestError`` naming the field, the value and the fix.
"""

from __future__ import annotations

import json
from typing import Any

from lora_cache import errors
from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.device_source import DeviceSource
from lora_cache.adapters.files import BlockCrcs, FileIdentity, WeightsSource
from lora_cache.adapters.objects import StoreSource
from lora_cache.adapters.peft import KnownVersion
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.validate import RequestError
from lora_cache.vocab import Command, DeltaRow, Evict, Prefetch, Ranking, Stage

Call = tuple[int, str, tuple[Any, ...]]  # (call id, method, arguments): lora_cache/link/relay.py's


class RelayedCallError(errors.LoraCacheError):
    """A relayed call raised an error that is not one of lora-cache's own on the rank."""


_KINDS: dict[type[Any], pb.RelayedCommandKind] = {
    Prefetch: pb.RELAYED_COMMAND_KIND_PREFETCH, Evict: pb.RELAYED_COMMAND_KIND_EVICT,
    Stage: pb.RELAYED_COMMAND_KIND_STAGE, Ranking: pb.RELAYED_COMMAND_KIND_RANKING}
_STATES: dict[str, pb.ResidencyState] = {"loading": pb.RESIDENCY_STATE_LOADING, "ready": pb.RESIDENCY_STATE_READY,
           "in_use": pb.RESIDENCY_STATE_IN_USE, "gone": pb.RESIDENCY_STATE_GONE, "failed": pb.RESIDENCY_STATE_FAILED,
           "staged": pb.RESIDENCY_STATE_HOST_STAGED, "unstaged": pb.RESIDENCY_STATE_HOST_DROPPED,
           "no_room": pb.RESIDENCY_STATE_NO_ROOM, "capacity": pb.RESIDENCY_STATE_CAPACITY}
_STATE_NAMES: dict[int, str] = {int(v): k for k, v in _STATES.items()}
_ERRORS: dict[str, type[errors.LoraCacheError]] = {
    cls.__name__: cls for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.LoraCacheError)}


# -- calls (down) ------------------------------------------------------------------------------------
def command(c: Command) -> pb.RelayedCommand:
    if isinstance(c, Ranking):
        return pb.RelayedCommand(kind=pb.RELAYED_COMMAND_KIND_RANKING, epoch=c.epoch, names=c.names)
    priority = 0 if isinstance(c, Evict) else c.priority
    return pb.RelayedCommand(kind=_KINDS[type(c)], adapter=c.adapter, version=c.version, priority=priority,
                             epoch=c.epoch, speculative=isinstance(c, Stage) and c.speculative,
                             disk=isinstance(c, Stage) and c.disk)


def from_command(m: pb.RelayedCommand) -> Command:
    if m.kind == pb.RELAYED_COMMAND_KIND_EVICT:
        return Evict(m.adapter, m.version, m.epoch)
    if m.kind == pb.RELAYED_COMMAND_KIND_PREFETCH:
        return Prefetch(m.adapter, m.version, m.priority, m.epoch)
    if m.kind == pb.RELAYED_COMMAND_KIND_STAGE:
        return Stage(m.adapter, m.version, m.priority, m.epoch, m.speculative, m.disk)
    if m.kind == pb.RELAYED_COMMAND_KIND_RANKING:
        return Ranking(tuple(m.names), m.epoch)
    raise RequestError(f"command kind {m.kind} of {m.adapter!r} is not PREFETCH, EVICT, STAGE or RANKING; the gateway "
                       "is newer than this engine's lora-cache: upgrade it")


def known(k: KnownVersion) -> pb.KnownVersion:
    s = k.source
    if isinstance(s, DeviceSource):
        return pb.KnownVersion(version=k.version, config_digest=k.config_digest, host=k.host,
                               header_bytes=s.header_bytes, header_crc=s.header_crc, meta=k.meta,
                               device=pb.DeviceImage(tag=s.tag, size=s.size, ahead=s.ahead))
    if isinstance(s, StoreSource):
        return pb.KnownVersion(
            version=k.version, config_digest=k.config_digest, host=k.host, header_bytes=s.header_bytes,
            header_crc=s.header_crc, meta=k.meta,
            store=pb.StoreObject(bucket=s.bucket, key=s.key, etag=s.etag, version_id=s.version_id, size=s.size))
    return pb.KnownVersion(
        version=k.version, config_digest=k.config_digest, host=k.host, weights_path=s.path,
        identity=pb.FileIdentity(dev=s.identity.dev, ino=s.identity.ino, size=s.identity.size,
                                 mtime_ns=s.identity.mtime_ns, ctime_ns=s.identity.ctime_ns),
        header_bytes=s.header_bytes, header_crc=s.header_crc, block_crcs=s.block_crcs.packed,
        registered_ns=s.registered_ns)


def from_known(m: pb.KnownVersion) -> KnownVersion:
    if m.HasField("device"):
        device = DeviceSource(m.device.tag, m.device.size, m.header_bytes, m.header_crc, m.device.ahead)
        return KnownVersion(m.version, m.config_digest, m.host, device, m.meta)
    if m.HasField("store"):
        o = m.store
        if not (o.bucket and o.key and o.etag):
            raise RequestError(f"known version {m.version!r}: its store object names no bucket, key or ETag "
                               f"({o.bucket!r}, {o.key!r}, {o.etag!r}); send the object as registered")
        store = StoreSource(o.bucket, o.key, m.version, o.etag, o.version_id, o.size, m.header_bytes, m.header_crc)
        return KnownVersion(m.version, m.config_digest, m.host, store, m.meta)
    i = m.identity
    try:
        crcs = BlockCrcs(m.block_crcs)
    except ValueError as e:
        raise RequestError(f"known version {m.version!r}: block_crcs holds {len(m.block_crcs)} bytes, not 4 per "
                           "block; send the CRCs as little-endian uint32s") from e
    source = WeightsSource(m.weights_path, m.version, FileIdentity(i.dev, i.ino, i.size, i.mtime_ns, i.ctime_ns),
                           m.header_bytes, m.header_crc, crcs, m.registered_ns)
    return KnownVersion(m.version, m.config_digest, m.host, source)


def registration(name: str, path: str, k: KnownVersion | None) -> pb.RegisterRankAdapter:
    out = pb.RegisterRankAdapter(name=name, path=path)
    if k is not None:
        out.known.CopyFrom(known(k))
    return out


def from_registration(m: pb.RegisterRankAdapter) -> tuple[str, str, KnownVersion | None]:
    return m.name, m.path, from_known(m.known) if m.HasField("known") else None


def call(c: Call) -> pb.RelayedCall:
    ident, method, args = c
    out = pb.RelayedCall(call_id=ident)
    if method == "apply":
        out.apply.commands.extend(command(x) for x in args[0])
    elif method == "describe":
        out.describe.SetInParent()
    elif method == "register_adapter":
        out.register_adapter.CopyFrom(registration(*args, *(() if len(args) == 3 else (None,))))
    elif method == "register_adapters":
        out.register_adapters.adapters.extend(registration(*entry) for entry in args[0])
    elif method == "unregister_adapter":
        out.unregister_adapter.name = args[0]
    elif method == "stats":
        out.stats.SetInParent()
    elif method == "drop_pushed":
        name, tags, node, area = args
        out.drop_pushed.CopyFrom(pb.DropPushedCopies(name=name, tags=tags, node=node, area=area))
    else:
        raise ValueError(f"no relayed call named {method!r}")  # internal: the endpoint's methods are RELAYED
    return out


def from_call(m: pb.RelayedCall) -> Call:
    kind = m.WhichOneof("call")
    if kind == "apply":
        return m.call_id, "apply", ([from_command(c) for c in m.apply.commands],)
    if kind == "register_adapter":
        return m.call_id, "register_adapter", from_registration(m.register_adapter)
    if kind == "register_adapters":
        return m.call_id, "register_adapters", ([from_registration(r) for r in m.register_adapters.adapters],)
    if kind == "unregister_adapter":
        return m.call_id, "unregister_adapter", (m.unregister_adapter.name,)
    if kind in ("describe", "stats"):
        return m.call_id, kind, ()
    if kind == "drop_pushed":
        drop = m.drop_pushed
        return m.call_id, "drop_pushed", (drop.name, list(drop.tags), drop.node, drop.area)
    raise RequestError(f"relayed call {m.call_id} names no call ({kind!r}); the gateway is newer than this "
                       "engine's lora-cache: upgrade it")


# -- answers (up) ------------------------------------------------------------------------------------
def answer(ident: int, method: str, ok: bool, value: Any) -> pb.CallAnswer:
    """The answer of call ``ident`` (a call of ``method``): its result, or the exception it raised."""
    out = pb.CallAnswer(call_id=ident)
    if not ok:
        out.error.error_class, out.error.message = type(value).__name__, str(value)
    elif method == "apply":
        out.apply.accepted, out.apply.rejected_stale = value.accepted, value.rejected_stale
        out.apply.errors.extend(value.errors)
    elif method == "describe":
        out.describe.CopyFrom(report(value))
    elif method == "register_adapter":
        out.registered_version = value
    elif method == "register_adapters":
        out.registered.results.extend(pb.RankRegistration(version=v, error=e) for v, e in value)
    elif method == "unregister_adapter":
        out.unregistered = bool(value)
    elif method == "stats":
        out.stats_json = json.dumps(value)
    elif method == "drop_pushed":
        out.dropped.tags.extend(value)
    else:
        raise ValueError(f"no relayed call named {method!r}")
    return out


def from_answer(m: pb.CallAnswer, method: str) -> tuple[int, bool, Any]:
    """(call id, ok, value or exception) for ``Relay.answer``; a result that is not ``method``'s is a
    ``RequestError``."""
    from lora_cache.vocab import ApplyResult  # the controller reads what a worker actor returns

    kind = m.WhichOneof("result")
    if kind == "error":
        cls = _ERRORS.get(m.error.error_class)
        error = cls(m.error.message) if cls else RelayedCallError(f"{m.error.error_class}: {m.error.message}")
        return m.call_id, False, error
    expected = {"apply": "apply", "describe": "describe", "register_adapter": "registered_version",
                "register_adapters": "registered", "unregister_adapter": "unregistered",
                "stats": "stats_json", "drop_pushed": "dropped"}[method]
    if kind != expected:
        raise RequestError(f"call {m.call_id} was {method}, whose answer is {expected} or error, not {kind!r}; "
                           "answer each RelayedCall with the result of its own call")
    if kind == "apply":
        return m.call_id, True, ApplyResult(m.apply.accepted, m.apply.rejected_stale, tuple(m.apply.errors))
    if kind == "describe":
        return m.call_id, True, from_report(m.describe)
    if kind == "registered_version":
        return m.call_id, True, m.registered_version
    if kind == "registered":
        return m.call_id, True, [(r.version, r.error) for r in m.registered.results]
    if kind == "unregistered":
        return m.call_id, True, m.unregistered
    if kind == "dropped":
        return m.call_id, True, list(m.dropped.tags)
    try:
        return m.call_id, True, json.loads(m.stats_json)
    except json.JSONDecodeError as e:
        raise RequestError(f"call {m.call_id}'s stats_json is not JSON ({e}); send WorkerControl.stats() "
                           "as json.dumps") from e


def report(d: dict[str, Any]) -> pb.WorkerReport:
    """``WorkerControl.describe``'s dict as a message."""
    return pb.WorkerReport(
        replica=d["replica"], rank=d["rank"], tp=d["tp"], model=d["model"], incarnation=d["incarnation"], seq=d["seq"],
        node=d["node"], slots=d["slots"], host_bytes=d["host_bytes"], adapters=d["adapters"], epoch=d["epoch"],
        residencies=[pb.RankResidency(adapter=r[0], version=r[1], state=state(r[2]), refs=r[3],
                                      acquired=len(r) > 4 and r[4] is True) for r in d["residency"]],
        host_shards=[pb.HostShard(adapter=a, version=v) for a, v in d.get("host") or ()],
        reports_host=d.get("host") is not None, gpu_bytes=d.get("gpu_bytes") or 0, page_bytes=d.get("page_bytes") or 0,
        disk_bytes=d.get("disk_bytes") or 0)


def from_report(m: pb.WorkerReport) -> dict[str, Any]:
    return {"replica": m.replica, "rank": m.rank, "tp": m.tp, "model": m.model, "incarnation": m.incarnation,
            "seq": m.seq, "node": m.node, "slots": m.slots, "host_bytes": m.host_bytes, "adapters": dict(m.adapters),
            "epoch": m.epoch, "residency": [(r.adapter, r.version, state_name(r.state), r.refs, r.acquired)
                                            for r in m.residencies],
            "host": [(h.adapter, h.version) for h in m.host_shards] if m.reports_host else None,
            **({"gpu_bytes": m.gpu_bytes, "page_bytes": m.page_bytes} if m.page_bytes else {}),
            **({"disk_bytes": m.disk_bytes} if m.disk_bytes else {})}


# -- deltas (up) and the catalog (down) ------------------------------------------------------------
def state(name: str) -> pb.ResidencyState:
    return _STATES[name]


def state_name(value: int) -> str:
    try:
        return _STATE_NAMES[value]
    except KeyError:
        raise RequestError(f"residency state {value} is not one of {sorted(_STATE_NAMES)}; send LOADING, READY, "
                           "IN_USE, GONE, FAILED, HOST_STAGED, HOST_DROPPED, NO_ROOM or CAPACITY") from None


def deltas(incarnation: int, batch: list[DeltaRow]) -> pb.ResidencyDeltas:
    return pb.ResidencyDeltas(incarnation=incarnation, deltas=[
        pb.ResidencyDelta(seq=row[0], adapter=row[1], version=row[2], state=state(row[3]), error=row[4],
                          read_s=float(row[5]) if len(row) > 5 else 0.0,
                          acquired=bool(row[6]) if len(row) > 6 else False) for row in batch])


def from_deltas(m: pb.ResidencyDeltas) -> tuple[int, list[DeltaRow]]:
    return m.incarnation, [(d.seq, d.adapter, d.version, state_name(d.state), d.error, _read_s(d), d.acquired)
                           for d in m.deltas]


def _read_s(d: pb.ResidencyDelta) -> float:
    if not 0.0 <= d.read_s < 3600.0:  # NaN, negative or absurd: a claim the load clock must not fit
        raise RequestError(f"delta {d.seq} of {d.adapter!r}: read_s is {d.read_s}; send the seconds the load read "
                           "from storage, 0 to 3600 (0: a host-tier hit or not measured)")
    return d.read_s


def attached(config: CatalogConfig, model: str, name: str, service: str = "") -> pb.Attached:
    """``model``: the resolved shape name (the config's may be a path on the controller's host); ``service``: the
    service's name (its Ray namespace)."""
    return pb.Attached(model=model, max_rank=config.max_rank, adapter_roots=list(config.adapter_roots),
                       keep_versions=config.keep_versions, worker_name=name, service=service)


def from_attached(m: pb.Attached) -> CatalogConfig:
    return CatalogConfig(adapter_roots=tuple(m.adapter_roots), model=m.model, max_rank=m.max_rank,
                         keep_versions=m.keep_versions)
