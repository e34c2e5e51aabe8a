"""Predictive staging (lifecycle step 5 ahead of need): what each worker of a replica reads into its host tier.

A GPU slot is scarce; the pinned host tier is larger and a staged shard turns a miss's disk read into one
host-to-GPU copy. The stages of a replica's target are, in order:

1. needed adapters (queued, then near hints, then far hints) that found no GPU room, at most
   `max_staged_per_replica` of them (hard needs: the request is known);
2. predicted ones: the replica's popular adapters (fleet-wide and routed-here counts, `ReplicaScorer`;
   none queued or hinted: those are bounded by step 1),
   expected at the replica at `stage_min_rate` or more (with a router that follows residency, the fleet's
   popular adapters mostly go elsewhere: staging them all read 5x the disk bytes at 32 replicas),
   most demanded per byte first, that the target does not place in a GPU slot and no rank holds,
   while their bytes fit `stage_host_share` of the host tier the workers report (the smallest rank's),
   less the bytes of the target's adapters (a load passes through the host tier and its shard stays
   there, LRU) and of the needed stages. So a host tier not much larger than the GPU working set
   (2 GiB against 8 slots of up to 335 MB in the benchmark) gets no predicted stages: they would only
   push out shards of recently evicted adapters, which the LRU already keeps (simulated: up to +20%
   disk bytes for no TTFT gain); a 16 GiB tier gets about 5 GiB of them (bench/RESULTS.md);
   needed stages themselves fit the whole host tier less those loads.

So a stage never exceeds the reported host capacity, never names what a rank holds or the target loads,
and predicted stages come in the scorer's order. Unknown host capacity (None): no predicted stages.
"""

from __future__ import annotations

from collections.abc import Iterable

from lora_cache.planner.config import PlannerConfig
from lora_cache.planner.view import ReplicaView, Scorer
from lora_cache.vocab import AdapterKey


def plan_stages(view: ReplicaView, scorer: Scorer, homeless: Iterable[AdapterKey],
                target: tuple[AdapterKey, ...], config: PlannerConfig) -> tuple[AdapterKey, ...]:
    """The replica's stages in order: needed ones without GPU room, then predicted ones within the budget."""
    loads = _bytes(view, (k for k in target if k not in view.resident))
    homeless = tuple(homeless)
    needed = homeless[:config.max_staged_per_replica]
    host = view.capacity.host_bytes
    if host is None or view.capacity.slots < 1:  # no bound reported, or no slot to load a staged shard into
        return needed
    needed = fitting(view, needed, host - loads)
    held = _bytes(view, (k for k in target if k in view.resident))  # their shards sit in the host tier's LRU too
    budget = int(host * config.stage_host_share) - held - loads - _bytes(view, needed)
    taken = set(target) | set(homeless)  # needed ones past the bound are not staged for popularity either
    taken |= {view.catalog[name].key for name in (*view.queued, *view.hinted, *view.far_hinted)}
    return needed + predicted_stages(view, scorer, taken, budget, config.max_candidates_scanned,
                                     config.stage_min_rate)


def predicted_stages(view: ReplicaView, scorer: Scorer, taken: set[AdapterKey], budget: int,
                     scan: int, min_rate: float = 0.0) -> tuple[AdapterKey, ...]:
    """Popular adapters neither held nor taken, expected here at `min_rate` or more, best per byte first,
    while their bytes fit `budget`."""
    staged: list[AdapterKey] = []
    for score, name in scorer.ranked():
        if scan <= 0 or budget < view.min_bytes:
            break
        info = view.catalog[name]
        if scorer.rate(name) < min_rate:
            if scorer.none_reach(score, view.max_bytes, min_rate):
                break  # no later candidate (a lower score) is expected at min_rate
            continue
        if info.key in taken or info.key in view.resident:
            continue
        scan -= 1
        if info.bytes_per_rank <= budget:
            budget -= info.bytes_per_rank
            staged.append(info.key)
    return tuple(staged)


def fitting(view: ReplicaView, keys: tuple[AdapterKey, ...], budget: int) -> tuple[AdapterKey, ...]:
    """The prefix of `keys` (in need order) whose bytes fit `budget`."""
    kept: list[AdapterKey] = []
    for key in keys:
        size = view.catalog[key.name].bytes_per_rank
        if size > budget:
            break
        budget -= size
        kept.append(key)
    return tuple(kept)


def _bytes(view: ReplicaView, keys: Iterable[AdapterKey]) -> int:
    return sum(view.catalog[k.name].bytes_per_rank for k in keys)
