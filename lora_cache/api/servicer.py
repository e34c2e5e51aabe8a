"""The LoraCacheService servicer: each RPC -> checked inputs -> controller calls (lifecycle steps 1-2, 8).

A thin shell: it forwards to the controller actor and awaits its ObjectRefs (the event loop never
blocks on Ray); hints go through the coalescing ingest. This is the only place that knows gRPC
status codes: ``status_for`` maps domain errors to them, and ``generic_handler`` decodes request
bodies itself, so bytes that are not the request message are INVALID_ARGUMENT, not a crash.
``AttachRank`` (a rank of an engine outside the Ray cluster) is one ``RankLink`` per stream
(``rank_link.py``), over the endpoint the gateway hosts for it (``rank_host.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np
import ray

from lora_cache.api import validate
from lora_cache.api.callers import CallRate, StreamLimits, check_speaks_for, client_of
from lora_cache.api.client_values import byte_chunks
from lora_cache.api.ingest import HintIngest
from lora_cache.api.push_stream import gather, parse_request
from lora_cache.api.rank_link import RankHost, RankLink
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.watch_hub import WatchHub
from lora_cache.controller.core import HintOutcome
from lora_cache.controller.readiness import ReadinessEvent, Resync
from lora_cache.errors import CapacityError, ConflictError, LoraCacheError, NotFoundError, PermissionDeniedError
from lora_cache.routing.advice import RouteAdvice

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LoraCacheService"].full_name
WATCH_POLL_S = 5.0  # the watches' one long poll of the controller lasts at most this long
HINT_ID_ECHO = 128  # a rejected hint's id is echoed back at most this long (a well-formed one is whole)
MAX_DETAILS_CHARS = 2048  # an error's message is cut here (gRPC's metadata limit is 8 KiB by default)

_UNAVAILABLE = "the controller is not reachable ({}); it restarts by itself: retry shortly"
# First match wins; the controller's own errors arrive wrapped in RayTaskError (unwrapped first).
_CODES: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode], ...] = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError,
      ConnectionError), grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ConflictError, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (LoraCacheError, grpc.StatusCode.INVALID_ARGUMENT),  # RequestError, ConfigError, AdapterError, ...
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a domain error is answered with (at most ``MAX_DETAILS_CHARS``)."""
    code, message = _status_for(error)
    if len(message) > MAX_DETAILS_CHARS:
        message = f"{message[:MAX_DETAILS_CHARS - 60]}... (cut: {len(message)} characters in all)"
    return code, message


def _status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    for kinds, code in _CODES:
        if isinstance(error, kinds):
            if code is grpc.StatusCode.UNAVAILABLE and not isinstance(error, ConnectionError):
                return code, _UNAVAILABLE.format(type(error).__name__)
            return code, str(error)
    log.exception("internal error in the gateway", exc_info=error)
    return grpc.StatusCode.INTERNAL, (f"internal error ({type(error).__name__}: {error}); this is a bug in "
                                      "lora-cache: please report it with the gateway's log")


def _counters(stats: list[dict[str, Any]]) -> pb.CacheCounters:
    total = {k: sum(int(s.get(k, 0)) for s in stats) for k in ("gpu_hits", "gpu_misses", "host_hits", "host_misses")}
    gpu, host = total["gpu_hits"] + total["gpu_misses"], total["host_hits"] + total["host_misses"]
    return pb.CacheCounters(**total, gpu_hit_rate=total["gpu_hits"] / gpu if gpu else 0.0,
                            host_hit_rate=total["host_hits"] / host if host else 0.0)


def _worker_status(w: dict[str, Any]) -> pb.WorkerStatus:
    s = w["stats"]
    if s is None:
        return pb.WorkerStatus(worker=w["worker"], rank=w["rank"], reachable=False, slots=w["slots"])
    return pb.WorkerStatus(worker=w["worker"], rank=w["rank"], reachable=True, slots=w["slots"],
                           slots_ready=s.get("slots_ready", 0), slots_loading=s.get("slots_loading", 0),
                           counters=_counters([s]))


def _resync(r: Resync) -> pb.ReadinessResync:
    ready = [pb.ReadyResidency(replica=replica, adapter=a, version=v) for replica, a, v in r.ready]
    return pb.ReadinessResync(resume_after_seq=r.resume_after, lost_after_seq=r.lost_after, reason=r.reason,
                              ready_residencies=ready)


def _event(e: ReadinessEvent) -> pb.ReadinessEvent:
    state = pb.READINESS_STATE_READY if e.ready else pb.READINESS_STATE_NOT_READY
    return pb.ReadinessEvent(seq=e.seq, replica=e.replica, adapter=e.adapter, version=e.version, state=state)


_REASONS = {"ready": pb.ROUTE_REASON_READY, "loading": pb.ROUTE_REASON_LOADING, "staged": pb.ROUTE_REASON_STAGED,
            "cold": pb.ROUTE_REASON_COLD}


def _route_error(error: BaseException) -> pb.RouteError:
    code, message = status_for(error)
    return pb.RouteError(code=code.value[0], message=message)


def _hint_rejection(index: int, hint_id: str, error: BaseException) -> pb.HintRejection:
    code, message = status_for(error)
    return pb.HintRejection(index=index, hint_id=hint_id[:HINT_ID_ECHO], code=code.value[0], message=message)


def _register_error(error: BaseException) -> pb.RegisterError:
    code, message = status_for(error)
    return pb.RegisterError(code=code.value[0], message=message)


def _advice(a: RouteAdvice, request_id: str, max_replicas: int) -> pb.RouteAdvice:
    if a.error is not None:
        return pb.RouteAdvice(adapter=a.adapter, version=a.version, request_id=request_id, error=_route_error(a.error))
    ranked = a.ranked[:max_replicas] if max_replicas else a.ranked
    replicas = [pb.RankedReplica(replica=r.replica, reason=_REASONS[r.reason.value], within_bound=r.within_bound)
                for r in ranked]
    for out, r in zip(replicas, ranked):
        out.expected_wait.FromNanoseconds(round(r.wait_s * 1e9))
    return pb.RouteAdvice(adapter=a.adapter, version=a.version, request_id=request_id, replicas=replicas)


class Servicer:
    """LoraCacheService over a controller actor handle (or anything with the same ``.remote`` methods)."""

    def __init__(self, controller: Any, ingest: HintIngest, max_items: int, watch_poll_s: float = WATCH_POLL_S,
                 rank_host: Callable[[str], RankHost] | None = None, streams: StreamLimits | None = None,
                 calls: CallRate | None = None, max_push_bytes: int = 4 << 30):
        self.controller, self.ingest = controller, ingest
        self.max_push_bytes = max_push_bytes  # the largest push's weights (``GatewayConfig.max_push_bytes``)
        self.max_items, self.watch_poll_s = max_items, watch_poll_s
        self.streams = streams or StreamLimits(per_client=64, total=256)
        self.calls = calls or CallRate(per_s=2000.0, burst=4000)  # unary calls per client (GatewayConfig's defaults)
        self.watches = WatchHub(controller, watch_poll_s)  # one controller poll for every WatchReadiness
        self.rank_host = rank_host or self._ray_rank_host  # an attached rank's cluster side, by worker name

    def _ray_rank_host(self, name: str) -> RankHost:
        from lora_cache.api.rank_host import RayRankHost  # the data plane's endpoint: only for AttachRank

        return RayRankHost(self.controller, name)

    async def hint(self, request: pb.HintRequest) -> pb.HintResponse:
        """Each hint by itself: a malformed one (here) or one naming an unknown adapter or replica (the
        controller) is rejected alone, by its position; the good ones are taken."""
        call = validate.hints(request.hints, self.max_items)
        why: dict[int, BaseException] = dict(call.malformed)
        outcome = await self.ingest.submit([h for _, h in call.items]) if call.items else HintOutcome(0, 0)
        for r in outcome.rejections:
            why[call.items[r.index][0]] = r.error  # its position in the controller's batch -> in the request
        rejected = [_hint_rejection(i, request.hints[i].hint_id, why[i]) for i in sorted(why)]
        return pb.HintResponse(accepted=outcome.accepted, ignored=outcome.ignored, rejections=rejected)

    async def cancel_hint(self, request: pb.CancelHintRequest) -> pb.CancelHintResponse:
        ids = validate.hint_ids(request.hint_ids, self.max_items)
        return pb.CancelHintResponse(cancelled=await self.controller.cancel_hints.remote(ids))

    async def report_queue(self, request: pb.ReportQueueRequest) -> pb.ReportQueueResponse:
        replica, entries = validate.queue(request, self.max_items)
        check_speaks_for(replica, "ReportQueue")  # an engine credential bound to its replicas speaks for no other
        await self.controller.report_queue.remote(replica, entries)
        return pb.ReportQueueResponse(queue_depth=len(entries))

    async def lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        adapter = validate.adapter_ref("adapter", request.adapter)
        found = await self.controller.lookup_adapter.remote(adapter)
        return pb.LookupResponse(adapter=found["adapter"], version=found["version"],
                                 ready_replicas=found["ready"], loading_replicas=found["loading"])

    async def route(self, request: pb.RouteRequest) -> pb.RouteResponse:
        call = validate.route(request, self.max_items)
        advice = await self.controller.route.remote([item for _, item in call.items], call.outstanding,
                                                    call.finished)
        answers: dict[int, pb.RouteAdvice] = {i: pb.RouteAdvice(adapter=request.items[i].adapter,
                                                                version=request.items[i].version,
                                                                request_id=call.request_ids[i], error=_route_error(e))
                                              for i, e in call.malformed.items()}
        for (i, _), a in zip(call.items, advice):
            answers[i] = _advice(a, call.request_ids[i], call.max_replicas)
        return pb.RouteResponse(items=[answers[i] for i in range(len(request.items))])

    async def watch_readiness(self, request: pb.WatchReadinessRequest) -> AsyncIterator[pb.WatchReadinessResponse]:
        replica, adapter, after = validate.watch(request)
        async for batch in self.watches.watch(replica, adapter, after):  # a lost or foreign cursor: a resync
            if batch.resync is not None:
                yield pb.WatchReadinessResponse(resync=_resync(batch.resync))
            elif batch.events:
                yield pb.WatchReadinessResponse(events=[_event(e) for e in batch.events])

    async def register_adapter(self, request: pb.RegisterAdapterRequest) -> pb.RegisterAdapterResponse:
        name, path, request_id = validate.register(request)
        done = await self.controller.register_one.remote(name, path, request_id)
        return pb.RegisterAdapterResponse(name=name, version=done.version, previous_version=done.previous,
                                          pending_ranks=done.rank_pending)

    async def register_adapters(self, request: pb.RegisterAdaptersRequest) -> pb.RegisterAdaptersResponse:
        call = validate.register_many(request, self.max_items)
        answers = {i: pb.RegisteredAdapter(name=request.adapters[i].name, error=_register_error(e))
                   for i, e in call.malformed.items()}
        done = await self.controller.register_adapters.remote(
            [(n, p) for _, (n, p, _) in call.items], [r for _, (_, _, r) in call.items]) if call.items else []
        for (i, _), d in zip(call.items, done):
            answers[i] = pb.RegisteredAdapter(name=d.name, version=d.version, previous_version=d.previous,
                                              rank_errors=d.rank_errors, pending_ranks=d.rank_pending)
            if d.error is not None:
                answers[i].error.CopyFrom(_register_error(d.error))
        return pb.RegisterAdaptersResponse(adapters=[answers[i] for i in range(len(request.adapters))])

    async def resolve_adapter(self, request: pb.ResolveAdapterRequest) -> pb.ResolveAdapterResponse:
        name = validate.name("name", request.name)
        version = await self.controller.resolve_adapter.remote(name)
        return pb.ResolveAdapterResponse(name=name, version=version)

    async def unregister_adapter(self, request: pb.UnregisterAdapterRequest) -> pb.UnregisterAdapterResponse:
        name = validate.name("name", request.name)
        evicted = await self.controller.unregister_adapter.remote(name, validate.drain_timeout(request))
        return pb.UnregisterAdapterResponse(name=name, evicted_versions=evicted)

    async def resize_pool(self, request: pb.ResizePoolRequest) -> pb.ResizePoolResponse:
        replica = validate.name("replica", request.replica)
        keep = [validate.name("keep_adapters", k, f" (keep_adapters[{i}])")
                for i, k in enumerate(request.keep_adapters)]
        ranks = await self.controller.resize_pool.remote(replica, int(request.lent_bytes), keep)
        return pb.ResizePoolResponse(replica=replica, ranks=[
            pb.RankPool(rank=r["rank"], capacity_bytes=r["capacity_bytes"], lent_bytes=r["lent_bytes"],
                        page_bytes=r["page_bytes"], evicted_adapters=r["evicted"]) for r in ranks])

    async def status(self, request: pb.StatusRequest) -> pb.StatusResponse:
        status, workers = await asyncio.gather(self.controller.status.remote(), self.controller.worker_stats.remote())
        reached = [w["stats"] for w in workers if w["stats"] is not None]
        readiness, depths = status.get("readiness", {}), status.get("queue_depths", {})
        replicas = [pb.ReplicaStatus(replica=r, queue_depth=depths.get(r, 0),
                                     workers=[_worker_status(w) for w in workers if w["replica"] == r],
                                     counters=_counters([w["stats"] for w in workers
                                                         if w["replica"] == r and w["stats"] is not None]))
                    for r in sorted(status.get("replicas", []))]
        return pb.StatusResponse(
            epoch=status["epoch"], adapters=status["adapters"], workers=status.get("workers", len(workers)),
            replicas=replicas, ready_residencies=readiness.get("ready", 0), held_residencies=readiness.get("held", 0),
            commands_sent=status.get("commands_sent", 0), hints_received=status.get("hints_received", 0),
            hints_accepted=status.get("hints_accepted", 0), counters=_counters(reached),
            ingest_queued_hints=self.ingest.queued, ingest_queue_capacity=self.ingest.capacity,
            ingest_rejected_calls=self.ingest.rejected)

    async def push_adapter(self, requests: AsyncIterator[pb.PushAdapterRequest],
                           ) -> AsyncIterator[pb.PushAdapterResponse]:
        """A version pushed from a trainer's memory: the stream gathered and checked here (``push_stream``), then
        the controller checks, keeps and registers it; one answer."""
        body = await gather(requests, self.max_push_bytes)
        # as an array: Ray hands the controller the one copy in its object store to read in place
        weights = np.frombuffer(body.weights, dtype=np.uint8)
        done = await self.controller.push_adapter.remote(body.name, body.tag, body.config, weights)
        yield pb.PushAdapterResponse(name=done.name, tag=done.tag, version=done.version,
                                     previous_version=done.previous, pending_ranks=done.rank_pending)

    async def fetch_pushed(self, request: pb.FetchPushedRequest) -> AsyncIterator[pb.FetchPushedResponse]:
        """A pushed version's bytes, for an attached rank whose machine lacks the controller's push area
        (``Pushes.payload``: only a version the service keeps), in messages of ``PUSH_CHUNK_BYTES``
        (``byte_chunks``)."""
        name = validate.name("name", request.name)
        config, weights = await self.controller.pushed_payload.remote(name, request.tag)
        view = memoryview(weights).cast("B")
        chunks = byte_chunks(view)
        yield pb.FetchPushedResponse(config_json=config, total_bytes=len(view), weights=next(chunks, b""))
        for chunk in chunks:
            yield pb.FetchPushedResponse(weights=chunk)

    def attach_rank(self, requests: AsyncIterator[pb.AttachRankRequest]) -> AsyncIterator[pb.AttachRankResponse]:
        """An engine's rank from outside the Ray cluster: the gateway hosts its endpoint (``rank_link``)."""
        return RankLink(self.rank_host).run(requests)


# -- the generic handler: bodies decoded here, errors answered with codes ---------------------------------
Unary = Callable[[Any], Awaitable[Any]]
Streaming = Callable[[Any], AsyncIterator[Any]]

RPCS: dict[str, tuple[type[Any], str]] = {  # rpc name -> (request message, Servicer method)
    "Hint": (pb.HintRequest, "hint"),
    "CancelHint": (pb.CancelHintRequest, "cancel_hint"),
    "ReportQueue": (pb.ReportQueueRequest, "report_queue"),
    "Lookup": (pb.LookupRequest, "lookup"),
    "Route": (pb.RouteRequest, "route"),
    "WatchReadiness": (pb.WatchReadinessRequest, "watch_readiness"),
    "RegisterAdapter": (pb.RegisterAdapterRequest, "register_adapter"),
    "RegisterAdapters": (pb.RegisterAdaptersRequest, "register_adapters"),
    "UnregisterAdapter": (pb.UnregisterAdapterRequest, "unregister_adapter"),
    "Status": (pb.StatusRequest, "status"),
    "ResizePool": (pb.ResizePoolRequest, "resize_pool"),
    "ResolveAdapter": (pb.ResolveAdapterRequest, "resolve_adapter"),
    "AttachRank": (pb.AttachRankRequest, "attach_rank"),
    "FetchPushed": (pb.FetchPushedRequest, "fetch_pushed"),
    "PushAdapter": (pb.PushAdapterRequest, "push_adapter"),
}


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _unary(method: Unary, request_cls: type[Any], calls: CallRate, rpc: str) -> Callable[..., Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            calls.take(client_of(context), rpc)  # CapacityError (RESOURCE_EXHAUSTED) over the client's rate
            return await method(validate.parse(request_cls, raw))
        except Exception as e:  # every error is answered with its code; none escapes into grpc
            code, message = status_for(e)
        await context.abort(code, message)

    return handle


async def _answered(responses: Callable[[], AsyncIterator[Any]],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """Yield ``responses()``; an error (from parsing the request too) ends the call with its status."""
    try:
        async for response in responses():
            yield response
    except Exception as e:
        code, message = status_for(e)
    else:
        return
    await context.abort(code, message)


async def _held(limits: StreamLimits, rpc: str, context: grpc.aio.ServicerContext,
                responses: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """``responses()`` while the caller holds one of its streams (``StreamLimits``; CapacityError beyond)."""
    with limits.hold(client_of(context), rpc):
        async for response in responses():
            yield response


def _streaming(method: Streaming, request_cls: type[Any], limits: StreamLimits,
               rpc: str) -> Callable[..., AsyncIterator[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        def responses() -> AsyncIterator[Any]:
            return _held(limits, rpc, context, lambda: method(validate.parse(request_cls, raw)))

        async for response in _answered(responses, context):
            yield response

    return handle


def _bidi(method: Callable[[AsyncIterator[Any]], AsyncIterator[Any]], parse: Callable[[bytes], Any],
          limits: StreamLimits, rpc: str) -> Callable[..., AsyncIterator[Any]]:
    async def handle(raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def requests() -> AsyncIterator[Any]:
            async for raw in raw_requests:
                yield parse(raw)

        async for response in _answered(lambda: _held(limits, rpc, context, lambda: method(requests())), context):
            yield response

    return handle


STREAM_PARSERS: dict[str, Callable[[bytes], Any]] = {  # client streams whose bodies are not all decoded
    "PushAdapter": parse_request,  # a push's weights taken where gRPC put them (``push_stream.parse_request``)
}


def generic_handler(servicer: Servicer) -> grpc.GenericRpcHandler:
    """Every RPC of LoraCacheService, with raw request bodies (decoded by the handlers themselves)."""
    service = pb.DESCRIPTOR.services_by_name["LoraCacheService"]
    handlers = {}
    for rpc, (request_cls, attr) in RPCS.items():
        method = getattr(servicer, attr)
        if service.methods_by_name[rpc].client_streaming:
            parse = STREAM_PARSERS.get(rpc) or functools.partial(validate.parse, request_cls)
            handlers[rpc] = grpc.stream_stream_rpc_method_handler(_bidi(method, parse, servicer.streams, rpc),
                                                                  response_serializer=_serialize)
        elif service.methods_by_name[rpc].server_streaming:
            handlers[rpc] = grpc.unary_stream_rpc_method_handler(_streaming(method, request_cls, servicer.streams, rpc),
                                                                 response_serializer=_serialize)
        else:
            handlers[rpc] = grpc.unary_unary_rpc_method_handler(_unary(method, request_cls, servicer.calls, rpc),
                                                                response_serializer=_serialize)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
