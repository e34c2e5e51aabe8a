"""The planner's one config dataclass (the CLI is generated from its fields and their help)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lora_cache.planner.errors import ConfigError, known_names

# The placement policies' names, in the registry's order: `policies.POLICIES` maps each to its class (and
# checks that it names these). Listed here so a config is checked when it is made, without importing the rules.
POLICY_NAMES = ("global", "queue", "none")


@dataclass(frozen=True)
class PlannerConfig:
    """How the controller decides what each worker should hold."""

    policy: str = field(default="global", metadata={"help": f"placement policy: {' | '.join(POLICY_NAMES)}"})
    half_life_s: float = field(default=60.0, metadata={"help": "half-life of the decayed popularity counts"})
    local_weight: float = field(default=0.5, metadata={
        "help": "weight of a replica's own counts against the fleet's (per replica) in an adapter's value"})
    hysteresis: float = field(default=0.25, metadata={
        "help": "a popularity prefetch evicts a resident only if its value per byte is more than "
                "(1 + hysteresis) times the resident's"})
    linger_s: float = field(default=1.0, metadata={
        "help": "a copy a replica's requests touched (a hint given or withdrawn, a request queued or leaving the "
                "queue) within this many seconds is displaced by no speculative load and no home, only by needed ones: "
                "a router may have ranked it READY, and its request be on its way (0: off)"})
    max_prefetches_per_plan: int = field(default=4, metadata={
        "help": "popularity prefetches per replica per plan (queued and hinted adapters are not limited)"})
    max_staged_per_replica: int = field(default=4, metadata={
        "help": "needed (queued or hinted) adapters that find no GPU room whose shards each worker of the replica "
                "reads into its host tier ahead, in need order (global policy; 0: none)"})
    speculate_min_rate: float = field(default=0.5, metadata={
        "help": "requests per second a popular (unqueued, unhinted) adapter must be expected to get at a replica to "
                "be loaded into a GPU slot there (0.5: one within 2 s); below it, it is at most staged in the host "
                "tier (0: no gate)"})
    stage_host_share: float = field(default=0.4, metadata={
        "help": "share of each worker's reported host tier that the target's adapters, needed stages and popularity "
                "stages may fill, most demanded per byte first (global policy; the rest is left to the LRU of "
                "recently evicted shards; 0: no popularity staging)"})
    stage_min_rate: float = field(default=0.05, metadata={
        "help": "requests per second a popular adapter must be expected to get at a replica to be staged in its "
                "host tier ahead of need (0.05: one within 20 s; 0: any popular adapter)"})
    warm_host_share: float = field(default=0.5, metadata={
        "help": "global policy: share of each replica's host tier (the smallest rank's) that the fleet-wide warm "
                "placement fills ahead of demand with idle store bandwidth: one copy of as much of the catalog as "
                "fits across the fleet, most requested per byte first, then never-requested adapters smallest "
                "first, in rendezvous order; where one copy of the catalog fits the whole tiers but not this share "
                "of them, every adapter gets its copy in the whole tiers (planner/warming.py; 0: no warming)"})
    warm_disk_share: float = field(default=0.8, metadata={
        "help": "global policy: share of each node's disk tier (each rank's part of it) that the fleet-wide warm "
                "placement fills ahead of demand with the objects of adapters from an object store, in the warm "
                "set's order and placement, beyond what the host tiers keep: a first touch then reads the node's "
                "disk, not the store (planner/warming.py; 0: none; adapters of local files never)"})
    warm_min_miss_s: float = field(default=0.15, metadata={
        "help": "warm only where a miss hurts: once the workers' own reads from storage of the largest shard take "
                "at least this long (their READY reports carry each read's time; routing's load clock fits them). "
                "Below it (a store the page cache holds: ~30-80 ms for an 8B rank-64 shard) warm reads cost the "
                "engine more than they save; a device read at ~1.2 GB/s takes ~0.28 s (0: warm from the start, "
                "without measuring)"})
    warm_refresh_s: float = field(default=5.0, metadata={
        "help": "the warm placement is reassigned (and its stages sent again, which refreshes their place in each "
                "host tier's LRU and re-reads any it dropped) at least this often, and at once when the catalog, "
                "the replicas or their capacities change"})
    rank_refresh_s: float = field(default=1.0, metadata={
        "help": "global policy, warming on: the fleet's ranking of its adapters (most requested first, for the host "
                "tiers' popular eviction order: planner/warming.py, point 5) is sent to a replica's workers when it "
                "changed, at most this often"})
    rank_half_life_s: float = field(default=15.0, metadata={
        "help": "the ranking also reads a fleet-wide request rate of this shorter half-life, and ranks each adapter by "
                "the larger of its two rates: one popular lately ranks by its traffic now, before the half_life_s "
                "counts catch up (0: those counts alone)"})
    rank_idle_k: float = field(default=3.0, metadata={
        "help": "the ranking reads an adapter not requested for T seconds at no more than rank_idle_k / T requests "
                "per second, so one that stopped falls below those asked for now within seconds (a steady adapter "
                "of rate r goes longer than k / r without a request one time in e**k; 0: no cap)"})
    place_homes: bool = field(default=True, metadata={
        "help": "global policy: a replica's free GPU room takes the adapters that call it home (the first replicas "
                "of their rendezvous order, as many as their share of the fleet's traffic: homes.py), never "
                "evicting; when the fleet's slots hold the catalog, adapters with no requests yet too"})
    home_min_rate: float = field(default=0.5, metadata={
        "help": "requests per second per home an adapter must get fleet-wide to be placed at its homes (0.05: "
                "one within 20 s; those below count as having no history)"})
    home_spread: float = field(default=2.0, metadata={
        "help": "homes per replica's worth of an adapter's traffic: copies = ceil(home_spread x share x replicas), "
                "1 to every replica (2: a copy takes at most half a replica's traffic, so a router that follows "
                "residency can still pick the less loaded of its homes; 1: one replica's worth per copy)"})
    home_min_window_s: float = field(default=1.0, metadata={
        "help": "homes read an adapter's rate over the time the counts were kept (a young count is not an "
                "underestimate), but over this long at least: a first request is not a rate"})
    home_refresh_s: float = field(default=1.0, metadata={
        "help": "homes are reassigned at least this often as counts drift (and at once when the catalog, the "
                "replicas or their capacities change, or an adapter newly reaches home_min_rate); 0: every plan"})
    max_candidates_scanned: int = field(default=64, metadata={
        "help": "popular adapters examined per replica per plan before giving up on filling room"})
    hint_ttl_s: float = field(default=30.0, metadata={
        "help": "a hint not fulfilled by a queued request this long after its expected time is dropped"})
    hint_horizon_s: float = field(default=2.0, metadata={
        "help": "hints expected further ahead than this are far: they only fill free GPU room (or are staged), "
                "after queued requests and nearer hints, and never evict; within it they are ordinary hints"})
    max_hints_per_replica: int = field(default=1024, metadata={"help": "active hints kept per replica"})
    max_tombstones: int = field(default=65536, metadata={
        "help": "ids of closed or cancelled hints remembered (for hint_ttl_s) so a late duplicate is ignored; "
                "past it the oldest is forgotten (a late duplicate then costs a prefetch, never correctness)"})
    max_tracked_per_replica: int = field(default=4096, metadata={
        "help": "adapters whose per-replica counts are kept (the least popular are forgotten)"})

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy {self.policy!r} is not registered; "
                              f"choose one of {known_names(POLICY_NAMES)}")
        _positive_seconds("half_life_s", self.half_life_s, "60.0")
        _positive_seconds("hint_ttl_s", self.hint_ttl_s, "30.0")
        if not _finite(self.hint_horizon_s) or self.hint_horizon_s < 0:
            raise ConfigError(f"hint_horizon_s is {self.hint_horizon_s!r}; give a finite number of seconds >= 0, "
                              "e.g. 2.0 (hints expected further ahead only fill free room; 0: only hints due now "
                              "may evict)")
        if not _finite(self.local_weight) or not 0.0 <= self.local_weight <= 1.0:
            raise ConfigError(f"local_weight is {self.local_weight!r}; give a weight in [0, 1] "
                              "(0: fleet-wide counts only, 1: the replica's own counts only)")
        if not _finite(self.linger_s) or self.linger_s < 0:
            raise ConfigError(f"linger_s is {self.linger_s!r}; give a finite number of seconds >= 0, e.g. 1.0 (0: off)")
        if not _finite(self.hysteresis) or self.hysteresis < 0:
            raise ConfigError(f"hysteresis is {self.hysteresis!r}; give a margin >= 0, e.g. 0.25 (a popular "
                              "adapter must be worth 25% more per byte than the resident it would evict)")
        if not _finite(self.speculate_min_rate) or self.speculate_min_rate < 0:
            raise ConfigError(f"speculate_min_rate is {self.speculate_min_rate!r}; give requests per second >= 0, "
                              "e.g. 0.5 (0: every popular adapter that wins a slot is loaded)")
        if not _finite(self.stage_host_share) or not 0.0 <= self.stage_host_share <= 1.0:
            raise ConfigError(f"stage_host_share is {self.stage_host_share!r}; give a share in [0, 1], e.g. 0.4 "
                              "(0: no popularity staging)")
        if not _finite(self.stage_min_rate) or self.stage_min_rate < 0:
            raise ConfigError(f"stage_min_rate is {self.stage_min_rate!r}; give requests per second >= 0, e.g. 0.05 "
                              "(0: stage any popular adapter that fits)")
        if not _finite(self.warm_host_share) or not 0.0 <= self.warm_host_share <= 1.0:
            raise ConfigError(f"warm_host_share is {self.warm_host_share!r}; give a share in [0, 1], e.g. 0.5 "
                              "(0: no warming ahead of demand)")
        if not _finite(self.warm_disk_share) or not 0.0 <= self.warm_disk_share <= 1.0:
            raise ConfigError(f"warm_disk_share is {self.warm_disk_share!r}; give a share in [0, 1], e.g. 0.8 "
                              "(0: no disk warming ahead of demand)")
        if not _finite(self.warm_min_miss_s) or self.warm_min_miss_s < 0:
            raise ConfigError(f"warm_min_miss_s is {self.warm_min_miss_s!r}; give seconds >= 0, e.g. 0.15 (0: warm "
                              "without measuring what a miss costs)")
        if not _finite(self.warm_refresh_s) or self.warm_refresh_s <= 0:
            raise ConfigError(f"warm_refresh_s is {self.warm_refresh_s!r}; give seconds > 0, e.g. 5.0")
        if not _finite(self.rank_half_life_s) or self.rank_half_life_s < 0:
            raise ConfigError(f"rank_half_life_s is {self.rank_half_life_s!r}; give seconds >= 0, e.g. 15.0 (0: the "
                              "half_life_s counts alone)")
        if not _finite(self.rank_idle_k) or self.rank_idle_k < 0:
            raise ConfigError(f"rank_idle_k is {self.rank_idle_k!r}; give a number >= 0, e.g. 3.0 (0: no cap)")
        if not _finite(self.rank_refresh_s) or self.rank_refresh_s < 0:
            raise ConfigError(f"rank_refresh_s is {self.rank_refresh_s!r}; give seconds >= 0, e.g. 1.0 (0: at every "
                              "plan where it changed)")
        if not isinstance(self.place_homes, bool):
            raise ConfigError(f"place_homes is {self.place_homes!r}; give True (spread adapters over the fleet's "
                              "free slots at their homes) or False")
        if not _finite(self.home_min_rate) or self.home_min_rate <= 0:
            raise ConfigError(f"home_min_rate is {self.home_min_rate!r}; give requests per second > 0, e.g. 0.05 "
                              "(to place no adapter at its homes, set place_homes to False)")
        if not _finite(self.home_spread) or self.home_spread < 1:
            raise ConfigError(f"home_spread is {self.home_spread!r}; give a factor >= 1, e.g. 2.0 (1: one home per "
                              "replica's worth of an adapter's traffic)")
        if not _finite(self.home_min_window_s) or self.home_min_window_s <= 0:
            raise ConfigError(f"home_min_window_s is {self.home_min_window_s!r}; give seconds > 0, e.g. 1.0")
        if not _finite(self.home_refresh_s) or self.home_refresh_s < 0:
            raise ConfigError(f"home_refresh_s is {self.home_refresh_s!r}; give seconds >= 0, e.g. 1.0 (0: reassign "
                              "the homes at every plan, which costs a plan on a large fleet)")
        _count("max_prefetches_per_plan", self.max_prefetches_per_plan, 0, "4 (0: no popularity prefetch)")
        _count("max_staged_per_replica", self.max_staged_per_replica, 0, "4 (0: no host-tier staging)")
        _count("max_candidates_scanned", self.max_candidates_scanned, 1, "64")
        _count("max_hints_per_replica", self.max_hints_per_replica, 1, "1024")
        _count("max_tombstones", self.max_tombstones, 1, "65536")
        _count("max_tracked_per_replica", self.max_tracked_per_replica, 1, "4096")


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_seconds(name: str, value: object, example: str) -> None:
    if not _finite(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(f"{name} is {value!r}; give a positive, finite number of seconds, e.g. {example}")


def _count(name: str, value: object, least: int, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name} is {value!r}; give an int >= {least}, e.g. {example}")
