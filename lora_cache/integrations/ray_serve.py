"""Ray Serve: a request router that routes by lora-cache's readiness and rule, and the replica side that attaches.

    from lora_cache.integrations.ray_serve import CacheReplica, LoraCacheRouter, ReplicaCacheConfig, router_config

    @serve.deployment(request_router_config=router_config(server="10.0.0.5:50051"))
    class Llm:
        def __init__(self) -> None:
            self.cache = CacheReplica(ReplicaCacheConfig(num_slots=8, device="cuda"))   # attach every TP rank
        async def __call__(self, request):
            async with self.cache.lease() as lease:      # serve.get_multiplexed_model_id(), one version on every rank
                ... LoRA kernels over lease.slots (one per rank) ...

    handle.options(multiplexed_model_id="adapter-003").remote(...)   # or the HTTP header serve_multiplexed_model_id

Router (lifecycle step 1): for a request with a multiplexed model id, ``LoraCacheRouter.choose_replicas`` ranks
the deployment's replicas locally by lora-cache's own rule (``lora_cache.routing.ranking.rank``: residency under a
load bound, sticky rendezvous picks for a cold adapter), one per rank, so Serve's queue-length check takes the best
replica with room. Residency comes from the controller's ``WatchReadiness`` stream, read in the background (it opens
with the whole ready set, then each change), plus "loading" where this router sent the adapter lately; the load is
this router's own requests in flight per replica; with ``traffic_s`` (off by default) an adapter READY nowhere goes
to the replica this router sent the fewest requests lately (``lora_cache.routing.traffic``), its rendezvous pick only
among equals. Nothing on a request's path waits for lora-cache.
Once Serve has routed a request, the router sends ``Hint(adapter, replica)`` from a task of its own: at once where
the adapter was not READY (a load to start there), else batched; when the request completes it withdraws the hint
(``CancelHint``, batched), so the controller plans for requests in flight only. Before the stream's first answer,
and for ``retry_s`` after the stream broke or a hint call failed, requests are routed by Serve's own rule (power of
two choices among the replicas its multiplex affinity or locality prefers): a request never fails or waits for
lora-cache. A hint call past its deadline or rate-limited (a busy controller) pauses only the hints for ``retry_s``.

The router is built on Serve's public router API only (``ray.serve.request_router``: ``RequestRouter`` with
``FIFOMixin``, ``MultiplexMixin`` and ``LocalityMixin``, in the order of Ray's guide to custom request routers); Serve's
own rule is written on the mixins' public steps, so nothing here imports ``ray.serve._private``
(``tests/test_integrations.py`` holds the package to that).

Replica (steps 4-9): ``CacheReplica`` attaches each TP rank of the Serve replica to the controller as a rank of the
lora-cache replica ``replica_name(replica_id)`` (rank 0 in the replica's process, ranks 1.. in actors of their own),
so the controller plans its slots; ``lease()`` replaces ``@serve.multiplexed``'s load-on-miss: it holds one exact
version of the adapter on every rank (rank 0's pick, held exactly by the others in one call each; the ranks'
version exchange, ``Attachment.agree``, only where a rank lacks that version), reports the waiting requests'
adapters as the replica's queue, and releases at the end. An engine that acquires in its own steps awaits
``ensure_ready(adapter)`` before taking the request, so that a miss loads beside its steps, not inside one.

The replica side lives in ``serve_replica.py`` (re-exported here: import every name from this module).

Replica names: a Serve replica is the lora-cache replica ``serve-<deployment>-<replica unique id>`` on both
sides (``replica_name``), so the router maps readiness onto Serve's replicas with no table.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import asdict
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from lora_cache.api.client import AsyncLoraCacheClient, ClientError, Hint, ReadinessEvent, Resync
from lora_cache.integrations.router_settings import RouterSettings as RouterSettings  # re-exported: the public names
from lora_cache.integrations.serve_replica import CacheReplica as CacheReplica
from lora_cache.integrations.serve_replica import Lease as Lease
from lora_cache.integrations.serve_replica import RankActor as RankActor
from lora_cache.integrations.serve_replica import ReplicaCacheConfig as ReplicaCacheConfig
from lora_cache.integrations.serve_replica import replica_name as replica_name
from lora_cache.routing.ranking import ReplicaLoad, Residence, rank
from lora_cache.routing.traffic import Traffic

log = logging.getLogger(__name__)
_SLOW = frozenset({"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})  # busy, not gone: a hint call so ended pauses hints

_FIRST_KEPT = 4096  # first picks kept for requests not yet routed (older ones were cancelled)
# Tags looked up kept (``_exact``: model id A@TAG -> A@VERSION), oldest out first. Bounded because a trainer pushes
# a new tag every few seconds for as long as it runs. 4096 (the size it had when it shared _FIRST_KEPT) holds the few
# live tags of about a thousand adapters at once; one pushed out costs a background Lookup again, not a request's wait.
_TAGS_KEPT = 4096
_SNAPSHOT = 2**63  # a WatchReadiness cursor past any controller's newest event: the stream opens with a resync


# -- the router ----------------------------------------------------------------------------------------------
def ready_replicas(ready: dict[str, dict[str, set[str]]], model_id: str) -> set[str]:
    """The replicas READY for a multiplexed model id, from the readiness stream's ``adapter -> replica -> versions``:
    for ``A``, those READY at some version of it (the engine serves the one READY on every rank); for ``A@VERSION``,
    those READY at exactly that version (issue 44 item 3). ``A@TAG`` names no version the stream shows: none (ranked
    by load, as a cold adapter; its hint still has the controller prefetch that version)."""
    name, _, version = model_id.partition("@")
    where = ready.get(name, {})
    return set(where) if not version else {replica for replica, versions in where.items() if version in versions}


def router_config(**settings: Any) -> RequestRouterConfig:
    """A deployment's ``request_router_config`` with ``LoraCacheRouter`` (``settings``: ``RouterSettings``)."""
    return RequestRouterConfig(
        request_router_class=f"{__name__}:LoraCacheRouter",  # type: ignore[arg-type]
        request_router_kwargs=asdict(RouterSettings(**settings)),
    )


class LoraCacheRouter(FIFOMixin, MultiplexMixin, LocalityMixin, RequestRouter):
    """Ranks a deployment's replicas for the request's adapter (its multiplexed model id) locally, by lora-cache's
    rule over the readiness the controller streams and this router's own requests in flight; never waits on
    lora-cache. Serve's own ranking for requests without an adapter, and while lora-cache is unreachable.

    Built on Serve's public router API as Ray's guide to custom routers builds one (``ray.serve.request_router``):
    ``FIFOMixin`` hands a replica found for one request to the oldest waiting request for the same adapter (else
    the oldest), ``MultiplexMixin`` and ``LocalityMixin`` keep the model ids and the colocation that the fallback
    (``_serve_choice``) narrows the candidates by."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.settings = RouterSettings(**kwargs)
        self._ranking = self.settings.ranking()
        self._client: AsyncLoraCacheClient | None = None  # made on the router's event loop, on first use
        self._down_until = 0.0  # monotonic: until then, Serve's own ranking (lora-cache failed)
        self._watching: asyncio.Task[None] | None = None  # the readiness stream's reader (started on first use)
        self._live = False  # the stream's snapshot arrived since it (re)connected: its readiness is current
        self.last_down = ""  # why lora-cache's ranking was last given up for Serve's own (empty: never)
        self._hints_until = 0.0  # monotonic: until then no hints are sent (a Hint or CancelHint was too slow)
        self.last_pause = ""  # why hints were last paused (empty: never)
        self._ready: dict[str, dict[str, set[str]]] = {}  # adapter -> replica -> versions READY there
        self._sent: dict[str, dict[str, float]] = {}  # adapter -> replica this router sent it to -> until (loading)
        self._inflight: dict[ReplicaID, int] = {}  # this router's requests on each replica, routed not completed
        self._first: dict[str, str] = {}  # internal request id -> the READY replica ranked first, until routed
        self._traffic = Traffic(self.settings.traffic_s)  # this router's requests sent to each replica lately
        self._names: dict[ReplicaID, str] = {}  # replica_name of each replica seen (until it dies)
        self._tags: dict[str, str] = {}  # model id A@TAG -> A@VERSION, looked up once (a tag names one content)
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> its replica, until completed
        self._tasks: set[asyncio.Task[None]] = set()  # hint calls in flight (kept referenced)
        self._pending: dict[str, Hint] = {}  # request id -> its hint, waiting for the next batch
        self._hinted: set[str] = set()  # requests whose hint was sent, until completed (then cancelled)
        self._cancels: list[str] = []  # hints of completed requests, waiting for the next batch
        self._done_early: set[str] = set()  # requests completed while their hint waited for its batch
        self._flying: set[str] = set()  # hints sent whose Hint call has not answered yet
        self._done_flying: set[str] = set()  # requests completed while their hint's call was in flight
        self._flush: asyncio.TimerHandle | None = None  # the next batch's send, when one is waiting
        self.counts: dict[str, float] = {
            "rank_ms": 0.0,  # time choose_replicas spent ranking, in all (no call to lora-cache is on this path)
            "advised": 0,  # requests ranked by lora-cache's rule
            "ready_first": 0,  # of those, where a replica with the adapter READY (and room under the bound) led
            "off_first": 0,  # of those, sent elsewhere (Serve's queue-length check: first full or slow; FIFO hand-off)
            "fallback": 0,  # requests with an adapter ranked by Serve's own rule (lora-cache down, stream not up)
            "events": 0,  # readiness events (and resyncs) taken from the stream
            "watch_starts": 0,
            "hints": 0,
            "hint_calls": 0,
            "cancel_calls": 0,
            "hint_errors": 0,
            "hint_pauses": 0,  # hint calls past their deadline or rate-limited: hints paused, the ranking goes on
            "hints_dropped": 0,  # hints batched before a pause (or lora-cache went down), not sent during it
        }

    # -- choosing (one iteration per Serve routing attempt; nothing awaited) ---------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if adapter:
            self._watch()
            if self._live and time.monotonic() >= self._down_until:
                assert pending_request is not None
                began = time.perf_counter()
                ranked = self._rank(adapter, candidate_replicas, pending_request.metadata.internal_request_id)
                self.counts["rank_ms"] += (time.perf_counter() - began) * 1e3
                pending_request.routing_context.should_backoff = True  # every rank full: Serve backs off, retries
                self.counts["advised"] += 1
                return ranked
            self.counts["fallback"] += 1
        return self._serve_choice(adapter, candidate_replicas, pending_request)

    def _serve_choice(
        self, adapter: str, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """Serve's own rule, on the mixins' public steps: the candidates narrowed by multiplex affinity for a request
        with an adapter (replicas with its model id, then those with the fewest models, then all, as each attempt
        ages) or by locality without one (same node, same zone, then all), and two of them at random, one rank:
        Serve's queue-length check takes the shorter with room, or backs off and asks again (power of two choices)."""
        if adapter:
            assert pending_request is not None
            allowed = self.apply_multiplex_routing(pending_request)
        else:
            allowed = self.apply_locality_routing(pending_request)
        if not allowed:  # none this attempt (2.56-2.57's multiplex step returns None, not an empty set, for an
            return []  # adapter on no replica whose first fallback is taken): Serve backs off, the next widens
        pool = [r for r in candidates if r.replica_id in allowed]
        return [random.sample(pool, min(2, len(pool)))] if pool else []

    def _rank(self, adapter: str, candidates: list[RunningReplica], rid: str) -> list[list[RunningReplica]]:
        """The candidates by lora-cache's ranking (``lora_cache.routing.ranking.rank``: residency under a load
        bound, sticky cold picks), one per rank: READY from the stream, loading where this router sent the adapter
        lately, the load this router's requests in flight there."""
        now = time.monotonic()
        ready = ready_replicas(self._ready, self._exact(adapter))
        sent = self._sent.get(adapter, {})
        by_name: dict[str, RunningReplica] = {}
        views = []
        for r in candidates:
            name = self._name(r.replica_id)
            by_name[name] = r
            where = (
                Residence.READY if name in ready else Residence.LOADING if sent.get(name, 0) > now else Residence.COLD
            )
            load = float(self._inflight.get(r.replica_id, 0))
            views.append(ReplicaLoad(name, where, load, recent=self._traffic.get(name, now)))
        ranked = rank(adapter, views, self._ranking)
        if ranked[0].reason is Residence.READY and ranked[0].within_bound:
            self.counts["ready_first"] += 1
            self._first[rid] = ranked[0].replica  # where it should go; Serve's queue-length check may say otherwise
            while len(self._first) > _FIRST_KEPT:  # requests cancelled before they were routed
                del self._first[next(iter(self._first))]
        else:
            self._first.pop(rid, None)
        return [[by_name[r.replica]] for r in ranked]

    def _name(self, replica_id: ReplicaID) -> str:
        name = self._names.get(replica_id)
        if name is None:
            name = self._names[replica_id] = replica_name(replica_id)
        return name

    # -- the readiness stream (background) --------------------------------------------------------------------------
    def _watch(self) -> None:
        if (self._watching is None or self._watching.done()) and time.monotonic() >= self._down_until:
            self.counts["watch_starts"] += 1
            self._watching = asyncio.get_running_loop().create_task(self._read_stream())

    async def _read_stream(self) -> None:
        """Keep ``_ready`` current from ``WatchReadiness`` (every replica, every adapter): its first answer is the
        whole ready set (a resync: the cursor is past the controller's newest event), then each change. A broken
        stream: Serve's own ranking for ``retry_s``, then a new stream (a new snapshot)."""
        try:
            async for event in self._lora().watch(after_seq=_SNAPSHOT):
                self._take(event)
                self._live = True
            raise ClientError("UNAVAILABLE", "the readiness stream ended")
        except Exception as e:  # the gateway is gone, or the stream broke: Serve's own ranking meanwhile
            self._went_down(f"WatchReadiness failed ({e})")

    def _take(self, event: ReadinessEvent | Resync) -> None:
        self.counts["events"] += 1
        if isinstance(event, Resync):
            self._ready = {}
            for replica, adapter, version in event.ready:
                self._ready.setdefault(adapter, {}).setdefault(replica, set()).add(version)
            return
        where = self._ready.setdefault(event.adapter, {})
        if event.ready:
            where.setdefault(event.replica, set()).add(event.version)
            return
        versions = where.get(event.replica, set())
        versions.discard(event.version)
        if not versions:
            where.pop(event.replica, None)
            self._sent.get(event.adapter, {}).pop(event.replica, None)  # evicted (or lost): not loading either
        if not where:
            del self._ready[event.adapter]

    def _exact(self, model_id: str) -> str:
        """``A@TAG`` as the ``A@VERSION`` it names once looked up (``Lookup``, in the background: never on a request's
        path; until then, and for a tag the controller does not keep, the id itself); any other id as it is."""
        name, _, ref = model_id.partition("@")
        if not ref or model_id in self._tags or any(ref in v for v in self._ready.get(name, {}).values()):
            return self._tags.get(model_id, model_id)
        self._tags[model_id] = model_id  # asked once: the lookup below replaces it
        while len(self._tags) > _TAGS_KEPT:
            del self._tags[next(iter(self._tags))]

        async def look_up() -> None:
            try:
                self._tags[model_id] = f"{name}@{(await self._lora().lookup(model_id)).version}"
            except Exception:  # not kept (yet), or lora-cache unreachable: ranked by load meanwhile, asked again later
                self.counts["tags_unknown"] = self.counts.get("tags_unknown", 0) + 1
                asyncio.get_running_loop().call_later(self.settings.retry_s, self._tags.pop, model_id, None)

        self._spawn(look_up())
        return model_id

    def _spawn(self, call: Any) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _went_down(self, why: str) -> None:
        if time.monotonic() >= self._down_until:
            log.warning(
                "lora-cache at %s: %s; routing by Serve's own ranking for %.1f s",
                self.settings.server,
                why,
                self.settings.retry_s,
            )
        self._down_until = time.monotonic() + self.settings.retry_s
        self._live = False
        self.last_down = why
        if self._watching is not None and self._watching is not asyncio.current_task():
            self._watching.cancel()  # a new stream after retry_s starts from a new snapshot

    def _lora(self) -> AsyncLoraCacheClient:
        if self._client is None:
            self._client = self.settings.client()
        return self._client

    # -- after routing: the hint, its cancel and the in-flight count -------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = pending_request.metadata.internal_request_id
        self._routed[rid] = replica_id
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        first = self._first.pop(rid, None)
        self.counts["off_first"] += first is not None and first != self._name(replica_id)
        adapter = pending_request.metadata.multiplexed_model_id
        if not adapter:
            return
        replica = self._name(replica_id)
        self._traffic.add(replica, time.monotonic())
        ready = replica in ready_replicas(self._ready, self._exact(adapter))
        if not ready:  # its load starts there (the hint, or the replica's own miss): the next requests follow it
            now = time.monotonic()
            sent = self._sent.setdefault(adapter, {})
            for r in [r for r, until in sent.items() if until <= now]:
                del sent[r]
            sent[replica] = now + self.settings.loading_s
        if (
            self.settings.hints == "none"
            or time.monotonic() < max(self._down_until, self._hints_until)
            or (ready and self.settings.hints == "cold")
        ):
            return
        self._pending[rid] = Hint(rid, adapter, replica)
        self._batch(now=not ready and self.settings.cold_hint_now)  # else it waits for the next batch

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._routed.pop(internal_request_id, None)
        if replica is not None and self._inflight.get(replica, 0) > 0:
            self._inflight[replica] -= 1
        # The hint said "a request for this adapter is on its way there"; it is done: withdraw it, or the
        # controller keeps planning for it (a request the engine admitted at once is never seen queued, so its
        # hint would stay a need there for the planner's hint_ttl_s, and evict what later requests use)
        if internal_request_id in self._pending:  # done before its hint left: the hint still counts (popularity),
            self._done_early.add(internal_request_id)  # and is withdrawn right after it
        elif internal_request_id in self._hinted:
            self._hinted.discard(internal_request_id)
            if internal_request_id in self._flying:  # a cancel sent now could reach the controller before the hint
                self._done_flying.add(internal_request_id)  # and find nothing: withdrawn once the Hint answers
            else:
                self._cancels.append(internal_request_id)
                self._batch(now=False)

    def _batch(self, now: bool) -> None:
        if now or self.settings.hint_batch_s == 0:
            self._send()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.settings.hint_batch_s, self._send)

    def _send(self) -> None:
        """The hints and cancels batched since the last send, one call each."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        hints, self._pending = list(self._pending.values()), {}
        cancels, self._cancels = self._cancels, []
        if hints and time.monotonic() < max(self._down_until, self._hints_until):  # paused since they were batched
            self.counts["hints_dropped"] += len(hints)  # (a CancelHint too slow): none is sent while paused
            self._done_early.difference_update(h.hint_id for h in hints)
            hints = []
        if hints:
            then = [h.hint_id for h in hints if h.hint_id in self._done_early]
            self._done_early.difference_update(then)
            self._hinted.update(h.hint_id for h in hints if h.hint_id not in then)
            self._flying.update(h.hint_id for h in hints)
            self._spawn(self._hint(hints, then))
        if cancels:
            self._spawn(self._cancel(cancels))

    async def _hint(self, hints: list[Hint], then_cancel: list[str]) -> None:
        """Send ``hints``; then withdraw those whose requests completed before they left (after the hint, so
        the cancel cannot overtake it)."""
        self.counts["hint_calls"] += 1
        ids = {h.hint_id for h in hints}
        try:
            result = await self._lora().hint_within(hints, self.settings.hint_timeout_s)
            self.counts["hints"] += len(hints) - len(result.rejections)
            self.counts["hint_errors"] += len(result.rejections)  # each answered alone (a replica gone meanwhile)
        except ClientError as e:
            self._flying -= ids
            self._done_flying -= ids
            self.counts["hint_errors"] += len(hints)
            if e.code in _SLOW:
                self._pause_hints(f"Hint failed ({e})")
            elif e.code != "NOT_FOUND":  # NOT_FOUND: a replica gone meanwhile (the batch is dropped), not lora-cache
                self._went_down(f"Hint failed ({e})")
            return
        except BaseException:
            self._flying -= ids
            self._done_flying -= ids
            raise
        self._flying -= ids
        late = ids & self._done_flying  # completed while the call was in flight: withdrawn now, after the hint
        self._done_flying -= late
        if then_cancel or late:
            await self._cancel([*then_cancel, *sorted(late)])

    async def _cancel(self, hint_ids: list[str]) -> None:
        self.counts["cancel_calls"] += 1
        try:
            await self._lora().cancel_hint(*hint_ids, timeout_s=self.settings.hint_timeout_s)
        except ClientError as e:  # the hints expire at the controller (hint_ttl_s)
            self.counts["hint_errors"] += len(hint_ids)
            if e.code in _SLOW:
                self._pause_hints(f"CancelHint failed ({e})")
            else:
                self._went_down(f"CancelHint failed ({e})")

    def _pause_hints(self, why: str) -> None:
        """lora-cache answered too slowly or asked to slow down: no hints for ``retry_s`` (a busy controller is not
        sent more; cancels of hints sent before still go); the ranking goes on from the live stream."""
        if time.monotonic() >= self._hints_until:
            log.warning("lora-cache at %s: %s; no hints for %.1f s (routing by its readiness goes on)",
                        self.settings.server, why, self.settings.retry_s)
        self.counts["hint_pauses"] += 1
        self._hints_until = time.monotonic() + self.settings.retry_s
        self.last_pause = why

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        gone = {rid for rid, r in self._routed.items() if r == replica_id}
        self._routed = {rid: r for rid, r in self._routed.items() if r != replica_id}
        self._hinted -= gone  # the controller dropped the replica's hints with it
        self._done_early -= gone
        self._done_flying -= gone
        self._pending = {rid: h for rid, h in self._pending.items() if rid not in gone}
        name = self._names.pop(replica_id, None) or replica_name(replica_id)  # the stream says NOT_READY for its
        # adapters once the controller drops it; until then it is not ranked READY here
        self._traffic.forget(name)
        for ready in self._ready.values():
            ready.pop(name, None)
        for sent in self._sent.values():
            sent.pop(name, None)
