"""Routing advice (lifecycle step 1): rank a fleet's replicas for one request's adapter. Plain Python.

Input, per replica: the adapter's residency there (ready on every TP rank, loading, staged in the host
tier, or absent), the replica's load (requests routed to it and not finished, or its queue) and the
expected wait of its queue. Output: every replica, best first, each with its reason and expected wait.

The rule is consistent hashing with bounded loads (Mirrokni et al., 2018) with residency in place of
the hash ring's order. A replica is *within the bound* when one more request keeps its load at most
``max(min_bound, ceil((1 + epsilon) * (fleet load + 1) / replicas))``; at least one replica always is.
Replicas within the bound come first, by residency (ready, loading, staged, cold), then by expected
wait and load; replicas over the bound follow, least loaded first. So an adapter's requests go where
it is resident until those replicas reach the bound, then overflow to the next replicas (which start
loading it and take its later overflow): its traffic spreads over more replicas as its load grows,
and no replica runs more than ``1 + epsilon`` times the mean (or ``min_bound``) while another has room.

Before the bound, what the replica can start now (``lora_cache.routing.limits``, issue 31): its engine runs at most
``max_adapters`` distinct adapters and ``max_running`` requests at once. A replica without a free adapter lane for
the request (every lane taken by other adapters in flight there) or without room ranks after every replica that can
start it, fewest lanes short first, then by residency (a cold adapter there loads only once a lane frees), then
load: the request would wait at the head of its queue for whole requests to finish. Where a batch runs one adapter
(``max_adapters`` 1) ``oldest_first`` puts, among those as many lanes short, the replica whose running batch was
routed earliest first (``ReplicaLoad.frees``, the routing sequence number of that batch's newest request): it is
likeliest to free its lane soonest (issue 31: on the routing grid's light-load fleets of one lane the wait behind a
whole request decided p99, and residency or load chose the replica whose batch had just started; bench/RESULTS.md).
With more lanes the same proxy for the first batch to end cost more than it saved. Where a batch admits fewer
adapters than the replica's slots, a replica whose batch runs the adapter ranks first within the bound (the request
joins that batch and takes no lane). ``join_over`` (1, off) widens the bound for such a replica where no adapter waits
for a lane there: overflow of a hot adapter to another replica holds one of its lanes for a whole request, and with
Zipf 1.5 traffic the two hottest adapters then held two lanes on each replica, leaving the tail two (issue 42). At 2
it lowered Route's mean at most loads below saturation and raised it 2% (p99 5%) at Zipf 1.0 with every replica's
lanes oversubscribed, so it stays off (bench/reports/issue-42.md, "Joins past the load bound"). A join ranks first
only while the distinct adapters in flight across the fleet fill at least ``join_lanes`` (15%) of its lanes (its
replicas' ``max_adapters`` summed); below that the lane it saves is worth nothing, and it ranks as any replica where
the adapter is READY, least expected wait first (issue 42: on 64 replicas of 4 lanes with 50 adapters at Zipf 1.5
about 23 adapters were in flight over 256 lanes, and joins up to ``min_bound`` stacked the hot adapter's requests
five or six deep on the replicas running it while replicas holding it READY idled: p99 1.18x and mean 1.07x the
better simple router; bench/reports/issue-42.md, "Joins where lanes are plenty").

Within the bound, where lanes are not scarce, an idle replica (nothing in flight) where the adapter will be READY by
the request's arrival ranks first (``idle_ready``): its expected time to READY there (``ReplicaLoad.ready_s``: 0
where READY, else the load time the controller measured for a shard of that size at that TP, from the host tier or
from storage; ``lora_cache.routing.clock``) within the requests' lead (``lead_s``: how long before its arrival a
request is routed, as the hints tell it). The request then starts on arrival, which no busy replica betters: a busy
batch makes it wait for the step in progress (a prefill of tens of ms). Where the load would not finish by then, or
no replica is idle (heavy load), residency decides as before, so the adapter stays where it is (issue 31: on the
routing grid's light-load fleets whose lanes are not scarce, Route sent requests to a busy replica where the adapter
was READY while an idle one would have loaded it in time; bench/RESULTS.md). Where lanes are scarce an idle
replica's free lanes are what the requests no busy replica can start need, and the rule cost more than it saved
there (``idle_scarce``, off; bench/RESULTS.md), save while the fleet has idle replicas to spare (``idle_share``: at
least a quarter of them, and two, idle): then an idle replica where the adapter will be READY within ``idle_late_s``
(one prefill step) of the request's arrival ranks first after the joins (issue 42: on light-load fleets of 4 lanes
and TP 4 Route sent a request where its adapter was READY behind one to three others while least-loaded sent it to
an idle replica that loaded it within a few ms of its arrival; bench/reports/issue-42.md, "Idle replicas where lanes
are scarce"). ``idle_joins`` (off: inf) puts it before them while the idle replicas' lanes number at least
``idle_joins`` x the distinct adapters in flight across the fleet: a join saves a lane, worth nothing while idle lanes
could take every adapter in flight once more (on 64 one-lane replicas with bursty traffic over 50 adapters, two thirds
of them idle, joins queued requests behind their adapter's batch while 16 replicas never got one: p99 1.44x
least-loaded's, 1.03x with it at 1). It stays off: it moved r8-a50-l0.3-uniform-m4-tp4's p99 (median of 10 seeds)
from 1.015x to 1.054x the better simple router's (bench/reports/issue-42.md, "Idle replicas before joins").

Cold replicas with room are taken in a per-(adapter, replica) hash order (``sticky``, rendezvous hashing: an adapter
resident nowhere goes to the same replicas every time, whose planners then see its traffic and keep it), or least loaded
first (``sticky=False``). Where adapter lanes are scarce (``scarce``: ``max_adapters`` < slots), sticky picks hash only
among the cold replicas where the request would start soonest: those that can start it now whose load is within
``cold_slack`` of the least loaded of them (issue 31: on a 64-replica fleet with 5,000 adapters, most resident nowhere,
hash order over every replica within the bound sent them to busy replicas while others idled; bench/RESULTS.md).
``cold_ties`` (off) drops that slack where at least that many of them share the least load: one request's slack keeps a
lone least-loaded replica from taking every cold pick, but where several are least loaded it sends cold picks to busy
replicas too (issue 42: at 2, on 64 replicas of 4 lanes with 5,000 adapters at light load, p99 1.141x -> 1.026x the
better simple router, and r8-a500-l0.3-uniform-m4-tp4 1.108x -> 1.032x; it stays off because on heavy-load fleets of 8
replicas at 4 lanes Route's mean rose 1-3%, bench/reports/issue-42.md, "Cold picks among tied replicas"; on two replicas
it never changes a pick). ``weigh_cold`` (off) ranks a resident replica after those cold ones when its queue's expected
wait exceeds theirs plus a load; measured on every fleet, it did not pay (bench/RESULTS.md). ``weigh_over`` (off)
applies it only where lanes are not scarce and the resident replica's load would exceed the fleet's proportional bound
(``(1 + epsilon)`` x the mean, without ``min_bound``): at light load ``min_bound`` let the one replica where a hot
adapter was READY take 3-7 requests while the others held 1-2, and its requests then arrived during each other's prefill
steps and waited for them (issue 31: r8-a500-l0.3-zipf1.5-m8-tp4's p99, 1.135x -> 0.973x the better simple router with
it; at heavy load the proportional bound is mostly above every replica's load, so residency decides as before). It stays
off: the cold picks it adds cost 1-3% of the mean on light-load fleets of one-rank replicas, whose loads do not fit the
lead (bench/RESULTS.md). ``weigh_arrivals`` (off) ranks, where lanes are not scarce and a replica has a lane free for
every request in flight (its load within ``max_adapters``), by the request's expected start there: the later of its
adapter's READY (``ready_s`` past the lead) and the prefills of the requests routed there that have not started
(``ReplicaLoad.arriving``: its active hints and queue, ``prefill_s`` each), then residency; replicas past their lanes
rank by residency after them (issue 31, sixth round: on the routing grid's light-load fleets the tail was requests sent
where one or two others were about to arrive). In the simulator (32 replicas, Zipf 0.9 over 200 adapters, 64 requests/s,
lead 0.05 s; bench/RESULTS.md) the share of requests whose adapter was ready on arrival under ``global`` placement is
0.955 with the defaults, 0.899 with least-loaded cold picks, 0.864 with ``min_bound=0`` and 0.831 with both
(residency-only routing: 0.890).

Deterministic: the same inputs give the same ranking (ties by the hash, then the replica's name).
A batch is routed in order, each item's pick adding its weight to that replica's load, so a burst of
one adapter in one call spreads as a stream of calls would.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from lora_cache.errors import ConfigError, ConflictError
from lora_cache.planner.rendezvous import rendezvous_hash


class Residence(Enum):
    """Where the adapter's current version is on one replica, best first (the ``reason`` of a pick)."""

    READY = "ready"  # loaded on every TP rank
    LOADING = "loading"  # a load is in flight (or planned) on some rank, none failed
    STAGED = "staged"  # in the host tier (one PCIe copy away), not in a GPU slot
    COLD = "cold"  # nowhere on the replica: a disk read and a copy

    @property
    def order(self) -> int:
        return _ORDER[self]


_ORDER = {r: i for i, r in enumerate(Residence)}


@dataclass(frozen=True)
class RouterConfig:
    """How replicas are ranked for a request's adapter."""

    epsilon: float = field(default=0.25, metadata={
        "help": "load bound: a replica whose load would exceed (1 + epsilon) x the fleet mean ranks after every "
                "replica with room, resident or not"})
    min_bound: float = field(default=8.0, metadata={
        "help": "load every replica may take before the bound applies: what it serves without queueing (8: a "
                "batch of 8 adapters, SGLang's and vLLM's max_loras_per_batch); 0: the bound applies from the "
                "first request"})
    sticky: bool = field(default=True, metadata={
        "help": "an adapter not resident on a replica with room goes to its hash-preferred replica with room "
                "(rendezvous hashing: the same replicas every time, so they keep it), not the least loaded"})
    cold_slack: float = field(default=1.0, metadata={
        "help": "sticky cold picks where lanes are scarce (max_adapters < slots): an adapter goes to its "
                "hash-preferred replica among those that can start it and whose load is within cold_slack of the "
                "least loaded of them (where it starts soonest; inf: the hash-preferred replica within the bound)"})
    cold_ties: int = field(default=0, metadata={
        "help": "where at least this many cold replicas that can start the request share the least load, sticky "
                "cold picks hash among those alone (cold_slack does not apply); fewer: within cold_slack, so one "
                "least-loaded replica does not take every cold pick; 0 (the default): cold_slack always (2 helps "
                "light-load fleets of many replicas and costs heavy-load ones 1-3% of the mean: bench/RESULTS.md)"})
    weigh_cold: bool = field(default=False, metadata={
        "help": "a replica where the adapter is resident ranks after the soonest cold replicas when its expected "
                "wait (its load x request_s) exceeds theirs plus the load (cold_s): ready on a busy replica against "
                "a load on an idle one"})
    request_s: float = field(default=0.05, metadata={
        "help": "expected wait per request ahead of a new one on a replica (its queue's service time)"})
    loading_s: float = field(default=0.02, metadata={"help": "expected wait for a load already in flight"})
    staged_s: float = field(default=0.01, metadata={"help": "expected wait for a host-tier copy into a GPU slot"})
    cold_s: float = field(default=0.1, metadata={"help": "expected wait for a disk read and a copy"})
    lane_s: float = field(default=0.5, metadata={
        "help": "expected wait per adapter lane a replica lacks (its batch holds max_adapters distinct adapters): "
                "about one request's service time"})
    oldest_first: bool = field(default=True, metadata={
        "help": "among replicas of one adapter lane (max_adapters 1) that cannot start the request now (as many "
                "lanes short), the one whose running batch's newest request was routed earliest first: it is "
                "likeliest to free its lane soonest (False, and with more lanes: by residency, then load)"})
    join: bool = field(default=True, metadata={
        "help": "a replica where the adapter's requests run (its batch runs it) ranks first within the bound, "
                "where its batch admits fewer adapters than its slots (a request that joins saves a lane)"})
    join_lanes: float = field(default=0.15, metadata={
        "help": "where lanes are scarce, a join ranks first only while the distinct adapters in flight across the "
                "fleet fill at least this share of its lanes (its replicas' max_adapters summed); below it a join "
                "ranks as any replica where the adapter is READY (least expected wait first): the fleet's lanes hold "
                "its adapters in flight many times over, so saving one saves nothing, and joins stacked a hot "
                "adapter's requests on the replicas running it while replicas holding it READY idled (0: joins "
                "always first)"})
    join_over: float = field(default=1.0, metadata={
        "help": "where lanes are scarce, a replica whose batch runs the request's adapter and where no adapter waits "
                "for a lane counts as within the bound up to join_over x the bound (1: the bound as for any "
                "replica): there the request takes no lane, while overflow elsewhere holds a lane for a whole "
                "request; 2 lowered Route's mean up to 21% at Zipf 1.5 and raised it 2% at Zipf 1.0 with the lanes "
                "saturated (bench/reports/issue-42.md, 'Joins past the load bound')"})
    idle_ready: bool = field(default=True, metadata={
        "help": "where lanes are not scarce, an idle replica (nothing in flight) where the adapter will be READY by "
                "the request's arrival (its measured load time within the requests' lead, both from "
                "lora_cache.routing.clock) ranks first within the bound: the request starts there on arrival, sooner "
                "than behind any busy batch"})
    weigh_over: bool = field(default=False, metadata={
        "help": "where lanes are not scarce, weigh_cold for a resident replica whose load would exceed the fleet's "
                "proportional bound ((1 + epsilon) x the mean, without min_bound): min_bound lets the replica where a "
                "hot adapter is READY take up to min_bound requests while the others hold one or two, and its "
                "arrivals then wait for each other's prefills (off: it cut those p99s but cost 1-3% of the mean on "
                "light-load fleets of one-rank replicas, bench/RESULTS.md)"})
    weigh_arrivals: bool = field(default=False, metadata={
        "help": "where lanes are not scarce, replicas that can start the request within the bound rank by its expected "
                "start: the later of its adapter's READY (ready_s past the lead) and the prefills of the requests "
                "arriving there before it (arriving x prefill_s), then residency (off: measured on the routing grid, "
                "bench/RESULTS.md)"})
    prefill_s: float = field(default=0.03, metadata={
        "help": "weigh_arrivals: expected seconds of one arriving request's prefill ahead of a new one"})
    idle_scarce: bool = field(default=False, metadata={
        "help": "idle_ready also where lanes are scarce (max_adapters < slots), before joins: measured, it cost more "
                "than it saved"})
    idle_share: float = field(default=0.25, metadata={
        "help": "where lanes are scarce, an idle replica where the adapter will be READY within idle_late_s of the "
                "request's arrival ranks first (after joins, or before them: idle_joins) while at least this share "
                "of the replicas (and at least two) are idle: the fleet's free lanes are then plenty, and a busy "
                "replica makes the request wait for its step in progress (inf: off)"})
    idle_late_s: float = field(default=0.03, metadata={
        "help": "idle_share: how long past the request's arrival its adapter may become READY on the idle replica "
                "(about one prefill step, what it would wait behind on a busy replica)"})
    idle_joins: float = field(default=math.inf, metadata={
        "help": "idle_share's idle replica ranks before a replica the request would join while the idle replicas' "
                "lanes number at least idle_joins x the distinct adapters in flight across the fleet (a join saves a "
                "lane, worth nothing while idle lanes could take every adapter in flight once more; inf, the "
                "default: after the joins always; 1 fixed a 64-replica one-lane fleet and moved a light 8-replica "
                "fleet's p99 past its bound, bench/reports/issue-42.md, 'Idle replicas before joins')"})
    token_weight: float = field(default=0.0, metadata={
        "help": "extra load units per prompt token of a routed request (0: every request weighs 1)"})
    cold_traffic: bool = field(default=False, metadata={
        "help": "a cold adapter goes to the cold replica with room that was sent the fewest requests lately "
                "(ReplicaLoad.recent), its hash order only among equals: two hot adapters do not share a replica "
                "because their hashes do (a router that counts its own traffic: LoraCacheRouter)"})

    def __post_init__(self) -> None:
        if not 1 <= self.join_over < math.inf:
            raise ConfigError(f"join_over is {self.join_over}; give a number >= 1 (1: a replica running the "
                              "request's adapter is bound like any other; 2: it may take up to twice the bound)")
        if not 0 <= self.epsilon < math.inf:
            raise ConfigError(f"epsilon is {self.epsilon}; give a number >= 0 (0.25: no replica above 1.25x the "
                              "fleet mean while another has room; 0: strict balance, residency only breaks ties)")
        if not self.cold_slack >= 0:
            raise ConfigError(f"cold_slack is {self.cold_slack}; give a number >= 0 (1: hash order among the "
                              "replicas within one request of the least loaded; inf: hash order within the bound)")
        if not (isinstance(self.cold_ties, int) and self.cold_ties >= 0):
            raise ConfigError(f"cold_ties is {self.cold_ties!r}; give a whole number >= 0 (2: cold picks hash among "
                              "the least-loaded cold replicas where two or more share that load; 0: off)")
        if not self.idle_joins >= 0:
            raise ConfigError(f"idle_joins is {self.idle_joins}; give a number >= 0 (1: idle replicas before joins "
                              "while their lanes match the adapters in flight; inf: after joins always)")
        if not self.idle_share >= 0:
            raise ConfigError(f"idle_share is {self.idle_share}; give a share >= 0 (0.25: the rule applies while a "
                              "quarter of the replicas are idle; inf: off)")
        if not 0 <= self.join_lanes <= 1:
            raise ConfigError(f"join_lanes is {self.join_lanes}; give a share of the fleet's lanes from 0 to 1 (0.15: "
                              "joins rank first while the adapters in flight fill 15% of the lanes; 0: always)")
        for name in ("min_bound", "request_s", "loading_s", "staged_s", "cold_s", "lane_s", "token_weight",
                     "prefill_s", "idle_late_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name} is {getattr(self, name)}; give a finite number >= 0")

    def penalty_s(self, residence: Residence) -> float:
        """The adapter's own expected wait on a replica where it is ``residence``."""
        return {Residence.READY: 0.0, Residence.LOADING: self.loading_s, Residence.STAGED: self.staged_s,
                Residence.COLD: self.cold_s}[residence]


class ReplicaLoad(NamedTuple):
    """One replica as the router sees it for one adapter."""

    replica: str
    residence: Residence
    load: float  # requests routed there and not finished (or queued), in load units
    flying: Mapping[str, int] = {}  # adapters of its requests in flight, oldest first, with counts (routing.limits)
    max_adapters: int = 0  # distinct adapters its batch admits (0: unknown, no limit)
    max_running: int = 0  # requests its batch admits (0: unknown, no limit)
    scarce: bool = False  # its batch admits fewer adapters than its ranks hold: lanes bind before residency
    frees: int = 0  # which running batch frees a lane first, as a routing sequence number (routing.limits; 0: unknown)
    ready_s: float = math.inf  # expected seconds to READY there if routed now (routing.clock; inf: unknown)
    recent: float = 0.0  # requests routed there lately, decayed (RouterConfig.cold_traffic; 0: unknown or none)
    arriving: int = 0  # requests routed there not yet started: active hints and its queue (weigh_arrivals; 0: none)

    def lanes_short(self, adapter: str) -> int:
        """Adapter lanes the replica lacks to start a request of ``adapter`` now: 0 if it is in flight there
        and running (the request joins its batch) or a lane is free; else how many adapters must finish first."""
        if not self.max_adapters:
            return 0
        if self.runs(adapter):
            return 0
        if self.flying.get(adapter, 0) > 0:  # it joins its adapter's queued requests, which wait for a lane too
            return max(0, len(self.flying) - self.max_adapters)
        return max(0, len(self.flying) + 1 - self.max_adapters)

    def runs(self, adapter: str) -> bool:
        """Whether ``adapter``'s requests run there now, as far as the router can tell: it is among the first
        ``max_adapters`` distinct adapters in flight, oldest first (the scheduler admits in arrival order), or
        in flight at all where the limit is unknown. A request of it joins the running batch at once (the
        scheduler admits a request whose adapter runs ahead of older ones that wait for a lane)."""
        if self.flying.get(adapter, 0) <= 0:
            return False
        if not self.max_adapters:
            return True
        for i, name in enumerate(self.flying):
            if i >= self.max_adapters:
                return False
            if name == adapter:
                return True
        return False


class Ranked(NamedTuple):
    """One replica in a ranking: why it is there and how long the request would wait."""

    replica: str
    reason: Residence
    wait_s: float  # the queue ahead of it plus the adapter's load, expected
    within_bound: bool


def bound(loads: Sequence[float], epsilon: float, weight: float = 1.0, floor: float = 0.0) -> float:
    """The most load a replica may have after taking a request of ``weight``: (1 + epsilon) x the mean,
    rounded up, or ``floor`` if that is more."""
    return max(floor, math.ceil((1.0 + epsilon) * (sum(loads) + weight) / len(loads)))


def rank(adapter: str, replicas: Sequence[ReplicaLoad], config: RouterConfig, weight: float = 1.0,
         lead_s: float = 0.0) -> list[Ranked]:
    """Every replica for a request of ``adapter`` weighing ``weight``, best first (module docstring)."""
    if not replicas:
        raise ConflictError(f"no replicas to route adapter {adapter!r} to; add replicas (lora-cache serve "
                           "--replicas N) before asking for routes")
    cap = bound([r.load for r in replicas], config.epsilon, weight, config.min_bound)
    # the least load among the cold replicas that can start the request now: sticky cold picks hash among the
    # replicas within cold_slack of it (where the request would start soonest), not among all within the bound
    cold_loads = [r.load for r in replicas if r.residence is Residence.COLD and r.load + weight <= cap
                  and not r.lanes_short(adapter) and not (r.max_running and r.load + weight > r.max_running)]
    cold_floor = min(cold_loads, default=0.0)
    cold_any = bool(cold_loads)
    # cold_ties: enough replicas share the least load for the hash to spread cold picks among them alone
    ties = config.cold_ties and sum(1 for load in cold_loads if load <= cold_floor) >= config.cold_ties
    cold_slack = 0.0 if ties else config.cold_slack
    cold_wait = cold_floor * config.request_s + config.cold_s
    # the bound without min_bound (weigh_over only: rank runs on every request's path)
    share = bound([r.load for r in replicas], config.epsilon, weight) if config.weigh_over else math.inf
    # idle_share: where lanes are scarce, the idle-replica rule holds only while the fleet has idle replicas to spare
    # (inf: never, as no count reaches it)
    idle = [r for r in replicas if r.load <= 0]
    spare = len(idle) >= max(2.0, config.idle_share * len(replicas))
    # join_lanes: a join saves a lane, worth something only while the fleet's adapters in flight fill its lanes;
    # idle_joins: idle replicas to spare rank before joins while their lanes could take every adapter in flight
    lanes = sum(r.max_adapters for r in replicas) if config.join and config.join_lanes > 0 else 0
    weigh_idle = spare and config.idle_joins < math.inf
    in_flight = len({a for r in replicas for a in r.flying}) if lanes or weigh_idle else 0
    crowded = not lanes or in_flight >= config.join_lanes * lanes
    before_joins = weigh_idle and sum(r.max_adapters for r in idle) >= config.idle_joins * in_flight
    out = []
    for r in replicas:
        short = r.lanes_short(adapter)
        full = bool(r.max_running) and r.load + weight > r.max_running
        joins = r.scarce and r.runs(adapter)  # joining saves a lane only where lanes are scarcer than slots
        # a join where no adapter waits for a lane may go past the bound (join_over): it takes no lane there
        free = joins and config.join and len(r.flying) <= r.max_adapters
        within = r.load + weight <= (cap * config.join_over if free else cap)
        wait = r.load * config.request_s + config.penalty_s(r.residence) + short * config.lane_s
        h = rendezvous_hash(adapter, r.replica)
        if short or full:  # it cannot start there now: last; fewest lanes short, then residency (a cold adapter
            # loads only once a lane frees), then least loaded
            # one lane (max_adapters 1): the batch routed earliest is likeliest to free it first
            age = r.frees if config.oldest_first and r.max_adapters == 1 else 0
            key: tuple[float, ...] = (2, short, age, r.residence.order, r.load, wait)
        elif not within:
            key = (1, r.load, r.residence.order, wait)
        elif joins and config.join and crowded:  # its adapter's requests run there: it joins their batch
            key = (0, -1, wait, r.load)
        elif config.idle_ready and r.load <= 0 and r.ready_s <= lead_s and (config.idle_scarce or not r.scarce):
            key = (0, -2, r.residence.order, h)  # it starts on arrival there: first
        elif config.idle_ready and r.load <= 0 and r.scarce and spare and r.ready_s <= lead_s + config.idle_late_s:
            # lanes scarce, idle replicas to spare: first (idle_joins), or first after joins
            key = (0, -2 if before_joins else -0.75, r.residence.order, h)
        elif config.weigh_arrivals and not r.scarce and r.load + weight <= (r.max_adapters or config.min_bound):
            # a lane free for every request in flight: the request starts once its adapter is READY and the
            # requests arriving before it have had their prefills; the earliest start first, then residency
            eta = 0.0 if r.residence is Residence.READY else (
                max(0.0, r.ready_s - lead_s) if r.ready_s < math.inf else config.penalty_s(r.residence))
            start = max(eta, r.arriving * config.prefill_s)
            tie = float(h) if config.sticky and r.residence is Residence.COLD else r.load
            key = (0, -0.5, start, r.residence.order, tie)
        elif config.sticky and r.residence is Residence.COLD:
            soon = not r.scarce or r.load <= cold_floor + cold_slack  # lanes not scarce: hash order
            first = r.recent if config.cold_traffic else 0.0  # the replica sent fewest requests lately first
            key = (0, r.residence.order, 0 if soon else 1, first if soon else r.load, h)
        elif (config.sticky and cold_any and wait > cold_wait
              and (config.weigh_cold or (config.weigh_over and not r.scarce and r.load + weight > share))):
            key = (0, Residence.COLD.order, 0, 1, wait, r.load)  # after the soonest cold replicas, before the rest
        else:
            key = (0, r.residence.order, wait, r.load)
        out.append((key, h, r.replica, Ranked(r.replica, r.residence, wait, within)))
    out.sort(key=lambda t: t[:3])
    return [t[3] for t in out]


class RouteItem(NamedTuple):
    """One request to route: its adapter (already checked to exist) and its prompt tokens."""

    adapter: str
    tokens: int = 0


def route_batch(items: Iterable[RouteItem], views: Mapping[str, Sequence[ReplicaLoad]],
                config: RouterConfig, lead_s: float = 0.0) -> list[list[Ranked]]:
    """Rank replicas for each item in order; each item's first pick takes its weight before the next.

    ``views``: per adapter of the batch, every replica's state for it (the same replicas, in any order).
    """
    loads: dict[str, float] = {}
    flying: dict[str, Counter[str]] = {}
    out = []
    for item in items:
        view = views[item.adapter]
        if not loads:
            loads = {r.replica: r.load for r in view}
            flying = {r.replica: Counter(r.flying) for r in view}
        weight = 1.0 + config.token_weight * item.tokens
        ranked = rank(item.adapter, [r._replace(load=loads[r.replica], flying=flying[r.replica])
                      for r in view], config, weight, lead_s)
        loads[ranked[0].replica] += weight
        flying[ranked[0].replica][item.adapter] += 1
        out.append(ranked)
    return out
