"""Routing advice from the controller's view (lifecycle step 1): the planner's ``FleetView`` -> ranking inputs.

Plain Python (no torch, no Ray). The controller knows, per replica, what every TP rank holds (reported,
plus the prefetches it has sent since: the plan in flight), what it staged in host tiers, the waiting
queue and the active hints (requests routed there and not yet queued). A router may also give its own
count of requests in flight per replica (it alone sees requests that run without queueing); where it
does, that count is the replica's load, else the queue depth plus the active hints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

from lora_cache.errors import ConflictError, LoraCacheError, NotFoundError
from lora_cache.planner import FleetView, SlotState
from lora_cache.routing.clock import LoadClock
from lora_cache.routing.limits import RoutingLimits
from lora_cache.routing.ranking import Ranked, ReplicaLoad, Residence, RouteItem, RouterConfig, route_batch
from lora_cache.vocab import AdapterKey


class RouteRequest(NamedTuple):
    """One request to route: its adapter (``A``, or ``A@REF`` for one kept version: ``advise``'s ``resolve``), the
    version it was admitted with ('' = current), its tokens."""

    adapter: str
    version: str = ""
    tokens: int = 0


class RouteAdvice(NamedTuple):
    """The ranking for one request, or why there is none (this item only: the rest of the batch is routed)."""

    adapter: str
    version: str
    ranked: list[Ranked]
    error: LoraCacheError | None = None


def residence(view: FleetView, replica: str, key: AdapterKey, hosted: bool = True) -> Residence:
    """READY on every rank; else LOADING if every rank holds or loads it; else STAGED if every rank that
    does not hold it has it staged; else COLD (also for a replica without workers). ``hosted``: the shards the
    ranks reported in their host tiers count as staged (``FleetView.holding``)."""
    held = [view.holding(w, key, hosted) for w in view.workers(replica)]
    if not held:
        return Residence.COLD
    states = [r.state for r, _ in held if r is not None]
    if len(states) == len(held) and all(s is not SlotState.LOADING for s in states):
        return Residence.READY
    if len(states) == len(held):
        return Residence.LOADING
    if all(r is not None or staged for r, staged in held):
        return Residence.STAGED
    return Residence.COLD


def ready_s(view: FleetView, replica: str, key: AdapterKey, where: Residence, clock: LoadClock | None) -> float:
    """Seconds from now by which ``key`` is most likely READY on ``replica`` if a request of it is routed there now:
    0 where it is READY; else the load time the controller measured (``clock``: the fit plus one standard deviation
    of the samples about it) for its shard at the replica's TP, from the host tier (STAGED) or from storage (COLD;
    LOADING: half of it, a load in flight being half done on average); without a clock, unknown (inf). A device
    push's version not landed (``FleetView.device_only``) is never READY where it is not held or loading: inf there
    (nothing can read it until its node copy lands)."""
    if where is Residence.READY:
        return 0.0
    if clock is None or (where is not Residence.LOADING and view.device_only(key)):
        return math.inf
    nbytes = view.shard_bytes(replica, key.name)
    if where is Residence.STAGED:
        return clock.load_s(nbytes, staged=True, spread=True)
    cold = clock.load_s(nbytes, staged=False, spread=True)
    return cold / 2 if where is Residence.LOADING else cold


def replica_loads(view: FleetView, key: AdapterKey, loads: Mapping[str, float],
                  down: Collection[str] = (), limits: RoutingLimits | None = None,
                  clock: LoadClock | None = None, hosted: bool = True) -> list[ReplicaLoad]:
    """Every replica (but ``down``) as the ranking sees it for ``key``; with ``limits``, each with the adapters in
    flight there and its declared admission limits (``lora_cache.routing.limits``); with ``clock``, each with the
    adapter's expected time to READY there (``ready_s``); ``hosted``: as ``residence``."""
    out = []
    for replica in view.replicas():
        if replica in down:
            continue  # a rank of it is lost: a request routed there waits for nothing good
        given = loads.get(replica)
        queue, hints = view.queue(replica), view.hints(replica)  # routed there, not started: read once
        arriving = len(queue) + len(hints)
        load = float(arriving) if given is None else given
        where = residence(view, replica, key, hosted)
        item = ReplicaLoad(replica, where, load, ready_s=ready_s(view, replica, key, where, clock),
                           arriving=arriving)
        if limits is not None:
            named = [(q.adapter, q.version) for q in queue] + [(h.adapter, h.version) for h in hints]
            waiting = [] if given is not None else [  # a request naming a version: a lane of its own, as the engine's
                _lane(view, AdapterKey(a, v or view.adapter(a).version)) for a, v in named]
            lim = limits.limits(replica)
            slots = min((view.capacity(w).slots for w in view.workers(replica)), default=0)
            item = item._replace(flying=limits.flying(replica, given, waiting), max_adapters=lim.max_adapters,
                                 max_running=lim.max_running, scarce=0 < lim.max_adapters < slots,
                                 frees=limits.lane_frees(replica, given))
        out.append(item)
    return out


def advise(view: FleetView, items: Sequence[RouteRequest], config: RouterConfig,
           loads: Mapping[str, float] | None = None, down: Collection[str] = (),
           limits: RoutingLimits | None = None, clock: LoadClock | None = None,
           hosted: bool = True, resolve: Resolve | None = None) -> list[RouteAdvice]:
    """Ranked replicas for every item, in order (``lora_cache.routing.ranking.route_batch``); an item naming an
    unknown adapter or a version not kept gets its own error and takes no load. ``limits``: the
    replicas' admission limits and requests in flight; each item's first pick is recorded there. ``clock``: the
    measured load times and the requests' lead (``lora_cache.routing.clock``). ``hosted``: the shards the ranks
    reported in their host tiers count as staged (the controller's choice: ``ControllerCore.route``).

    ``resolve(name, ref)``: the version kept for a reference (``lora_cache.adapters.refs.version_of``), or a
    ``LoraCacheError``. With it, an item may name one version other than the current one (``A@REF``, or a version
    of its own): it is ranked by where that very version is READY, loading or staged, and takes an engine lane
    of its own (``A@VERSION``, as the engine admits it). Without it only the current version is routed."""
    loads = dict(loads or {})
    if not view.replicas():
        raise ConflictError("no replicas to route to; start some (lora-cache serve --replicas N) or wait for "
                            "their workers to register")
    if not set(view.replicas()) - set(down):
        raise ConflictError(f"every replica has a rank that is lost ({sorted(down)}); wait for their workers to "
                            "come back (lora-cache status shows the workers)")
    unknown = sorted(set(loads) - set(view.replicas()))
    if unknown:
        raise NotFoundError(f"loads name unknown replicas {unknown}; known replicas: {list(view.replicas())}")
    views: dict[str, list[ReplicaLoad]] = {}
    targets: list[AdapterKey | LoraCacheError] = [_target(view, item, resolve) for item in items]
    for key in targets:
        if isinstance(key, AdapterKey) and _lane(view, key) not in views:
            views[_lane(view, key)] = replica_loads(view, key, loads, down, limits, clock, hosted)
    good = [RouteItem(_lane(view, k), i.tokens) for i, k in zip(items, targets) if isinstance(k, AdapterKey)]
    batch = route_batch(good, views, config, clock.lead_s if clock is not None else 0.0)
    if limits is not None:
        limits.record((i.adapter, r[0].replica) for i, r in zip(good, batch))
    ranked = iter(batch)
    return [RouteAdvice(k.name, k.version, next(ranked)) if isinstance(k, AdapterKey)
            else RouteAdvice(i.adapter, i.version, [], k) for i, k in zip(items, targets)]


Resolve = Callable[[str, str], str]  # (name, reference) -> the version kept for it; raises LoraCacheError


def _lane(view: FleetView, key: AdapterKey) -> str:
    """What the ranking and the engine's lanes call ``key``: its name for the current version, ``A@VERSION``
    for another (a distinct adapter to the engine, which admits it as a row of its own)."""
    return key.name if key.version == view.adapter(key.name).version else str(key)


def _target(view: FleetView, item: RouteRequest, resolve: Resolve | None) -> AdapterKey | LoraCacheError:
    """The version ``item`` is to be routed for, or its own error."""
    name, _, ref = item.adapter.partition("@")
    ref = ref or item.version
    try:
        current = view.adapter(name).version
    except LoraCacheError:
        return NotFoundError(f"adapter {name!r} is not registered; register it first (lora-cache register "
                             "NAME PATH) or route the request without an adapter")
    if not ref or ref == current:
        return AdapterKey(name, current)
    if resolve is None:
        return ConflictError(f"version {ref!r} of adapter {name!r} is not current ({current!r}); "
                             "route with the current version or an empty one (a request admitted with an old "
                             "version finishes where it runs)")
    try:
        return AdapterKey(name, resolve(name, ref))
    except LoraCacheError as e:
        return e
