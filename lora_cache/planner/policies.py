"""Placement policies (lifecycle step 3): what one replica's workers should hold, in priority order.

A policy turns a `ReplicaView` into a `Target` (both in `view.py`): the adapter versions every rank of the
replica should hold, most urgent first. The re-planner (`replan.py`) diffs the target against each worker's
residency into commands. Policies are picked by name from `POLICIES` (whose names `config.POLICY_NAMES`
lists, so a config is checked without importing the rules); the rules they share are small functions here:

1. pinned: whatever any rank has in use stays, and ranks missing it load it first;
2. needed (queued, then hinted): resident ones are never evicted; the others are admitted in order
   while they fit, displacing anything that is neither pinned nor needed, lowest value per byte first;
3. incumbents: other residents of the current version stay while there is room, else the lowest
   value per byte go first; stale versions always go;
4. speculation (`global` only): popular adapters fill free room, and may evict an incumbent only if
   worth more than (1 + hysteresis) times as much per byte; at most `max_prefetches_per_plan` load
   per plan, the rest are deferred (their room kept free) to the next plan;
   A popular adapter not resident is loaded only if expected at the replica at `speculate_min_rate`
   requests per second or more (a load that is evicted unused wastes disk and PCIe bandwidth);
5. staging (`global` only, `staging.py`): the first `max_staged_per_replica` needed adapters that found
   no GPU room (every slot pinned or holding another needed adapter) are read into the workers' host
   tiers, so the load that follows when a slot frees is one host-to-GPU copy, not a disk read and a
   copy; then popular adapters the target leaves out, within a share of the reported host tier.
6. homes (`global` only, `homes.py`): adapters the fleet placement assigns to this replica take the
   free room left, and one with traffic of its own may displace incumbents worth clearly less than its
   home score (its share of its traffic once routed here); a resident home is valued at least at it.
   It may displace this plan's own speculative loads and earlier homes on the same terms (the next plan
   weighs them as incumbents, so leaving them would evict them right after loading them: thrash); past the
   load limit a home is deferred like speculation (it claims its room).
   Hints beyond the horizon (`far_hinted`, see `horizon.py`) are not needs: resident ones are kept like
   incumbents (needs displace them; speculation and homes do not, or they would evict what they let in); the
   others compete in speculation on their popularity alone, and otherwise only take room that rules 1-4 and
   6 left free (never evicting), ranked before speculation's loads; they are staged after the near needs.
   Far hints take their room after the homes, not before: an adapter both far-hinted and homed here, loaded
   first as a far hint, was the first load a later home displaced, where without the hint its home had
   claimed the room and the later home evicted an incumbent (tests/test_hint_horizon.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from lora_cache.planner.config import POLICY_NAMES, PlannerConfig
from lora_cache.planner.records import Capacity
from lora_cache.planner.staging import plan_stages
from lora_cache.planner.view import ReplicaView, Scorer, Target
from lora_cache.vocab import AdapterKey

Scored = tuple[float, AdapterKey]  # (value per byte, key)


class Room:
    """Free slots and bytes while a target is built; may go negative while over capacity. A shard's bytes count
    in whole pages of the pool where it has them (``Capacity.gpu_bytes``)."""

    __slots__ = ("bytes", "capacity", "slots")

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.slots = capacity.slots
        self.bytes = capacity.bytes

    def fits(self, size: int) -> bool:
        return self.slots >= 1 and (self.bytes is None or self.bytes >= self.capacity.gpu_bytes(size))

    def over(self) -> bool:
        return self.slots < 0 or (self.bytes is not None and self.bytes < 0)

    def take(self, size: int, sign: int = 1) -> None:
        self.slots -= sign
        if self.bytes is not None:
            self.bytes -= sign * self.capacity.gpu_bytes(size)

    def give(self, size: int) -> None:
        self.take(size, -1)


class PlacementPolicy(Protocol):
    uses_hints: bool
    uses_homes: bool  # reads the fleet placement (ReplicaView.homes); the planner keeps it only then

    def target(self, view: ReplicaView, scorer: Scorer, config: PlannerConfig) -> Target | None:
        """The replica's target, or None to leave its workers alone."""
        ...


class NonePolicy:
    """On-demand only: the planner sends nothing; engines load what they need when they need it."""

    uses_hints = False
    uses_homes = False

    def target(self, view: ReplicaView, scorer: Scorer, config: PlannerConfig) -> Target | None:
        return None


class QueuePolicy:
    """S-LoRA: each replica prefetches the adapters of its own waiting queue, in order; no hints."""

    uses_hints = False
    uses_homes = False

    def target(self, view: ReplicaView, scorer: Scorer, config: PlannerConfig) -> Target | None:
        return build_target(view, scorer, view.queued, config, speculate=False, stage=False)


class GlobalPolicy:
    """This project: queue, then hints, then fleet-wide popularity into free room (with hysteresis);
    needed adapters left without GPU room are staged in the host tiers."""

    uses_hints = True
    uses_homes = True

    def target(self, view: ReplicaView, scorer: Scorer, config: PlannerConfig) -> Target | None:
        return build_target(view, scorer, view.queued + view.hinted, config, speculate=True, stage=True)


POLICIES: dict[str, type[PlacementPolicy]] = {
    "global": GlobalPolicy,
    "queue": QueuePolicy,
    "none": NonePolicy,
}
assert tuple(POLICIES) == POLICY_NAMES, f"config.POLICY_NAMES {POLICY_NAMES} must name the registry's {tuple(POLICIES)}"


def build_target(view: ReplicaView, scorer: Scorer, needed: tuple[str, ...],
                 config: PlannerConfig, speculate: bool, stage: bool) -> Target:
    room = Room(view.capacity)
    keys = sorted(view.pinned)
    for key in keys:
        room.take(_size(view, key))
    wanted = _needed_keys(view, needed, set(keys))
    keys += _admit_needed(view, wanted, room)
    chosen = set(keys)
    homed = {h.key: h.per_copy for h in view.homes if h.per_copy > 0} if speculate else {}
    kept = _trim(_incumbents(view, chosen, scorer, homed), room, view)
    far = _needed_keys(view, view.far_hinted, chosen)
    # speculation and homes may not displace these: far hints' (no thrash), and copies requests touched just now
    # (a router may have ranked them READY and their request be on its way: ``PlannerConfig.linger_s``)
    far_held = [sk for sk in kept if sk[1] in far or sk[1] in view.lingering]
    kept = [sk for sk in kept if sk[1] not in far and sk[1] not in view.lingering]
    held = chosen | {k for _, k in far_held}
    admitted = _speculate(view, scorer, held, kept, room, config) if speculate else []
    held |= {k for _, k in admitted}
    homes = _homes(view, scorer, held, kept, admitted, room, config) if speculate else []
    held |= set(homes)  # far hints take only the room the homes leave free: they never change what a home evicts
    far_in = _free_room(view, [k for k in far if k not in held and k not in view.resident], room)
    popular = sorted(kept + far_held + admitted, key=lambda sk: (-sk[0], sk[1]))
    target = tuple(keys) + tuple(far_in) + tuple(k for _, k in popular) + tuple(homes)
    homeless = [k for k in wanted if k not in chosen] + [k for k in far if k not in target]
    staged = plan_stages(view, scorer, homeless, target, config) if stage else ()
    return Target(target, frozenset(k for _, k in admitted) | frozenset(homes), staged, len(keys) + len(far_in))


def _homes(view: ReplicaView, scorer: Scorer, held: set[AdapterKey], kept: list[Scored],
           speculated: list[Scored], room: Room, config: PlannerConfig) -> list[AdapterKey]:
    """Adapters homed here, in the home book's order, a current version only: into the free room left, or, for
    an adapter with traffic of its own, in place of what is worth clearly less per byte than its home score
    (`ReplicaScorer.home_score`: a full fleet still gets a hot adapter's copies, where a router that follows
    residency sends its traffic). An adapter placed only because the fleet holds the catalog never displaces.

    What can be displaced is what the next plan would weigh as an incumbent: `kept` ones, and this plan's own
    choices, speculative loads (`speculated`) and homes admitted before, valued as they would be once resident
    (`_incumbent_score`). Otherwise the next plan would evict one of them for this home right after this plan
    loads it (thrash); displaced here, it is never sent, and its load goes to the home. Far hints' loads are not
    placed yet (`build_target` gives them the room the homes leave), so a far hint never changes what a home
    claims or evicts. `kept` and `speculated` lose what is displaced. While the fleet's slots
    hold the catalog, a home never displaces the fleet's last copy of an adapter with requests
    (`view.last_copies`): that adapter would be left nowhere though every adapter has a place (a copy of a hot
    adapter took the slot of one just loaded for its request, and its next request loaded it again:
    tests/test_homes.py, tests/test_ray_serve.py).

    Loads stay within `max_prefetches_per_plan` (with speculation's); past it a home is deferred as in
    `_speculate`: it still claims its room and displaces what it would, and the next plan loads it into the
    room left free. So what is evicted never depends on the limit (a rank that lacks a kept incumbent is not
    told to load it now and evict it next plan)."""
    loads_left = config.max_prefetches_per_plan - sum(k not in view.resident for _, k in speculated)
    homed = {h.key: h.per_copy for h in view.homes if h.per_copy > 0}
    own: list[Scored] = []  # homes admitted so far, at their value once resident
    for home in view.homes:
        key = home.key
        info = view.catalog[key.name]
        size = info.bytes_per_rank
        if key in held or key in view.resident or info.key != key or not _placeable(view, size):
            continue
        if not room.fits(size):
            score = scorer.home_score(key.name, home.per_copy) if home.per_copy > 0 else 0.0
            eligible = sorted(sk for sk in kept + speculated + own if sk[1] not in view.last_copies)  # lowest first
            victims = _victims(eligible, score, size, room, view, config.hysteresis) if score > 0 else 0
            if victims == 0:
                continue
            for scored in eligible[:victims]:
                room.give(_size(view, scored[1]))
                group = next(g for g in (own, speculated, kept) if scored in g)
                loads_left += group is own or (group is speculated and scored[1] not in view.resident)
                group.remove(scored)
        room.take(size)
        if loads_left > 0:
            loads_left -= 1
            own.append((_incumbent_score(scorer, key, homed), key))
    admitted = {k for _, k in own}
    return [h.key for h in view.homes if h.key in admitted]


def _free_room(view: ReplicaView, keys: list[AdapterKey], room: Room) -> list[AdapterKey]:
    """The keys that fit the room left free, in order; nothing is displaced for them."""
    admitted = []
    for key in keys:
        if room.fits(_size(view, key)):
            room.take(_size(view, key))
            admitted.append(key)
    return admitted


def _needed_keys(view: ReplicaView, needed: Iterable[str], pinned: set[AdapterKey]) -> list[AdapterKey]:
    """Current versions of the needed adapters that one rank could hold at all, minus pinned ones."""
    keys = []
    for name in needed:
        info = view.catalog[name]
        if info.key not in pinned and _placeable(view, info.bytes_per_rank):
            keys.append(info.key)
    return keys


def _admit_needed(view: ReplicaView, needed: list[AdapterKey], room: Room) -> list[AdapterKey]:
    """Resident needed keys all stay; the others are admitted in order while they fit."""
    for key in needed:
        if key in view.resident:
            room.take(_size(view, key))
    admitted = []
    for key in needed:
        if key in view.resident:
            admitted.append(key)
        elif room.fits(_size(view, key)):
            room.take(_size(view, key))
            admitted.append(key)
    return admitted


def _incumbents(view: ReplicaView, chosen: set[AdapterKey], scorer: Scorer,
                homed: Mapping[AdapterKey, float]) -> list[Scored]:
    """Residents neither pinned nor needed, of the current version and placeable; lowest score first."""
    found = []
    for key in view.resident - chosen:
        info = view.catalog[key.name]
        if info.version == key.version and _placeable(view, info.bytes_per_rank):
            found.append((_incumbent_score(scorer, key, homed), key))
    return sorted(found)


def _incumbent_score(scorer: Scorer, key: AdapterKey, homed: Mapping[AdapterKey, float]) -> float:
    """A resident's value per byte. One homed here (``homed``: key -> its count per copy) is worth its home
    score if that is more: speculation must not evict a hot adapter's new copy before the router's traffic
    to it shows in its counts."""
    score = scorer.score(key.name)
    return max(score, scorer.home_score(key.name, homed[key])) if key in homed else score


def _trim(incumbents: list[Scored], room: Room, view: ReplicaView) -> list[Scored]:
    """Keep the most valuable incumbents that fit; the list stays lowest first."""
    for _, key in incumbents:
        room.take(_size(view, key))
    dropped = 0
    while room.over() and dropped < len(incumbents):
        room.give(_size(view, incumbents[dropped][1]))
        dropped += 1
    return incumbents[dropped:]


def _speculate(view: ReplicaView, scorer: Scorer, chosen: set[AdapterKey],
               kept: list[Scored], room: Room, config: PlannerConfig) -> list[Scored]:
    """Popular adapters into free room, or in place of incumbents worth clearly less per byte.

    `kept` (lowest first) loses the incumbents that are displaced. Past `max_prefetches_per_plan`,
    candidates are deferred, not dropped: they still claim room and displace incumbents as they would
    without the limit, and a later plan loads them into the room left free. So eviction never depends
    on the limit, and the next plan only fills room: it cannot evict what this plan loaded.
    """
    admitted: list[Scored] = []
    if config.max_prefetches_per_plan == 0:
        return admitted
    holding = {key for _, key in kept}  # what the target keeps so far (incumbents and admitted)
    loads = scanned = 0
    for score, name in scorer.ranked():
        deferring = loads >= config.max_prefetches_per_plan
        if scanned >= config.max_candidates_scanned or (deferring and not kept):
            break  # nothing left that a deferred candidate could displace
        info = view.catalog[name]
        # A resident trimmed for room (or displaced above) competes again like any candidate: the next
        # plan would see it as one, so skipping it here would let that plan evict what this one loads.
        if info.key in chosen or info.key in holding or not _placeable(view, info.bytes_per_rank):
            continue
        resident = info.key in view.resident  # taking it back costs no load on the ranks that hold it
        if not resident and scorer.rate(name) < config.speculate_min_rate:
            if scorer.none_reach(score, view.max_bytes, config.speculate_min_rate):
                break  # no later candidate (a lower score) can reach the gate: not even the largest shard
            continue  # not expected soon enough to be worth a load: staging may take it (staging.py)
        scanned += 1
        if not room.fits(info.bytes_per_rank):
            victims = _victims(kept, score, info.bytes_per_rank, room, view, config.hysteresis)
            if victims == 0:
                if not _beats(score, kept, config.hysteresis) and not _has_room(room, view.min_bytes):
                    break  # later (lower) scores beat no incumbent either, and nothing fits the free room
                continue
            for _, key in kept[:victims]:
                room.give(_size(view, key))
                holding.discard(key)
            del kept[:victims]
        room.take(info.bytes_per_rank)
        if not deferring or resident:
            admitted.append((score, info.key))
            holding.add(info.key)
            loads += not resident
    return admitted


def _victims(kept: list[Scored], score: float, size: int, room: Room, view: ReplicaView,
             hysteresis: float) -> int:
    """How many of the weakest incumbents must go for `size` to fit, each beaten by `score`; 0: no way."""
    trial = Room(room.capacity._replace(slots=room.slots, bytes=room.bytes))
    for count, (resident_score, key) in enumerate(kept, start=1):
        if not score > resident_score * (1.0 + hysteresis):
            return 0
        trial.give(_size(view, key))
        if trial.fits(size):
            return count
    return 0


def _has_room(room: Room, min_bytes: int) -> bool:
    return room.slots >= 1 and (room.bytes is None or room.bytes >= room.capacity.gpu_bytes(min_bytes))


def _beats(score: float, kept: list[Scored], hysteresis: float) -> bool:
    return bool(kept) and score > kept[0][0] * (1.0 + hysteresis)


def _placeable(view: ReplicaView, size: int) -> bool:
    budget = view.capacity.bytes
    return view.capacity.slots >= 1 and (budget is None or view.capacity.gpu_bytes(size) <= budget)


def _size(view: ReplicaView, key: AdapterKey) -> int:
    return view.catalog[key.name].bytes_per_rank
