"""One replica's serving loop in simulated time: ``workers.engine.engine.serve_rank`` over its TP ranks.

The scheduler is the real ``workers.engine.scheduler.Scheduler`` with the real admission rule; this
module replays what the engine loop does around it, round after round:

1. rules that prefetch (overlap): each rank pins the *previous* round's wanted adapters that are READY
   on it and reports them (and loads it started that failed); the minimum over ranks is the view;
2. ``scheduler.plan(now, view)``;
3. after the round's host time (``Calibration.round_s``: scheduling and reports, plus the readiness
   exchange for rules that prefetch), the plan runs on every rank: a step (``acquire`` the batch's and
   the running requests' adapters, adapter by adapter, waiting until each missing one's load is
   issued; start the plan's prefetches; compute once every held load is READY on every rank;
   release), or a wait (start the prefetches; until a held-back adapter's load finishes on every
   rank, or a request arrives), or idle.

Between rounds, a request that arrives while a round or step is under way has its adapter pinned on every
rank where it is READY and its load started on the others (for rules that prefetch; the load only while the
last round's wanted adapters plus those taken at arrival are fewer than the slots), as ``Arrivals.arrived``
does from the engine's feed: no load placed before the next round evicts a waiting request's READY adapter,
and a cold one's load does not wait up to a whole step for that round. The next round's pins take over.

A step's compute time comes from the calibration; a rank's compute starts when its held loads are
READY, and the step (all-reduces in every layer) ends ``duration`` after the last rank starts; a disk
read that starts on rank 0 during its compute moves its end later by ``*_read_slowdown`` of the overlap
(``SimConfig.mid_step_reads``; off by default: only reads in flight when its compute starts count). The
replica reports its waiting queue (``Scheduler.queue()``) to the controller after a round that changed
it, as ``serve_rank`` does: a request admitted in the round it arrived is never reported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from bench.sim.calibration import Calibration
from bench.sim.events import Loop, Signal
from bench.sim.worker import SimLoad, SimWorker
from workers.attach.versions import Readiness
from workers.engine.admission import AdmissionRule, CopyClock
from workers.engine.config import EngineConfig
from workers.engine.scheduler import PREFILL, STOP, WAIT, Scheduler, StepPlan, _Live
from workers.engine.workload import Request
from workers.gpu.acquire import AdapterRef
from workers.gpu.slots import SlotPhase

WAIT_POLL_S = 1e-3  # the engine's sleep when a wait has no load to wait for


class StepRecord(NamedTuple):
    """One step of one replica: when it started, when its compute started (after loads) and ended."""

    replica: str
    kind: str
    items: int
    tokens: int
    adapters: int  # distinct adapters in the batch
    start_s: float
    compute_s: float
    end_s: float
    gap_ms: float | None = None  # host time since the previous step's end, rounds back to back
    readiness_ms: float = 0.0  # of it, the readiness exchange
    chunk_wait_ms: float = 0.0  # pipelined: how much later it ended than its compute alone, waiting on a chunk
    held: int = 0  # adapters the step held (its items' and the running requests')
    loading: int = 0  # of them, still loading when its compute started (pipelined: on chunks)

    def as_log(self) -> dict[str, object]:
        """The real engine's step log (``workers.engine.rank.StepLog``): ``ms`` from start to tokens ready,
        ``load_wait_ms`` of it waiting on loads; what ``fit_calibration`` reads."""
        return {"replica": self.replica, "kind": self.kind, "items": self.items, "tokens": self.tokens,
                "adapters": self.adapters, "ms": (self.end_s - self.start_s) * 1e3,
                "load_wait_ms": (self.compute_s - self.start_s) * 1e3, "gap_ms": self.gap_ms,
                "readiness_ms": self.readiness_ms, "t_s": self.start_s}


@dataclass(eq=False)
class _Step:
    plan: StepPlan
    start_s: float
    held: list[list[int]]  # per rank: slots referenced by the step's acquire
    ranks_left: int
    compute_s: float = 0.0
    loaded_s: float = 0.0  # pipelined: when the last held load was READY on every rank
    chunk_wait_s: float = 0.0  # pipelined: the end pushed past the compute's by the last chunk
    holds: int = 0  # adapters held (its items' and the running requests')
    loading: int = 0  # held adapters still loading on some rank when the compute started
    tokens: int = 0  # the items' lengths summed (a prefill's prompt tokens)
    adapters: int = 0  # distinct adapters among the items
    end_s: float = 0.0  # when it ends (moved later by reads that start during its compute)
    slowdown: float = 0.0  # its kind's ``*_read_slowdown``


@dataclass
class ReplicaHooks:
    """What a replica tells the rest of the fleet."""

    done: Callable[[int, float], None]  # (rid, time): a request finished (or failed)
    queue: Callable[[str, list[tuple[str, float]]], None]  # the waiting queue changed
    steps: list[StepRecord] = field(default_factory=list)


class SimReplica:
    """The engine loop of one replica (rank 0 schedules; every rank runs the plan)."""

    def __init__(self, name: str, config: EngineConfig, rule: AdmissionRule, workers: list[SimWorker], loop: Loop,
                 calibration: Calibration, hooks: ReplicaHooks, layers: int = 32, mid_step_reads: bool = False) -> None:
        self.name, self.rule, self.workers, self.loop = name, rule, workers, loop
        self.layers = layers  # pipelined: a step's last layer waits for the last chunk of its loads
        self.calibration, self.hooks = calibration, hooks
        self.scheduler = Scheduler(config, rule, [])
        self._loading = rule.loading or rule.idle  # the rule reads LOADING (``admits`` or ``admits_idle``)
        self.plan = StepPlan(STOP)
        self.state = "idle"  # idle | busy (a round or step under way) | wait
        self._wait_token = 0  # a wait that a later event ended is ignored when its loads finish
        self._engine_loads: list[dict[str, SimLoad]] = [{} for _ in workers]  # per rank: its own prefetches
        self._reported: list[tuple[str, float]] = []
        self._last_end: float | None = None  # the last step's end, None after a wait (as RankEngine logs gaps)
        self._arrivals: dict[str, None] = {}  # adapters pinned or loaded at arrival since the last round
        self._computing: _Step | None = None  # the step whose compute is under way (its end is scheduled)
        self.clocks = [CopyClock(layers) for _ in workers]  # per rank: its measured copies and steps
        if self._loading:
            for w, clock in zip(workers, self.clocks):
                w.copies = clock
        if mid_step_reads:  # rank 0's process: the one whose steps reads slow (``SimConfig.mid_step_reads``)
            workers[0].host.on_read = self._read_started

    # -- arrivals -------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """A routed request reaches the engine: queued; a waiting or idle loop wakes for it. Mid-round (a
        step under way), a rule that prefetches pins or loads its adapter at once (``_arrived``)."""
        self.scheduler.live[request.rid] = _Live(request)  # the Scheduler takes requests up front only
        self.scheduler.pending.append(request)
        if self.state != "busy":
            self._wait_token += 1
            self.state = "busy"
            self.loop.at(self.loop.now, self._round)
        elif self.rule.prefetch and request.adapter is not None:
            self._arrived(request.adapter)

    def _arrived(self, name: str) -> None:
        """``Arrivals.arrived``: on every rank, pin the arrival's adapter where it is READY (a load placed
        before the next round may not evict it), else start its load now rather than at the next round; the
        load only while the adapters the last round wants plus those taken at arrival are fewer than the
        slots (as ``Scheduler._wanted`` caps them). The next round's pins take over (``_round``)."""
        wanted = _names(self.plan.wanted)
        if name in wanted or name in self._arrivals:  # pinned by the round where READY, else loading
            return
        room = len(wanted) + len(self._arrivals) < self.scheduler.config.num_slots
        self._arrivals[name] = None
        for rank, w in enumerate(self.workers):
            if not w.pins.pin_arrival(name) and room:
                self._prefetch_on(rank, (name,))

    def _unpin_arrivals(self) -> None:
        self._arrivals.clear()
        for w in self.workers:
            w.pins.unpin_arrivals()

    # -- one round ------------------------------------------------------------------------------------
    def _round(self) -> None:
        now = self.loop.now
        previous = self.plan
        ready = self._readiness(previous.wanted) if self.rule.prefetch else {}
        s = self.scheduler
        self.plan = plan = s.plan(now, ready)
        queue = s.queue(plan)
        if queue != self._reported:  # rank 0 reports its waiting queue when it changes (serve_rank)
            self._reported = queue
            self.hooks.queue(self.name, queue)
        if plan.kind == STOP:
            for w in self.workers:  # the engine loop ends and closes its ranks: pins released
                w.pins.pin(())
            self._unpin_arrivals()
            self.state, self._last_end = "idle", None
            return
        if self.rule.prefetch and plan.wanted != previous.wanted:  # same wanted, same instant: pinned already
            for w in self.workers:
                w.pins.pin(_names(plan.wanted))
        if self._arrivals:  # the round's pins hold what it wants now
            self._unpin_arrivals()
        if plan.kind == WAIT:
            self._last_end = None
            self._prefetch(plan)
            self._wait(plan)
            return
        host_s = self.calibration.round_s(self.rule.prefetch)
        if host_s > 0:
            self.loop.after(host_s, self._step, plan)
        else:
            self._step(plan)

    def _readiness(self, wanted: tuple[AdapterRef, ...]) -> dict[str, Readiness]:
        """Each rank pins ``wanted`` and reports every adapter READY there (``RankEngine.readiness``); the
        minimum over ranks: READY where every rank is. Every simulated refusal is for lack of room (no
        reusable slot, host tier full), which the engine does not report as FAILED: the adapter stays
        wanted and is prefetched again next round (so no request leaves with a load error here)."""
        views, loading = [], []
        for w, clock in zip(self.workers, self.clocks):
            w.pins.pin(_names(wanted))  # pins only adapters READY there: nothing to add to the view
            views.append({slot.key.name for slot in w.table.slots
                          if slot.key is not None and slot.state is SlotPhase.READY})
            # a slot taken (the read done, the copy issued) whose copy lands before a step's last layer, from
            # this rank's measured copies and steps (``CopyClock``; ``RankEngine._readiness`` does the same)
            loading.append(clock.in_time(w.issued_copies(), self.loop.now) if self._loading else set())
        ready = set.intersection(*views)
        out = dict.fromkeys(ready, Readiness.READY)
        if self._loading:  # LOADING: READY or copying on every rank (only rules that read it are told)
            out |= dict.fromkeys(set.intersection(*(v | ld for v, ld in zip(views, loading))) - ready,
                                 Readiness.LOADING)
        return out

    def _prefetch(self, plan: StepPlan) -> None:
        for rank in range(len(self.workers)):
            self._prefetch_on(rank, plan.prefetch)

    def _prefetch_on(self, rank: int, refs: tuple[AdapterRef, ...]) -> None:
        """The engine's own prefetches on one rank."""
        w, loads = self.workers[rank], self._engine_loads[rank]
        for name in _names(refs):
            loads[name] = w.prefetch(name)

    # -- waits ----------------------------------------------------------------------------------------
    def _wait(self, plan: StepPlan) -> None:
        """Until, on every rank, one of its held-back adapters' loads finishes (or at once if none is in flight
        there); a rank with nothing to wait for polls. A new arrival ends the wait early (``submit``)."""
        self._wait_token += 1
        self.state = "wait"
        token, left = self._wait_token, [len(self.workers)]
        waited = _names(plan.wait_for)
        for w, loads in zip(self.workers, self._engine_loads):
            # a rule that runs LOADING adapters also wakes when a copy is issued (as ``RankEngine._wait_issued``:
            # READY of any load, or the issue of one not issued yet; ``CopyClock`` may still hold it back)
            flying = [ld for a in waited if (ld := loads.get(a)) is not None and not ld.ready.done]
            done = functools.partial(self._rank_waited, token, left, [False])
            if flying:
                for load in flying:
                    (load.issued if self._loading and not load.issued.done else load.ready).then(done)
            elif any(w.is_ready(a) for a in waited):  # its load is done here: the next round can admit
                done(None)
            else:  # nothing to wait for, or nothing loading for it here (a prefetch refused for room): poll;
                self.loop.after(WAIT_POLL_S, done, None)  # a round at the same instant would see the same state

    def _rank_waited(self, token: int, left: list[int], fired: list[bool], _: Signal | None) -> None:
        if token != self._wait_token or fired[0]:
            return
        fired[0] = True
        left[0] -= 1
        if left[0] == 0:
            self.state = "busy"
            self.loop.at(self.loop.now, self._round)

    # -- steps ----------------------------------------------------------------------------------------
    def _step(self, plan: StepPlan) -> None:
        named = [it.adapter for it in plan.items if it.adapter is not None]
        names = list(dict.fromkeys(_names(named) + _names(plan.hold)))
        step = _Step(plan, self.loop.now, [[] for _ in self.workers], len(self.workers), self.loop.now,
                     tokens=sum(it.length for it in plan.items), adapters=len(set(named)))
        for rank in range(len(self.workers)):
            self._acquire(step, rank, names, 0, True)

    def _acquire(self, step: _Step, rank: int, names: list[str], i: int, first: bool, _: Signal | None = None) -> None:
        """Hold ``names[i:]`` in order; a miss waits (host side) until its load is issued, then holds it."""
        w = self.workers[rank]
        while i < len(names):
            got = w.hold(names[i], first)
            if isinstance(got, SimLoad):
                got.issued.then(functools.partial(self._acquire, step, rank, names, i, False))
                return
            step.held[rank].append(got)
            i, first = i + 1, True
        self._prefetch_on(rank, step.plan.prefetch)  # after acquire: a load cannot evict what this step holds
        flying = [ld for index in step.held[rank] if (ld := w.loading(index)) is not None]
        step.holds = len(names)
        step.loading = max(step.loading, len(flying))
        if self.rule.pipelined:  # the compute starts now; each layer waits only for its chunk (below)
            step.compute_s = max(step.compute_s, self.loop.now)
        done = functools.partial(self._rank_ready, step, [max(1, len(flying))])
        if not flying:
            done(None)
        for load in flying:
            load.ready.then(done)

    def _rank_ready(self, step: _Step, left: list[int], _: Signal | None) -> None:
        """One of a rank's held loads is READY; when all are, the rank computes; when all ranks do, the step."""
        left[0] -= 1
        if left[0]:
            return
        if self.rule.pipelined:
            step.loaded_s = max(step.loaded_s, self.loop.now)
        else:
            step.compute_s = max(step.compute_s, self.loop.now)
        step.ranks_left -= 1
        if step.ranks_left == 0:
            reads = self.workers[0].host.reads_in_flight(self.loop.now)  # rank 0's process: the logged one
            duration = self.calibration.step_s(step.plan.kind, len(step.plan.items), step.tokens, step.adapters,
                                               reads)
            # pipelined: chunks land layer by layer; the step ends no sooner than its last layer after the
            # last chunk (the load's end), nor than its whole compute from the start
            end = max(step.compute_s + duration, step.loaded_s + duration / self.layers)
            step.chunk_wait_s = end - (step.compute_s + duration)
            step.end_s, self._computing = end, step
            for clock in self.clocks:  # each rank measures its steps' compute (no load wait in it)
                clock.stepped(duration)
            step.slowdown = (self.calibration.prefill_read_slowdown if step.plan.kind == PREFILL
                             else self.calibration.decode_read_slowdown)
            self.loop.at(end, self._end_step, step, end)

    def _read_started(self, start: float, end: float) -> None:
        """A disk read on rank 0 starts (at ``start``; ``end``) while a step computes: the step runs
        ``*_read_slowdown`` slower for as long as the read overlaps it (a read in flight when the compute
        started is charged in full by ``step_s``). Reads that start mid-step are what arrivals' loads and
        the controller's commands place; ``read_overlaps`` counts them by that share when fitting."""
        step = self._computing
        if step is None or not step.slowdown or start >= step.end_s:
            return
        step.end_s += step.slowdown * (min(step.end_s, end) - start)
        self.loop.at(step.end_s, self._end_step, step, step.end_s)

    def _end_step(self, step: _Step, end: float) -> None:
        if step.end_s != end:  # moved later by a read that started during it
            return
        self._computing = None
        self._finish_step(step)

    def _finish_step(self, step: _Step) -> None:
        now, plan = self.loop.now, step.plan
        for w, held in zip(self.workers, step.held):
            w.release(held)
        self.scheduler.finish_step(plan, now, step.compute_s - step.start_s)
        running = self.scheduler.running
        for it in plan.items:
            if it.rid not in running:
                self.hooks.done(it.rid, now)
        gap_ms = None if self._last_end is None else (step.start_s - self._last_end) * 1e3
        readiness_ms = self.calibration.readiness_ms if self.rule.prefetch and gap_ms is not None else 0.0
        self.hooks.steps.append(StepRecord(self.name, plan.kind, len(plan.items), step.tokens, step.adapters,
                                           step.start_s, step.compute_s, now, gap_ms, readiness_ms,
                                           step.chunk_wait_s * 1e3, step.holds, step.loading))
        self._last_end = now
        self._round()


def _names(refs: Sequence[AdapterRef]) -> list[str]:
    """The simulator keeps one version per adapter: a reference by exact version is its name's."""
    return [r if isinstance(r, str) else r.name for r in refs]
