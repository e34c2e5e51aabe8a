"""What a placement policy reads and returns (lifecycle step 3): the words `policies.py` and `staging.py` share.

A policy sees one replica as a `ReplicaView` (its inputs merged over its ranks, and the homes the fleet
placement gives it), asks a `Scorer` what an adapter is worth there, and answers with a `Target`. The
re-planner (`replan.py`) builds the view and the scorer (`popularity.ReplicaScorer`) and diffs the target
into commands. Plain types only: nothing here imports the rules, the counts or the fleet's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple, Protocol

from lora_cache.planner.records import AdapterInfo, Capacity
from lora_cache.vocab import AdapterKey


class Home(NamedTuple):
    """An adapter assigned to a replica: its current version, and the scaled request count each of its homes
    can expect (its fleet-wide count over its copies, what a router that follows residency sends each copy);
    0.0 for an adapter placed only because the fleet holds the catalog (free room only, never displacing)."""

    key: AdapterKey
    per_copy: float


class ReplicaView(NamedTuple):
    """One replica's planning inputs, merged over its ranks."""

    replica: str
    capacity: Capacity  # the smallest among its workers
    resident: frozenset[AdapterKey]  # held by at least one rank (loading counts)
    pinned: frozenset[AdapterKey]  # in use on at least one rank
    queued: tuple[str, ...]  # adapters of the waiting queue, in queue order, no repeats
    hinted: tuple[str, ...]  # adapters of active hints by expected time, no repeats, none queued
    catalog: Mapping[str, AdapterInfo]
    min_bytes: int  # the smallest shard in the catalog
    far_hinted: tuple[str, ...] = ()  # hints beyond the horizon (none queued or near): free room only (horizon.py)
    homes: tuple[Home, ...] = ()  # adapters that call this replica home, best first (homes.py)
    max_bytes: int = 0  # the largest shard in the catalog (0: unknown): bounds a candidate's rate by its score
    last_copies: frozenset[AdapterKey] = frozenset()  # residents held nowhere else, of adapters with requests, while
    # the fleet's slots hold the catalog: no home displaces them (homes.py; it would leave them nowhere)
    lingering: frozenset[AdapterKey] = frozenset()  # residents this replica's requests touched within ``linger_s``:
    # neither speculation nor a home displaces them (a router may have ranked them READY; policies.build_target)


class Target(NamedTuple):
    """What every rank of a replica should hold, most urgent first (a key's index is its priority)."""

    keys: tuple[AdapterKey, ...]
    speculative: frozenset[AdapterKey]  # admitted for popularity alone (not pinned, queued or hinted)
    staged: tuple[AdapterKey, ...] = ()  # needed, given no GPU room: into the host tiers, in need order
    demanded: int = -1  # how many of ``keys`` lead for a request (pinned, queued, hinted); the rest are kept or
    # admitted for their value alone (incumbents, speculation, homes); -1: all of them


class Scorer(Protocol):
    """An adapter's expected value at one replica, per byte of its shard (`popularity.ReplicaScorer`)."""

    def score(self, adapter: str) -> float:
        """Value per byte."""
        ...

    def home_score(self, adapter: str, per_copy: float) -> float:
        """`score` with the replica's count taken as at least `per_copy` (a home's share of the traffic)."""
        ...

    def rate(self, adapter: str) -> float:
        """Expected requests per second at this replica."""
        ...

    def none_reach(self, score: float, max_bytes: int, min_rate: float) -> bool:
        """Whether no adapter scoring `score` or less can be expected at `min_rate` (a scan may stop)."""
        ...

    def ranked(self) -> Iterator[tuple[float, str]]:
        """(score, adapter) for every adapter with a positive score, best first, ties by name."""
        ...
