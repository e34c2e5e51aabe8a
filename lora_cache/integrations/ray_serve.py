"""Ray Serve: a request router that routes by lora-cache's advice, and the replica side that attaches to it.

    from lora_cache.integrations.ray_serve import CacheReplica, LoraCacheRouter, ReplicaCacheConfig, router_config

    @serve.deployment(request_router_config=router_config(server="10.0.0.5:50051"))
    class Llm:
        def __init__(self) -> None:
            self.cache = CacheReplica(ReplicaCacheConfig(num_slots=8, device="cuda"))   # attach every TP rank
        async def __call__(self, request):
            async with self.cache.lease() as lease:      # serve.get_multiplexed_model_id(), one version on every rank
                ... LoRA kernels over lease.slots (one per rank) ...

    handle.options(multiplexed_model_id="adapter-003").remote(...)   # or the HTTP header serve_multiplexed_model_id

Router (lifecycle step 1): for a request with a multiplexed model id, ``LoraCacheRouter.choose_replicas`` returns
the deployment's replicas in the order of the controller's ``Route`` advice for the adapter (residency under a load
bound, its own in-flight requests per replica as ``outstanding``), one per rank, so Serve's queue-length probe
takes the best replica with room. The advice is kept per adapter for ``advice_ttl_s`` (its leading READY replicas
re-ranked by the router's own in-flight requests) and refreshed in the background: a request waits for ``Route``
only when its adapter has no fresh advice. Once Serve has routed a request, the router sends
``Hint(adapter, replica)``: at once where the adapter was not READY (a load to start there), else batched; when
the request completes it withdraws the hint (``CancelHint``, batched), so the controller plans for requests in
flight only.
When lora-cache does not answer within ``route_timeout_s`` (or fails), the request is routed by Serve's own
power-of-two-choices + multiplex ranking, and lora-cache is not asked again for ``retry_s``: a request never fails
or waits long for lora-cache.

Replica (steps 4-9): ``CacheReplica`` attaches each TP rank of the Serve replica to the controller as a rank of the
lora-cache replica ``replica_name(replica_id)`` (rank 0 in the replica's process, ranks 1.. in actors of their own),
so the controller plans its slots; ``lease()`` replaces ``@serve.multiplexed``'s load-on-miss: it agrees on one
version of the adapter on every rank (``Attachment.agree``), acquires exactly that version on each, reports the
waiting requests' adapters as the replica's queue, and releases at the end.

Replica names: a Serve replica is the lora-cache replica ``serve-<deployment>-<replica unique id>`` on both
sides (``replica_name``), so the router translates the advice into Serve's replicas with no table.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import ray
from ray import serve
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Serve's default router
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from lora_cache.api.client import AsyncLoraCacheClient, ClientError, Hint, RoutedReplica, RouteItem
from lora_cache.errors import ConfigError, NotFoundError
from lora_cache.vocab import AdapterKey

if TYPE_CHECKING:
    from workers.attach import Attachment, WorkerConfig

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def replica_name(replica_id: ReplicaID) -> str:
    """The lora-cache replica a Serve replica attaches as (and the router's name for it)."""
    return _UNSAFE.sub("-", f"serve-{replica_id.deployment_id.name}-{replica_id.unique_id}")


# -- the router ----------------------------------------------------------------------------------------------
class _Advice(NamedTuple):
    at: float  # monotonic, when the answer came
    replicas: tuple[RoutedReplica, ...]  # best first


@dataclass(frozen=True)
class RouterSettings:
    """``LoraCacheRouter``'s settings (``RequestRouterConfig.request_router_kwargs``)."""

    server: str = field(default="127.0.0.1:50051", metadata={"help": "the lora-cache gateway, host:port"})
    token: str = field(default="", metadata={"help": "the gateway's bearer token, if it has one"})
    route_timeout_s: float = field(
        default=0.25,
        metadata={"help": "deadline of the Route call; past it the request is routed by Serve's own ranking"},
    )
    hint_timeout_s: float = field(default=0.5, metadata={"help": "deadline of a Hint call (sent after routing)"})
    retry_s: float = field(
        default=5.0,
        metadata={
            "help": "after lora-cache failed to answer, route by Serve's own ranking this long before asking again"
        },
    )
    max_replicas: int = field(default=0, metadata={"help": "replicas per advice (0: all)"})
    hints: str = field(
        default="all",
        metadata={
            "help": "which routed requests the controller is hinted of: all (every one, batched: its plans and "
            "popularity), cold (only those sent where the advice did not find the adapter READY), or none"
        },
    )
    advice_ttl_s: float = field(
        default=2.0,
        metadata={
            "help": "an adapter's advice is reused this long (its READY replicas re-ranked by this router's own "
            "in-flight requests) and refreshed in the background past half of it; only an adapter with no "
            "advice waits for Route (0: a Route call on every request's path)"
        },
    )
    hint_batch_s: float = field(
        default=0.02,
        metadata={"help": "hints of routed requests are sent together, one Hint call this often (0: one per request)"},
    )

    def __post_init__(self) -> None:
        host, _, port = self.server.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"server {self.server!r} is not host:port; give the lora-cache gateway's address, e.g. 127.0.0.1:50051"
            )
        for name in ("route_timeout_s", "hint_timeout_s"):
            if not 0 < getattr(self, name) <= 10:
                raise ConfigError(
                    f"{name} is {getattr(self, name)}; give a short positive deadline (<= 10 s): a "
                    "router must not hold requests for lora-cache"
                )
        if self.retry_s < 0 or self.max_replicas < 0:
            raise ConfigError(f"retry_s ({self.retry_s}) and max_replicas ({self.max_replicas}) must be >= 0")
        if self.hints not in ("cold", "all", "none"):
            raise ConfigError(f"hints is {self.hints!r}; give cold, all or none")
        if not 0 <= self.advice_ttl_s <= 10 or not 0 <= self.hint_batch_s <= 1:
            raise ConfigError(
                f"advice_ttl_s ({self.advice_ttl_s}) must be in [0, 10] s and hint_batch_s ({self.hint_batch_s}) in "
                "[0, 1] s: advice older than a few seconds no longer says where adapters are"
            )


def router_config(**settings: Any) -> RequestRouterConfig:
    """A deployment's ``request_router_config`` with ``LoraCacheRouter`` (``settings``: ``RouterSettings``)."""
    return RequestRouterConfig(
        request_router_class=f"{__name__}:LoraCacheRouter",  # type: ignore[arg-type]
        request_router_kwargs=asdict(RouterSettings(**settings)),
    )


class LoraCacheRouter(PowerOfTwoChoicesRequestRouter):
    """Ranks a deployment's replicas for the request's adapter (its multiplexed model id) by lora-cache's advice;
    Serve's own ranking for requests without one, and whenever lora-cache does not answer."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.settings = RouterSettings(**kwargs)
        self._client: AsyncLoraCacheClient | None = None  # made on the router's event loop, on first use
        self._down_until = 0.0  # monotonic: until then, Serve's own ranking (lora-cache failed to answer)
        self._inflight: dict[ReplicaID, int] = {}  # this router's requests on each replica, routed not completed
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> its replica, until completed
        self._advice: dict[str, _Advice] = {}  # adapter -> its last advice (reused for advice_ttl_s)
        self._refreshing: set[str] = set()  # adapters whose advice is being refreshed in the background
        self._tasks: set[asyncio.Task[None]] = set()  # hint and refresh calls in flight (kept referenced)
        self._pending: dict[str, Hint] = {}  # request id -> its hint, waiting for the next batch
        self._hinted: set[str] = set()  # requests whose hint was sent, until completed (then cancelled)
        self._cancels: list[str] = []  # hints of completed requests, waiting for the next batch
        self._done_early: set[str] = set()  # requests completed while their hint waited for its batch
        self._flush: asyncio.TimerHandle | None = None  # the next batch's send, when one is waiting
        self.counts: dict[str, float] = {
            "advice_ms": 0.0,  # time choose_replicas spent on the advice, in all
            "advised": 0,
            "fallback": 0,
            "hints": 0,
            "hint_calls": 0,
            "cancel_calls": 0,
            "hint_errors": 0,
            "route_errors": 0,
            "route_calls": 0,
            "route_waits": 0,
        }

    # -- choosing (one iteration per Serve routing attempt) ------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if adapter and time.monotonic() >= self._down_until:
            began = time.perf_counter()
            ranked = await self._advised(adapter, candidate_replicas)
            self.counts["advice_ms"] += (time.perf_counter() - began) * 1e3
            if ranked is not None:
                assert pending_request is not None
                pending_request.routing_context.should_backoff = True  # every rank full: Serve backs off, retries
                self.counts["advised"] += 1
                return ranked
        self.counts["fallback"] += bool(adapter)
        return await super().choose_replicas(candidate_replicas, pending_request)

    async def _advised(self, adapter: str, candidates: list[RunningReplica]) -> list[list[RunningReplica]] | None:
        """The candidates in the advice's order (one per rank; those the controller does not know yet last), or
        None when lora-cache did not answer (or does not know the adapter). A fresh advice is reused (no call on
        the request's path); one past half its life is refreshed in the background; none, or a stale one, is
        waited for."""
        now = time.monotonic()
        cached = self._advice.get(adapter)
        if cached is None or now - cached.at >= self.settings.advice_ttl_s:
            self.counts["route_waits"] += 1
            cached = await self._route(adapter)
            if cached is None:
                return None
        elif now - cached.at >= self.settings.advice_ttl_s / 2 and adapter not in self._refreshing:
            self._refreshing.add(adapter)
            self._spawn(self._refresh(adapter))
        return self._rank(cached, candidates)

    def _rank(self, advice: _Advice, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """The advice's order; its leading READY replicas by this router's own requests in flight there (fewest
        first, the advice's order among equals): the load the advice saw when it was made has moved since."""
        by_name = {replica_name(r.replica_id): r for r in candidates}
        named = [r for r in advice.replicas if r.replica in by_name]
        lead = 0
        while lead < len(named) and named[lead].reason == "ready" and named[lead].within_bound:
            lead += 1
        inflight = {replica_name(rid): n for rid, n in self._inflight.items()}
        order = sorted(named[:lead], key=lambda r: inflight.get(r.replica, 0)) + named[lead:]
        ranked = [[by_name[r.replica]] for r in order]
        seen = {id(rank[0]) for rank in ranked}
        rest = [r for r in candidates if id(r) not in seen]
        return [*ranked, rest] if rest else ranked

    async def _route(self, adapter: str) -> _Advice | None:
        """Ask ``Route`` for ``adapter`` (with this router's in-flight requests as the load) and keep the answer."""
        outstanding = {replica_name(rid): n for rid, n in self._inflight.items() if n > 0}
        self.counts["route_calls"] += 1
        try:
            route = (
                await self._lora().route(
                    [RouteItem(adapter)],
                    outstanding,
                    self.settings.max_replicas,
                    timeout_s=self.settings.route_timeout_s,
                )
            )[0]
        except ClientError as e:
            self._went_down(f"Route failed ({e})")
            return None
        if route.error is not None:  # e.g. an adapter the controller does not know: Serve's ranking, no back-off
            self.counts["route_errors"] += 1
            self._advice.pop(adapter, None)
            return None
        advice = _Advice(time.monotonic(), route.replicas)
        if self.settings.advice_ttl_s > 0:
            self._advice[adapter] = advice
        return advice

    async def _refresh(self, adapter: str) -> None:
        try:
            await self._route(adapter)
        finally:
            self._refreshing.discard(adapter)

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

    def _lora(self) -> AsyncLoraCacheClient:
        if self._client is None:
            self._client = AsyncLoraCacheClient(
                self.settings.server, token=self.settings.token or None, timeout_s=self.settings.route_timeout_s
            )
        return self._client

    # -- after routing: the hint, its cancel and the in-flight count -------------------------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = pending_request.metadata.internal_request_id
        self._routed[rid] = replica_id
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        adapter = pending_request.metadata.multiplexed_model_id
        if not adapter or self.settings.hints == "none" or time.monotonic() < self._down_until:
            return
        replica = replica_name(replica_id)
        advice = self._advice.get(adapter)
        ready = advice is not None and any(r.replica == replica and r.reason == "ready" for r in advice.replicas)
        if ready and self.settings.hints == "cold":
            return  # resident there: nothing to plan for it
        self._pending[rid] = Hint(rid, adapter, replica)
        self._batch(now=not ready)  # a load to start there: the hint goes now; else it only counts, and waits

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
        if hints:
            then = [h.hint_id for h in hints if h.hint_id in self._done_early]
            self._done_early.difference_update(then)
            self._hinted.update(h.hint_id for h in hints if h.hint_id not in then)
            self._spawn(self._hint(hints, then))
        if cancels:
            self._spawn(self._cancel(cancels))

    async def _hint(self, hints: list[Hint], then_cancel: list[str]) -> None:
        """Send ``hints``; then withdraw those whose requests completed before they left (after the hint, so
        the cancel cannot overtake it)."""
        self.counts["hint_calls"] += 1
        try:
            await self._lora().hint_within(hints, self.settings.hint_timeout_s)
            self.counts["hints"] += len(hints)
        except ClientError as e:
            self.counts["hint_errors"] += len(hints)
            if e.code != "NOT_FOUND":  # NOT_FOUND: a replica gone meanwhile (the batch is dropped), not lora-cache
                self._went_down(f"Hint failed ({e})")
            return
        if then_cancel:
            await self._cancel(then_cancel)

    async def _cancel(self, hint_ids: list[str]) -> None:
        self.counts["cancel_calls"] += 1
        try:
            await self._lora().cancel_hint(*hint_ids, timeout_s=self.settings.hint_timeout_s)
        except ClientError as e:  # the hints expire at the controller (hint_ttl_s)
            self.counts["hint_errors"] += len(hint_ids)
            self._went_down(f"CancelHint failed ({e})")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_id, None)
        gone = {rid for rid, r in self._routed.items() if r == replica_id}
        self._routed = {rid: r for rid, r in self._routed.items() if r != replica_id}
        self._hinted -= gone  # the controller dropped the replica's hints with it
        self._done_early -= gone
        self._pending = {rid: h for rid, h in self._pending.items() if rid not in gone}
        self._advice.clear()  # every advice may name it first: ask again


# -- the replica side ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaCacheConfig:
    """How a Serve replica's ranks attach (``AttachConfig``'s link fields, ``WorkerConfig``'s cache fields)."""

    tp: int = field(
        default=1,
        metadata={
            "help": "TP ranks of the replica (rank 0 in the replica's process, the others in actors of their own)"
        },
    )
    num_slots: int = field(default=8, metadata={"help": "adapter slots per rank"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda (rank k on its actor's GPU)"})
    dtype: str = field(default="float32", metadata={"help": "slot dtype (bfloat16 on GPUs)"})
    max_batch: int = field(default=64, metadata={"help": "most adapters one acquire holds"})
    address: str = field(default="auto", metadata={"help": "the Ray cluster of the controller"})
    gateway: str = field(default="", metadata={"help": "attach through the gateway instead (host:port)"})
    token_file: str = field(default="", metadata={"help": "the gateway's bearer token file"})
    acquire_timeout_s: float = field(
        default=30.0,
        metadata={"help": "longest wait for the ranks to agree on a version (a re-registration on its way)"},
    )
    worker: dict[str, Any] = field(default_factory=dict, metadata={"help": "more WorkerConfig fields"})

    def __post_init__(self) -> None:
        if self.tp < 1 or self.num_slots < 1:
            raise ConfigError(f"tp ({self.tp}) and num_slots ({self.num_slots}) must be >= 1")
        if self.acquire_timeout_s <= 0:
            raise ConfigError(f"acquire_timeout_s is {self.acquire_timeout_s}; give a positive number of seconds")

    def worker_config(self, rank: int) -> WorkerConfig:
        from workers.attach import WorkerConfig

        device = self.device if self.device == "cpu" else "cuda:0"  # each rank's process sees its own GPU
        return WorkerConfig(
            tp=self.tp,
            tp_rank=rank,
            num_slots=self.num_slots,
            device=device,
            dtype=self.dtype,
            max_batch=self.max_batch,
            **self.worker,
        )

    def attach_config(self, replica: str) -> Any:
        from workers.attach import AttachConfig

        return AttachConfig(replica=replica, address=self.address, gateway=self.gateway, token_file=self.token_file)


def _attach(config: ReplicaCacheConfig, replica: str, rank: int) -> Attachment:
    from workers.attach import attach

    return attach(config.attach_config(replica), config.worker_config(rank))


@ray.remote(num_cpus=0)
class RankActor:
    """TP rank ``k >= 1`` of a Serve replica: its attached cache, acquired and released by rank 0's leases."""

    def __init__(self, config: ReplicaCacheConfig, replica: str, rank: int) -> None:
        self.rank = _attach(config, replica, rank)
        self.leases: dict[str, Any] = {}  # lease id -> this rank's batch, until released

    def rows(self, names: list[str]) -> Any:
        return self.rank.version_rows(names)

    def acquire(self, lease: str, key: AdapterKey) -> int:
        batch = self.rank.acquire([key])
        self.leases[lease] = batch
        return int(batch.slots[0])

    def release(self, lease: str) -> None:
        batch = self.leases.pop(lease, None)
        if batch is not None:
            self.rank.release(batch)

    def detach(self) -> None:
        self.rank.detach()


@dataclass
class Lease:
    """One request's hold on its adapter: ``key`` (one exact version), and its slot on every rank."""

    ident: str
    key: AdapterKey
    slots: list[int]  # per rank
    batch: Any  # rank 0's Batch (``batch.slot_index`` for rank 0's kernels)


class CacheReplica:
    """The replica side of a ``@serve.deployment``: build it in ``__init__``; ``lease()`` per request."""

    def __init__(self, config: ReplicaCacheConfig | None = None, replica: str | None = None) -> None:
        self.config = config or ReplicaCacheConfig()
        self.name = replica or replica_name(serve.get_replica_context().replica_id)
        self.rank = _attach(self.config, self.name, 0)  # rank 0, in this process: the engine's own
        gpus = 1 if self.config.device != "cpu" else 0
        self.ranks = [
            RankActor.options(num_gpus=gpus).remote(self.config, self.name, k)  # type: ignore[attr-defined]
            for k in range(1, self.config.tp)
        ]
        ray.get([r.rows.remote([]) for r in self.ranks])  # every rank attached before the replica serves
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[str, float]] = {}  # requests waiting for their adapter (the queue report)
        self._lock = threading.Lock()  # protects _waiting

    # -- per request ----------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lease(self, adapter: str | None = None) -> AsyncIterator[Lease]:
        """Hold ``adapter`` (default: the request's multiplexed model id) at one version on every rank for the
        request; released when the block ends."""
        name = adapter or serve.get_multiplexed_model_id()
        held = await asyncio.to_thread(self.acquire, name)
        try:
            yield held
        finally:
            await asyncio.to_thread(self.release, held)

    @contextlib.contextmanager
    def lease_sync(self, adapter: str) -> Iterator[Lease]:
        held = self.acquire(adapter)
        try:
            yield held
        finally:
            self.release(held)

    def acquire(self, adapter: str) -> Lease:
        """Agree on one version of ``adapter`` over the ranks and hold exactly it on each (a miss loads it;
        blocking: from a thread). Raises ``NotFoundError`` for an adapter the controller never registered."""
        if not adapter:
            raise NotFoundError(
                "the request names no adapter: send it with "
                "handle.options(multiplexed_model_id=...) or the serve_multiplexed_model_id header"
            )
        ident = f"{self.name}-{next(self._ids)}"
        self._queue(+1, ident, adapter)
        try:
            key = self._agree(adapter)
            batch = self.rank.acquire([key])
            try:
                slots = [int(batch.slots[0]), *ray.get([r.acquire.remote(ident, key) for r in self.ranks])]
            except BaseException:
                self.rank.release(batch)
                ray.get([r.release.remote(ident) for r in self.ranks])
                raise
        finally:
            self._queue(-1, ident, adapter)
        return Lease(ident, key, slots, batch)

    def release(self, lease: Lease) -> None:
        """After the request's kernels are enqueued (on every rank)."""
        self.rank.release(lease.batch)
        ray.get([r.release.remote(lease.ident) for r in self.ranks])

    def _agree(self, adapter: str) -> AdapterKey:
        """The version every rank holds for this request: READY on every rank if one is, else the current one."""
        deadline = time.monotonic() + self.config.acquire_timeout_s
        while True:
            if adapter not in self.rank.catalog:
                raise NotFoundError(
                    f"adapter {adapter!r} is not registered with lora-cache; register it "
                    "(`lora-cache register NAME PATH`) before sending requests for it"
                )
            rows = [self.rank.version_rows([adapter]), *ray.get([r.rows.remote([adapter]) for r in self.ranks])]
            key = self.rank.agree(rows, [adapter])[adapter]
            if key is not None:
                return key
            if time.monotonic() > deadline:
                raise NotFoundError(
                    f"the {self.config.tp} ranks of {self.name} did not agree on a version of "
                    f"{adapter!r} within {self.config.acquire_timeout_s} s (a re-registration that "
                    "did not reach every rank); check `lora-cache status`"
                )
            time.sleep(0.01)  # a registration on its way to the other ranks: poll its arrival

    def _queue(self, step: int, ident: str, adapter: str) -> None:
        """The replica's waiting requests' adapters, in arrival order, to the controller (never blocks)."""
        with self._lock:
            key = hash(ident)
            if step > 0:
                self._waiting[key] = (adapter, time.time())
            else:
                self._waiting.pop(key, None)
            entries = sorted(self._waiting.values(), key=lambda e: e[1])
        self.rank.report_queue(entries)

    def ready(self) -> set[str]:
        """Adapters READY on rank 0."""
        return self.rank.ready_names()

    def shutdown(self) -> None:
        """Detach every rank (the controller drops what they held). Idempotent."""
        with contextlib.suppress(Exception):
            ray.get([r.detach.remote() for r in self.ranks], timeout=30)
        self.rank.detach()
