"""Stateful property test of the planner: random queue reports, hints (duplicate, cancelled, late),
residency reports, worker losses, capacity changes and version bumps, with the invariants checked
after every plan:

- no command evicts an adapter in use, or one a queued/hinted request needs (if it could be held);
- no worker is planned over capacity (held - evicts + prefetches, loading included), unless what it
  keeps is all pinned or needed and nothing is prefetched;
- every needed adapter that fits is planned before any popularity prefetch (and at a lower priority);
- stages: needed ones first (at most max_staged_per_replica), then popularity stages only where the workers
  report a host tier, never of an adapter a rank holds, best per byte first, and what a worker is told to
  keep staged never exceeds its reported host tier;
- hints beyond the horizon are not needs: they hold no slot that a needed (queued or near-hinted)
  adapter could use, and a prefetch for one never comes with an eviction that the rest of the plan
  does not need (far hints only fill free room); they are staged only after the needs;
- the plan is deterministic: a second planner fed the same inputs in another order (catalog, replicas,
  residency lines) gives the same commands;
- a second plan at the same time never evicts what the first prefetched (no thrash);
- `check_integrity()` passes after every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lora_cache.planner import (
    AdapterInfo,
    Capacity,
    Hint,
    Plan,
    Planner,
    PlannerConfig,
    PlannerInputError,
    QueueEntry,
    ReplicaSpec,
    Residency,
    ResidencyEntry,
    SlotState,
    WorkerCommands,
)
from lora_cache.vocab import AdapterKey
from tests.planner_queries import needed_adapters, popularity

EPOCH = 3
ADAPTERS = [f"a{i}" for i in range(7)]
REPLICAS = ["r0", "r1", "r2"]
HINT_IDS = [f"h{i}" for i in range(6)]
SIZES = [100, 200, 300]
BUDGETS = st.none() | st.sampled_from([200, 300, 500, 800])
HOSTS = st.none() | st.sampled_from([0, 300, 800, 2000])  # the host tier a worker reports (None: unknown)


class Snapshot(NamedTuple):
    """The planner's inputs just before a plan, as the checks need them."""

    workers: dict[str, tuple[str, ...]]
    capacity: dict[str, Capacity]
    residency: dict[str, dict[AdapterKey, Residency]]
    needed: dict[str, tuple[str, ...]]
    far: dict[str, tuple[str, ...]]  # adapters hinted beyond the horizon only (not queued, no near hint)
    catalog: dict[str, AdapterInfo]


class PlannerMachine(RuleBasedStateMachine):
    POLICY = "global"

    @initialize(tps=st.lists(st.integers(1, 3), min_size=3, max_size=3),
                slots=st.lists(st.integers(0, 4), min_size=3, max_size=3),
                budgets=st.lists(BUDGETS, min_size=3, max_size=3),
                sizes=st.lists(st.sampled_from(SIZES), min_size=len(ADAPTERS), max_size=len(ADAPTERS)),
                hysteresis=st.sampled_from([0.0, 0.25, 2.0]), max_prefetches=st.integers(0, 3),
                local_weight=st.sampled_from([0.0, 0.5, 1.0]), max_staged=st.integers(0, 3),
                horizon=st.sampled_from([0.0, 2.0, 5.0]),
                hosts=st.lists(HOSTS, min_size=3, max_size=3), stage_share=st.sampled_from([0.0, 0.75, 1.0]),
                min_rate=st.sampled_from([0.0, 0.05, 1.0]))
    def setup(self, tps: list[int], slots: list[int], budgets: list[int | None], sizes: list[int],
              hysteresis: float, max_prefetches: int, local_weight: float, max_staged: int,
              horizon: float, hosts: list[int | None], stage_share: float, min_rate: float) -> None:
        specs = [ReplicaSpec(r, tuple(f"{r}/w{k}" for k in range(tp)), s, b, h)
                 for r, tp, s, b, h in zip(REPLICAS, tps, slots, budgets, hosts, strict=True)]
        infos = [AdapterInfo(a, "v1", size) for a, size in zip(ADAPTERS, sizes, strict=True)]
        config = PlannerConfig(policy=self.POLICY, half_life_s=10.0, hint_ttl_s=8.0, hysteresis=hysteresis,
                               max_prefetches_per_plan=max_prefetches, local_weight=local_weight,
                               max_staged_per_replica=max_staged, hint_horizon_s=horizon,
                               stage_host_share=stage_share, speculate_min_rate=min_rate,
                               warm_min_miss_s=0.0)  # warm stages on from the start: their invariants too
        self.planner = Planner(config, EPOCH, infos, specs)
        self.shadow = Planner(config, EPOCH, infos[::-1], specs[::-1])  # same inputs, another order
        self.now = 0.0
        self.arrivals = 0
        self.new_workers = 0

    # -- inputs ---------------------------------------------------------------------------------------
    @rule(dt=st.floats(0.0, 6.0))
    def wait(self, dt: float) -> None:
        self.now += dt

    @rule(replica=st.sampled_from(REPLICAS), served=st.integers(0, 3),
          arrivals=st.lists(st.sampled_from(ADAPTERS), max_size=3))
    def report_queue(self, replica: str, served: int, arrivals: list[str]) -> None:
        old = list(self.planner.view.queue(replica))
        new = old[served:] + [QueueEntry(a, self._arrival()) for a in arrivals]
        self._both(lambda p: p.report_queue(replica, new, self.now))

    @rule(hint_id=st.sampled_from(HINT_IDS), adapter=st.sampled_from(ADAPTERS),
          replica=st.sampled_from(REPLICAS), delay=st.floats(-10.0, 8.0))
    def add_hint(self, hint_id: str, adapter: str, replica: str, delay: float) -> None:
        self._both(lambda p: p.add_hint(Hint(hint_id, adapter, replica, self.now + delay), self.now))

    @rule(hint_id=st.sampled_from(HINT_IDS))
    def cancel_hint(self, hint_id: str) -> None:
        self._both(lambda p: p.cancel_hint(hint_id, self.now))

    @rule(adapter=st.sampled_from(ADAPTERS), replica=st.sampled_from(REPLICAS), weight=st.integers(1, 5))
    def record_request(self, adapter: str, replica: str, weight: int) -> None:
        self._both(lambda p: p.record_request(adapter, replica, self.now, weight))

    @precondition(lambda self: self._workers())
    @rule(data=st.data())
    def report_residency(self, data: st.DataObject) -> None:
        """A worker's full report: what the planner assumed, with loads finished, acquired, released,
        dropped, and adapters the engine loaded on its own (possibly an older version)."""
        worker = data.draw(st.sampled_from(self._workers()))
        held = sorted(self.planner.view.residency(worker).items())
        entries = [self._evolve(key, res, data) for key, res in held]
        reported = [e for e in entries if e is not None]
        for adapter in data.draw(st.lists(st.sampled_from(ADAPTERS), max_size=2, unique=True)):
            version = data.draw(st.sampled_from(sorted({"v1", self.planner.view.adapter(adapter).version})))
            if all((e.adapter, e.version) != (adapter, version) for e in reported):
                reported.append(ResidencyEntry(adapter, version, SlotState.READY))
        self._both(lambda p: p.report_residency(worker, reported if p is self.planner else reported[::-1]))

    @precondition(lambda self: self._workers())
    @rule(data=st.data())
    def update_residency(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self._workers()))
        held = sorted(self.planner.view.residency(worker).items())
        if not held:
            return
        key, residency = data.draw(st.sampled_from(held))
        entry = self._evolve(key, residency, data)
        if entry is None:
            self._both(lambda p: p.drop_residency(worker, key.name, key.version))
        else:
            self._both(lambda p: p.update_residency(worker, entry))

    @precondition(lambda self: self._workers())
    @rule(data=st.data())
    def lose_worker(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(self._workers()))
        self._both(lambda p: p.remove_worker(worker))

    @rule(replica=st.sampled_from(REPLICAS), slots=st.integers(0, 4), budget=BUDGETS, host=HOSTS)
    def add_worker(self, replica: str, slots: int, budget: int | None, host: int | None) -> None:
        self.new_workers += 1
        worker = f"{replica}/n{self.new_workers}"
        self._both(lambda p: p.add_worker(replica, worker, slots, budget, host))

    @precondition(lambda self: self._workers())
    @rule(data=st.data(), slots=st.integers(0, 4), budget=BUDGETS, host=HOSTS)
    def set_capacity(self, data: st.DataObject, slots: int, budget: int | None, host: int | None) -> None:
        worker = data.draw(st.sampled_from(self._workers()))
        self._both(lambda p: p.set_capacity(worker, slots, budget, host))

    @rule(adapter=st.sampled_from(ADAPTERS), size=st.sampled_from(SIZES))
    def new_version(self, adapter: str, size: int) -> None:
        version = f"v{int(self.planner.view.adapter(adapter).version[1:]) + 1}"
        self._both(lambda p: p.register_adapter(AdapterInfo(adapter, version, size)))

    @rule(bad=st.sampled_from(["replica", "adapter", "worker"]))
    def bad_input(self, bad: str) -> None:
        """Unknown names are refused with a domain error and change nothing."""
        calls: dict[str, Callable[[Planner], Any]] = {
            "replica": lambda p: p.report_queue("nope", [], self.now),
            "adapter": lambda p: p.report_queue("r0", [QueueEntry("nope", 0.0)], self.now),
            "worker": lambda p: p.report_residency("nope", []),
        }
        outcome = self._both(calls[bad])
        assert outcome[0] == "error" and issubclass(outcome[1], KeyError)

    # -- planning -------------------------------------------------------------------------------------
    @rule()
    def plan(self) -> None:
        self._plan_twice(lambda p: p.plan(self.now))

    @rule()
    def plan_all(self) -> None:
        self._plan_twice(lambda p: p.plan_all(self.now))

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "planner"):  # before initialize
            self.planner.check_integrity()
            self.shadow.check_integrity()

    # -- checks ---------------------------------------------------------------------------------------
    def _plan_twice(self, first_call: Callable[[Planner], Plan]) -> None:
        self._both(lambda p: p.advance(self.now))  # expire hints first: the snapshot must see what plan sees
        before = self._snapshot()
        counterfactual = self._without_far_loads(before)
        first = self._both(first_call)[1]
        self._check_plan(first, before)
        for worker in (w for r in first.replicas for w in before.workers[r]):  # far loads never change evicts
            with_far, without = (_evicts(p, worker) for p in (first, counterfactual))
            assert with_far == without, (f"{worker} evicts {with_far} with far hints {before.far}, "
                                         f"{without} without them: far hints changed what is evicted")
        after = self._snapshot()
        second = self._both(lambda p: p.plan_all(self.now))[1]
        self._check_plan(second, after)
        for commands in second.workers:
            earlier = first.for_worker(commands.worker)
            loaded = {(c.adapter, c.version) for c in earlier.prefetches} if earlier else set()
            thrash = loaded & {(c.adapter, c.version) for c in commands.evicts}
            assert not thrash, f"{commands.worker} evicts {thrash} right after prefetching it"

    def _without_far_loads(self, snap: Snapshot) -> Plan:
        """The plan of a copy of the planner whose far hints for adapters its replica does not hold are
        cancelled (resident ones stay: they are kept, and kept the same way, either way)."""
        other = copy.deepcopy(self.planner)
        for replica, far in snap.far.items():
            resident = {k.name for w in snap.workers[replica] for k in snap.residency[w]}
            for hint in other.view.hints(replica):
                if hint.adapter in far and hint.adapter not in resident:
                    other.cancel_hint(hint.hint_id, self.now)
        return other.plan_all(self.now)

    def _check_plan(self, plan: Plan, snap: Snapshot) -> None:
        assert plan.epoch == EPOCH and len(set(plan.replicas)) == len(plan.replicas)
        if self.POLICY == "none":  # on demand: the engines load and evict, the planner sends nothing
            assert not plan.workers, f"policy 'none' sent {plan.workers}"
            return
        for commands in plan.workers:
            assert commands.replica in plan.replicas and commands.commands
            assert all(c.epoch == EPOCH for c in commands.commands)
        for replica in plan.replicas:
            self._check_replica(replica, [c for c in plan.workers if c.replica == replica], snap)

    def _check_replica(self, replica: str, planned: list[WorkerCommands], snap: Snapshot) -> None:
        workers = snap.workers[replica]
        assert {c.worker for c in planned} <= set(workers)
        held = {w: snap.residency[w] for w in workers}
        resident = {k for w in workers for k in held[w]}
        pinned = {k for w in workers for k, r in held[w].items() if r.pinned}
        caps = [snap.capacity[w] for w in workers]
        budgets = [c.bytes for c in caps if c.bytes is not None]
        replica_cap = Capacity(min((c.slots for c in caps), default=0), min(budgets) if budgets else None)
        size = {k: snap.catalog[k.name].bytes_per_rank for w in workers for k in held[w]}
        needed = [snap.catalog[a].key for a in snap.needed[replica]]
        size.update({k: snap.catalog[k.name].bytes_per_rank for k in needed})
        placeable = {k for k in needed if _fits(replica_cap, [], k, size)}
        far = {snap.catalog[a].key for a in snap.far[replica]} - pinned
        size.update({k: snap.catalog[k.name].bytes_per_rank for k in far})
        must_keep = pinned | (set(needed) & resident)
        by_worker = {c.worker: c for c in planned}
        after: dict[str, set[AdapterKey]] = {}
        priorities: dict[AdapterKey, int] = {}
        for worker in workers:
            commands = by_worker.get(worker)
            evicts = {AdapterKey(e.adapter, e.version) for e in commands.evicts} if commands else set()
            prefetches = [(p.priority, AdapterKey(p.adapter, p.version))
                          for p in (commands.prefetches if commands else ())]
            for key in evicts:
                assert key in held[worker], f"{worker} evicts {key}, which it does not hold"
                assert not held[worker][key].pinned, f"{worker} evicts {key} while it is in use"
                assert key not in placeable, f"{worker} evicts {key}, which a queued/hinted request needs"
            order = [p for p, _ in prefetches]
            assert order == sorted(set(order)), f"{worker} prefetch priorities {order} are not increasing"
            for priority, key in prefetches:
                assert key not in held[worker], f"{worker} prefetches {key}, which it holds"
                size.setdefault(key, snap.catalog[key.name].bytes_per_rank)
                assert priorities.setdefault(key, priority) == priority, f"ranks disagree on {key}'s priority"
            all_stages = commands.stages if commands else ()
            stages = [AdapterKey(c.adapter, c.version) for c in all_stages if not c.speculative]
            warm = [AdapterKey(c.adapter, c.version) for c in all_stages if c.speculative]
            self._check_warm(worker, all_stages, warm, resident, {k for _, k in prefetches}, snap)
            wanted = [k for k in stages if k in needed or k in far]
            predicted = stages[len(wanted):]  # popularity stages (staging.py) come after every needed one
            assert stages[:len(wanted)] == wanted, f"{worker} stages {predicted} before needed {wanted}"
            assert len(wanted) <= self.planner.config.max_staged_per_replica, f"{worker} staged {stages}: too many"
            assert not stages or self.POLICY == "global", f"policy {self.POLICY!r} staged {stages}"
            for key in stages:
                assert key not in held[worker] and key not in {k for _, k in prefetches}, (
                    f"{worker} stages {key}, which it holds or is told to load")
            far_stages = [i for i, k in enumerate(wanted) if k in far and k not in needed]
            assert all(i >= len(wanted) - len(far_stages) for i in far_stages), f"{worker}: far hints staged first"
            self._check_predicted(worker, replica, predicted, resident, snap)
            after[worker] = (held[worker].keys() - evicts) | {k for _, k in prefetches}
            cap = snap.capacity[worker]
            within = len(after[worker]) <= cap.slots and (
                cap.bytes is None or sum(size[k] for k in after[worker]) <= cap.bytes)
            assert within or not prefetches, f"{worker} is planned over capacity {cap}: {after[worker]}"
            assert within or after[worker] <= must_keep, (
                f"{worker} keeps {after[worker] - must_keep} over capacity")
            for key in placeable - after[worker] if after[worker] & far else ():
                assert not _fits(replica_cap, sorted(after[worker] - far - _spec(after[worker], resident, needed)),
                                 key, size), f"{worker}: needed {key} is left out while far hints {far} hold room"
        speculative = {k for c in planned for p in c.prefetches
                       if (k := AdapterKey(p.adapter, p.version)) not in resident | set(needed)}
        if not speculative:
            return
        assert self.POLICY == "global", f"policy {self.POLICY!r} speculated {speculative}"
        for worker in workers:
            base = sorted(after[worker] - speculative)
            for key in placeable - after[worker]:
                assert not _fits(replica_cap, base, key, size), (
                    f"{worker}: needed {key} fits but {speculative} was prefetched instead")
        for commands in planned:
            needed_priorities = [p.priority for p in commands.prefetches
                                 if AdapterKey(p.adapter, p.version) in set(needed)]
            speculative_priorities = [p.priority for p in commands.prefetches
                                      if AdapterKey(p.adapter, p.version) in speculative]
            assert max(needed_priorities, default=-1) < min(speculative_priorities, default=1 << 30)

    def _check_warm(self, worker: str, all_stages: Any, warm: list[AdapterKey], resident: set[AdapterKey],
                    prefetched: set[AdapterKey], snap: Snapshot) -> None:
        """Warm stages (warming.py): global only, after every other stage, never of what a rank holds or is
        told to load, each the adapter's current version, no repeats."""
        assert not warm or self.POLICY == "global", f"policy {self.POLICY!r} warmed {warm}"
        flags = [c.speculative for c in all_stages]
        assert flags == sorted(flags), f"{worker}: a warm stage comes before a needed or predicted one"
        assert len(set(warm)) == len(warm), f"{worker} warms {warm} with repeats"
        for key in warm:
            assert key not in resident and key not in prefetched, f"{worker} warms {key}, held or being loaded"
            assert snap.catalog[key.name].key == key, f"{worker} warms {key}, not the current version"

    def _check_predicted(self, worker: str, replica: str, predicted: list[AdapterKey], resident: set[AdapterKey],
                         snap: Snapshot) -> None:
        """Popularity stages: only with a reported host tier, never of what a rank holds, best per byte
        first; and what the worker is told to keep staged never exceeds its reported host tier."""
        hosts = [snap.capacity[w].host_bytes for w in snap.workers[replica]]
        host = min((h for h in hosts if h is not None), default=None)
        assert not predicted or host is not None, f"{worker} stages {predicted} with no host tier reported"
        assert not set(predicted) & resident, f"{worker} stages {set(predicted) & resident}, which a rank holds"
        scores = [self._score(k.name, replica) for k in predicted]
        assert scores == sorted(scores, reverse=True), f"{worker} stages {predicted} out of demand order {scores}"
        if host is not None:
            kept = self.planner._fleet.staged.get(worker, frozenset())
            total = sum(snap.catalog[k.name].bytes_per_rank for k in kept if k.name in snap.catalog)
            assert total <= host, f"{worker} is told to keep {total} bytes staged, over its host tier ({host})"

    def _score(self, adapter: str, replica: str) -> float:
        """The scorer's value per byte, from the planner's decayed counts (the same order as its scaled ones)."""
        p, weight = self.planner, self.planner.config.local_weight
        value = ((1.0 - weight) / len(p.view.replicas()) * popularity(p, adapter, self.now)
                 + weight * popularity(p, adapter, self.now, replica))
        return value / p.view.adapter(adapter).bytes_per_rank

    # -- helpers --------------------------------------------------------------------------------------
    def _both(self, call: Callable[[Planner], Any]) -> tuple[str, Any]:
        """Run `call` on both planners; they must agree (on the result, or on the error's type)."""
        outcomes: list[tuple[str, Any]] = []
        for planner in (self.planner, self.shadow):
            try:
                outcomes.append(("ok", call(planner)))
            except (PlannerInputError, KeyError) as error:
                outcomes.append(("error", type(error)))
        assert outcomes[0] == outcomes[1], f"planners disagree: {outcomes}"
        return outcomes[0]

    def _snapshot(self) -> Snapshot:
        p = self.planner
        workers = {r: p.view.workers(r) for r in p.view.replicas()}
        every = [w for ws in workers.values() for w in ws]
        needed = {r: needed_adapters(p, r) for r in workers}
        horizon = p.config.hint_horizon_s
        far = {r: tuple(dict.fromkeys(h.adapter for h in p.view.hints(r) if h.expected_s - horizon > self.now
                                      and h.adapter not in needed[r])) for r in workers}
        return Snapshot(workers, {w: p.view.capacity(w) for w in every}, {w: p.view.residency(w) for w in every},
                        needed, far, {a: p.view.adapter(a) for a in ADAPTERS})

    def _workers(self) -> list[str]:
        return sorted(w for r in self.planner.view.replicas() for w in self.planner.view.workers(r))

    def _arrival(self) -> float:
        self.arrivals += 1
        return float(self.arrivals)

    @staticmethod
    def _evolve(key: AdapterKey, residency: Residency, data: st.DataObject) -> ResidencyEntry | None:
        action = data.draw(st.sampled_from(["keep", "ready", "acquire", "release", "drop"]))
        if action == "drop":
            return None
        state, refcount = {
            "keep": (residency.state, residency.refcount),
            "ready": (SlotState.READY, 0),
            "acquire": (SlotState.IN_USE, data.draw(st.integers(1, 2))),
            "release": (SlotState.READY, 0),
        }[action]
        return ResidencyEntry(key.name, key.version, state, refcount)


def _evicts(plan: Plan, worker: str) -> tuple[Any, ...]:
    commands = plan.for_worker(worker)
    return commands.evicts if commands else ()


def _spec(after: set[AdapterKey], resident: set[AdapterKey], needed: list[AdapterKey]) -> set[AdapterKey]:
    """Keys loaded for popularity alone: planned, neither resident before nor needed."""
    return after - resident - set(needed)


def _fits(cap: Capacity, base: list[AdapterKey], key: AdapterKey, size: dict[AdapterKey, int]) -> bool:
    used = sum(size[k] for k in base)
    return len(base) + 1 <= cap.slots and (cap.bytes is None or used + size[key] <= cap.bytes)


class QueueMachine(PlannerMachine):
    POLICY = "queue"


class NoneMachine(PlannerMachine):
    POLICY = "none"


_FAST = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much]}
TestGlobalPlanner = PlannerMachine.TestCase
TestGlobalPlanner.settings = settings(max_examples=150, stateful_step_count=40, **_FAST)  # type: ignore[arg-type]
TestQueuePlanner = QueueMachine.TestCase
TestQueuePlanner.settings = settings(max_examples=60, stateful_step_count=30, **_FAST)  # type: ignore[arg-type]
TestNonePlanner = NoneMachine.TestCase
TestNonePlanner.settings = settings(max_examples=15, stateful_step_count=20, **_FAST)  # type: ignore[arg-type]


# Counterexamples found by exploration (2026-11-27, 4,000 examples), replayed step by step through the machine's
# own rules and checks: kept as regression tests, since CI's derandomized examples do not reach them.
def _fleet_of_three(machine: PlannerMachine, slots: list[int]) -> None:
    machine.setup(tps=[1, 1, 1], slots=slots, budgets=[None, None, 200], sizes=[100, 200] + [100] * 5,
                  hysteresis=0.0, max_prefetches=1, local_weight=0.0, max_staged=0, horizon=0.0,
                  hosts=[None, None, None], stage_share=0.0, min_rate=1.0)
    machine.record_request(adapter="a1", replica="r1", weight=3)
    machine.report_queue(arrivals=["a0"], replica="r2", served=0)
    machine.plan()
    machine.report_queue(arrivals=[], replica="r2", served=1)
    machine.add_hint(adapter="a2", delay=1.0, hint_id="h0", replica="r2")
    machine.plan()


def test_a_far_hints_load_into_free_room_does_not_spare_an_incumbent_a_home_displaces() -> None:
    """The far hint took the free room a hot adapter's home needed, so the home displaced nothing: with the hint
    cancelled, the same plan evicted an incumbent. Far hints now take only the room the homes leave free (they
    first took the room before the homes, and a home displaced their loads first: that missed the far-hinted
    adapter that is itself a home, tests/test_hint_horizon.py)."""
    _fleet_of_three(PlannerMachine(), slots=[0, 1, 2])


def test_a_deferred_home_still_displaces_so_a_new_rank_is_not_told_to_load_what_the_next_plan_evicts() -> None:
    """A new rank of a TP-2 replica was told to load every kept incumbent; a home past the load limit was skipped,
    and the next plan evicted one of those incumbents for it. A deferred home now claims its room as deferred
    speculation does."""
    machine = PlannerMachine()
    _fleet_of_three(machine, slots=[4, 0, 3])
    machine.plan()
    machine.add_hint(adapter="a2", delay=0.0, hint_id="h3", replica="r0")
    machine.add_worker(budget=800, host=2000, replica="r0", slots=4)
    machine.record_request(adapter="a4", replica="r0", weight=3)
    machine.new_version(adapter="a0", size=300)
    machine.plan()
