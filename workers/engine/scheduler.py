"""Continuous batching on rank 0, plain Python: waiting and running requests, bounds, step plans.

Each round the scheduler turns the clock and the replica's adapter readiness into one ``StepPlan``
(broadcast to every rank): a prefill batch of newly admitted requests when any fit (prefill first, like
SGLang's default), else one decode token for every running request, else a wait. The admission rule
decides which waiting requests may run; bounds (running requests, distinct adapters, prefill tokens)
are checked here. Time is passed in, never read, so the scheduler is testable without a clock.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lora_cache.adapters.refs import base_name
from lora_cache.errors import ConfigError
from lora_cache.vocab import AdapterKey
from workers.attach.versions import AdapterVersions, Readiness
from workers.engine.admission import AdmissionRule
from workers.engine.config import EngineConfig
from workers.engine.kv_rows import RowBook
from workers.engine.timings import RequestRecord
from workers.engine.workload import Request
from workers.gpu.acquire import AdapterRef

PREFILL, DECODE, WAIT, STOP = "prefill", "decode", "wait", "stop"
IDLE_WAIT_S = 0.1  # streaming, nothing here: a WAIT round lasts at most this long (a submit ends it sooner)


class Item(NamedTuple):
    """One request's tokens in a step: positions ``start .. start + length`` of KV row ``row``."""

    rid: int
    adapter: str | None
    row: int
    start: int
    length: int
    version: str | None = None  # the adapter version the request was admitted with (None: unversioned)

    @property
    def ref(self) -> AdapterRef | None:
        """What every rank acquires for it: exactly its version (or, unversioned, the adapter's current one)."""
        return _ref(self.adapter, self.version)


def _ref(adapter: str | None, version: str | None) -> AdapterRef | None:
    if adapter is None:
        return None
    name, _, pinned = adapter.partition("@")
    if pinned:  # a request naming one version (``A@VERSION``): exactly that one
        return AdapterKey(name, pinned)
    return adapter if version is None else AdapterKey(adapter, version)


class StepPlan(NamedTuple):
    """What every rank does this round (rank 0 decides, the others follow)."""

    kind: str  # PREFILL, DECODE, WAIT or STOP
    items: tuple[Item, ...] = ()
    hold: tuple[AdapterRef, ...] = ()  # adapters held for the step: the batch's and the running requests'
    prefetch: tuple[AdapterRef, ...] = ()  # loads to start (after the step's acquire, so they evict none of it)
    wanted: tuple[AdapterRef, ...] = ()  # adapters the ranks keep resident (pinned) from the next round on
    wait_for: tuple[AdapterRef, ...] = ()  # WAIT: the held-back requests' adapters; the first load done ends it
    timeout_s: float | None = None  # WAIT: at most this long (the next arrival); None: until a load is done
    streaming: bool = False  # WAIT: a request submitted meanwhile ends it (rank 0 takes it; ranks without the
    # feed do not sleep for arrivals, they meet rank 0 in the next round's collectives)
    names: tuple[str, ...] = ()  # adapters rank 0's catalog registered since the last round: every rank appends
    # them to its version exchange, in this order, before the next round's (``RankVersions.append``)
    dropped: tuple[str, ...] = ()  # rows of named versions (``A@VERSION``) no request uses, idle longest: every rank
    # drops them from its exchange with the round's new names (``RankVersions.drop``, ``engine.NamedRows``)
    retired: tuple[str, ...] = ()  # ``A@VERSION`` rank 0's catalog retired since the last round: the other ranks
    # retire them too, only them (``workers.engine.releases``)
    kv_rows: int = 0  # KV rows borrowed from the adapter pool that every rank holds from this round on
    # (``workers.engine.kv_rows``: grown for requests short of a row, given back once unused)


@dataclass
class _Live:
    """A request's progress (mutable while it runs)."""

    request: Request
    row: int = -1
    version: str | None = None  # its adapter's version, fixed at admission
    prefill_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    load_wait_s: float = 0.0
    blocked_since: float | None = None  # held back by admission (its adapter not ready) since
    unagreed_since: float | None = None  # its adapter's ranks agreeing on no version (a registration on its way) since
    error: str | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)

    def unblock(self, now: float) -> None:
        if self.blocked_since is not None:
            self.load_wait_s += now - self.blocked_since
            self.blocked_since = None

    def record(self) -> RequestRecord:
        r = self.request
        return RequestRecord(r.rid, r.adapter, r.input_len, r.output_len, r.arrival_s, self.prefill_s,
                             tuple(self.token_s), self.load_wait_s, self.error,
                             torch.stack(self.outputs) if self.outputs else None, self.version)

    @property
    def ref(self) -> AdapterRef | None:
        return _ref(self.request.adapter, self.version)


def unknown_adapter(name: str) -> str:
    """Why a request for ``name`` cannot run on this engine, and the fix."""
    return (f"adapter {name!r} is not registered in this replica's catalog; register it first "
            f"(`lora-cache register {name} PATH`, or the controller's register_adapter), then submit its requests "
            "(the running engine serves adapters registered after it started; no restart needed)")


def check_requests(requests: Sequence[Request], config: EngineConfig, adapters: Sequence[str]) -> None:
    """Every request must fit the engine: a clear error naming the first that does not (a request naming one
    version, ``A@VERSION``, by its adapter's name: ``engine.pinned_refs`` checked the version)."""
    known = set(adapters)
    if len({r.rid for r in requests}) != len(requests):
        raise ConfigError("request ids (rid) must be unique")
    for r in requests:
        if r.adapter is not None and base_name(r.adapter) not in known:
            raise ConfigError(f"request {r.rid} names adapter {r.adapter!r}, which is not registered; "
                              f"known: {sorted(known)[:8]}{' ...' if len(known) > 8 else ''}")
        if r.input_len < 1 or r.output_len < 1:
            raise ConfigError(f"request {r.rid}: input_len and output_len must be >= 1, got "
                              f"{r.input_len} and {r.output_len}")
        if r.input_len + r.output_len > config.max_seq_len:
            raise ConfigError(f"request {r.rid}: input_len + output_len ({r.input_len + r.output_len}) exceeds "
                              f"max_seq_len ({config.max_seq_len}); raise max_seq_len")
        if r.input_len > config.max_prefill_tokens:
            raise ConfigError(f"request {r.rid}: input_len ({r.input_len}) exceeds max_prefill_tokens "
                              f"({config.max_prefill_tokens}); raise max_prefill_tokens")
        if r.arrival_s < 0:
            raise ConfigError(f"request {r.rid}: arrival_s must be >= 0, got {r.arrival_s}")


class Scheduler:
    """Rank 0's view of every request; ``plan`` then ``finish_step`` once per round."""

    def __init__(self, config: EngineConfig, rule: AdmissionRule, requests: Sequence[Request],
                 inflight: int = 0, streaming: bool = False) -> None:
        """``inflight`` > 0: a closed loop; requests arrive in ``requests`` order (their ``arrival_s`` is
        replaced by the time they arrive) whenever fewer than ``inflight`` are waiting or running.
        ``streaming``: more requests come (``add``) until ``end``; the plan stops only after that."""
        if inflight < 0:
            raise ConfigError(f"inflight must be >= 0 (0: open loop, arrivals as given), got {inflight}")
        if inflight and streaming:
            raise ConfigError("a streaming scheduler takes open-loop arrivals only (inflight 0): a router that "
                              "submits requests as they arrive is the closed loop's driver itself")
        self.config, self.rule, self.inflight, self.streaming = config, rule, inflight, streaming
        self.live = {r.rid: _Live(r) for r in requests}
        if len(self.live) != len(requests):
            raise ConfigError("request ids (rid) must be unique")
        self._order = (lambda r: r.rid) if inflight else (lambda r: (r.arrival_s, r.rid))
        self.pending = deque(sorted(requests, key=self._order))  # not arrived yet
        self.waiting: list[_Live] = []  # arrived, not admitted, in arrival order
        self.running: dict[int, _Live] = {}  # admitted, in admission order
        own = config.kv_rows or config.max_running
        self.rows = RowBook(own, config.max_running - own, config.kv_return_s)  # KV rows: own, then borrowed
        self._short = 0  # the last admission pass: requests that would start but for a KV row
        self._blocked: dict[AdapterRef, None] = {}  # adapters of requests that fit now but wait for their load
        self._last_items: tuple[Item, ...] = ()  # the last step's items (a rank's failure there fails them)
        self._upgraded: set[AdapterKey] = set()  # re-registered versions prefetched once already
        self._finished: list[int] = []  # rids done (served or failed) since the last take_finished

    # -- a stream of requests ------------------------------------------------------------------------
    def add(self, requests: Sequence[Request], known: Collection[str] | None = None) -> None:
        """Requests submitted now (streaming): each arrives at its ``arrival_s`` or now, whichever is later
        (its record keeps ``arrival_s``: TTFT counts the delivery's delay). ``known``: the adapters this engine
        can serve (its version exchange's names and those it adds this round); a request for another fails at
        once, alone."""
        if not self.streaming:
            raise ConfigError("requests added to a scheduler that is not streaming (or whose stream ended); "
                              "make it with streaming=True and add before end()")
        for r in requests:
            if r.rid in self.live:
                raise ConfigError(f"request {r.rid} was submitted twice; request ids (rid) must be unique")
            live = self.live[r.rid] = _Live(r)
            if known is not None and r.adapter is not None and r.adapter not in known:
                live.error = unknown_adapter(r.adapter)
                self._finished.append(r.rid)
                continue
            bisect.insort(self.pending, r, key=self._order)

    def end(self) -> None:
        """End of stream: the plan stops once every request added is done."""
        self.streaming = False

    def named_in_use(self) -> set[str]:
        """The named versions (``A@VERSION``) of the requests not done: pending, waiting or running."""
        live = (*self.running.values(), *self.waiting)
        refs = [r.adapter for r in self.pending] + [lv.request.adapter for lv in live]
        return {a for a in refs if a and "@" in a}

    def take_finished(self) -> list[int]:
        """Request ids done (all tokens out, or failed) since the last call, in the order they finished."""
        out, self._finished = self._finished, []
        return out

    # -- one round -----------------------------------------------------------------------------------
    def plan(self, now: float, ready: Mapping[str, Readiness],
             versions: Mapping[str, AdapterVersions] | None = None, kv_held: int = 0) -> StepPlan:
        """``ready``: each adapter's state on the replica (of the version it serves); ``versions``: which
        version it serves (``workers.attach.versions``), or None to run unversioned (names only: the
        simulator, a single catalog); ``kv_held``: the borrowed KV rows every rank holds (the minimum)."""
        plan = self._plan(now, ready, versions, kv_held)
        if not self.rows.borrowable or plan.kind == STOP:
            return plan
        return plan._replace(kv_rows=self.rows.plan(now, self._short))

    def _plan(self, now: float, ready: Mapping[str, Readiness], versions: Mapping[str, AdapterVersions] | None,
              kv_held: int) -> StepPlan:
        self.rows.held = kv_held
        self._arrive(now)
        if self.rule.prefetch or versions is not None:
            self._fail_broken(ready)
        self._fail_unagreed(now)
        new = tuple(self._start(live, now) for live in self._admit(now, ready, versions))
        wanted = self._wanted(versions)  # after admission: the batch's adapters first
        prefetch = tuple(a for a in wanted if not _is_ready(a, ready, versions)) if self.rule.prefetch else ()
        prefetch += self._upgrades(versions, prefetch)
        if new:
            return StepPlan(PREFILL, new, self._hold(), prefetch, wanted)
        if self.running:
            items = tuple(Item(rid, lv.request.adapter, lv.row, lv.request.input_len + len(lv.token_s) - 1, 1,
                               lv.version) for rid, lv in self.running.items())
            return StepPlan(DECODE, items, self._hold(), prefetch, wanted)
        if self.waiting or self.pending or self.streaming:
            timeout = self.pending[0].arrival_s - now if self.pending and not self.inflight else None
            if timeout is None and self.streaming and not self.waiting:
                timeout = IDLE_WAIT_S
            return StepPlan(WAIT, (), (), prefetch, wanted, tuple(a for a in self._blocked if a in wanted), timeout,
                            self.streaming)
        return StepPlan(STOP)

    def finish_step(self, plan: StepPlan, end_s: float, load_wait_s: float,
                    outputs: Mapping[int, torch.Tensor] | None = None) -> None:
        """The step's tokens were ready at ``end_s``; ``load_wait_s`` of it was spent blocked on loads."""
        self._last_items = plan.items
        for item in plan.items:
            live = self.live[item.rid]
            live.token_s.append(end_s)
            live.load_wait_s += load_wait_s
            if outputs is not None:
                live.outputs.append(outputs[item.rid])
            if len(live.token_s) == live.request.output_len:
                del self.running[item.rid]
                self.rows.give(live.row)
                self._finished.append(item.rid)

    def fail_step(self, adapters: Collection[str]) -> None:
        """Some rank could not hold these adapters in the last step (their version could not be loaded
        there): it computed their items without them, so those requests fail, finished or not, rather
        than return tokens that mixed versions (invariant 1)."""
        for item in self._last_items:
            if item.adapter in adapters:
                live = self.live[item.rid]
                live.error = (f"adapter {item.ref} could not be held on every TP rank "
                              "(its version is no longer loadable there); the request was stopped")
                if self.running.pop(item.rid, None) is not None:
                    self.rows.give(live.row)
                    self._finished.append(item.rid)
        self._last_items = ()

    def records(self) -> list[RequestRecord]:
        return [self.live[rid].record() for rid in sorted(self.live)]

    def queue(self, plan: StepPlan | None = None) -> list[tuple[str, float]]:
        """(adapter or ``A@VERSION``, arrival) of every waiting request with an adapter, in queue order: what an engine
        reports to the controller (lifecycle step 1; new arrivals count towards popularity there).

        ``plan``: the requests it admits lead the report, so a request admitted in the round it arrived
        is still seen once: the controller counts it and fulfils its hint (else the hint would linger
        as pending, crowding out fresh ones, until it expires)."""
        items = plan.items if plan is not None and plan.kind == PREFILL else ()
        admitted = [(it.adapter, self.live[it.rid].request.arrival_s) for it in items if it.adapter is not None]
        # a request naming one version is reported as it names it (``A@VERSION``): the controller keeps that version
        # and prefetches it here while the request waits
        return admitted + [(lv.request.adapter, lv.request.arrival_s) for lv in self.waiting
                           if lv.request.adapter is not None]

    # -- helpers -------------------------------------------------------------------------------------
    def _arrive(self, now: float) -> None:
        if self.inflight:
            while self.pending and len(self.waiting) + len(self.running) < self.inflight:
                live = self.live[self.pending.popleft().rid]
                live.request = live.request._replace(arrival_s=now)
                self.waiting.append(live)
            return
        while self.pending and self.pending[0].arrival_s <= now:
            self.waiting.append(self.live[self.pending.popleft().rid])

    def _fail_broken(self, ready: Mapping[str, Readiness]) -> None:
        for live in [lv for lv in self.waiting if ready.get(lv.request.adapter or "") is Readiness.FAILED]:
            live.error = f"adapter {live.request.adapter!r} failed to load on at least one TP rank"
            self.waiting.remove(live)
            self._finished.append(live.request.rid)

    def _fail_unagreed(self, now: float) -> None:
        """Waiting requests whose adapter's ranks have agreed on no version for ``agree_timeout_s`` (a registration
        that reached some ranks only, or never will) fail alone: the stream can end."""
        limit = self.config.agree_timeout_s
        if not limit:
            return
        for live in [lv for lv in self.waiting if lv.unagreed_since is not None and now - lv.unagreed_since >= limit]:
            live.error = (f"adapter {live.request.adapter!r}: the TP ranks' catalogs agreed on no version of it for "
                          f"{limit:g} s (its registration reached some ranks only); register it again so every rank "
                          "takes it, or raise agree_timeout_s")
            self.waiting.remove(live)
            self._finished.append(live.request.rid)

    def _running_adapters(self) -> dict[AdapterRef, None]:
        return {lv.ref: None for lv in self.running.values() if lv.ref is not None}

    def _wanted(self, versions: Mapping[str, AdapterVersions] | None) -> tuple[AdapterRef, ...]:
        """Adapters to keep resident: the running requests', then those of waiting requests that the
        admission pass would have taken but for their load ("load on first use"), in queue order.
        Rules that do not prefetch keep only running requests' versions that are no longer current (an
        old version may not be loadable again: its requests keep its slot until they end).

        The rest of the waiting queue is not loaded here: prefetching a replica's whole queue is the
        controller's ``queue`` policy, so the two stay separate baselines."""
        if not self.rule.prefetch:
            if versions is None:
                return ()
            return tuple(ref for ref in self._running_adapters() if isinstance(ref, AdapterKey)
                         and ref.version != versions[ref.name].current)
        wanted = self._running_adapters()
        for adapter in self._blocked:
            if len(wanted) >= self.config.num_slots:
                break
            wanted[adapter] = None
        return tuple(wanted)

    def _admit(self, now: float, ready: Mapping[str, Readiness],
               versions: Mapping[str, AdapterVersions] | None) -> list[_Live]:
        """Waiting requests for the next prefill batch, in queue order, skipping those that do not fit.
        Each is admitted with the version its adapter is served at (``versions``); one whose ranks do not
        agree on any version yet waits."""
        new = self._admit_pass(now, ready, versions, self.rule.admits)
        if not new and not self.running and self.rule.idle:  # an idle round: held-back requests may start
            blocked = self._blocked
            new = self._admit_pass(now, ready, versions, self.rule.admits_idle)
            self._blocked = {ref: None for ref in blocked if ref not in {lv.ref for lv in new}} | self._blocked
        for live in new:
            self.waiting.remove(live)
        group: dict[str | None, int] = {}  # one adapter's prompts side by side: one SGMV segment
        for live in new:
            group.setdefault(live.request.adapter, len(group))
        return sorted(new, key=lambda lv: group[lv.request.adapter])

    def _admit_pass(self, now: float, ready: Mapping[str, Readiness], versions: Mapping[str, AdapterVersions] | None,
                    admits: Callable[[Request, Readiness], bool]) -> list[_Live]:
        adapters, tokens = self._running_adapters(), 0
        new: list[_Live] = []
        self._blocked, self._short = {}, 0
        for live in self.waiting:
            r = live.request
            version = versions[r.adapter].serve if versions is not None and r.adapter is not None else None
            if versions is not None and r.adapter is not None and version is None:
                live.unagreed_since = now if live.unagreed_since is None else live.unagreed_since
            else:
                live.unagreed_since = None
            ref = _ref(r.adapter, version)
            room = len(self.running) + len(new) < self.rows.capacity()
            bounds = (tokens + r.input_len <= self.config.max_prefill_tokens
                      and (ref is None or ref in adapters or len(adapters) < self.config.max_adapters))
            state = Readiness.READY if r.adapter is None else ready.get(r.adapter, Readiness.NOT_READY)
            agreed = versions is None or r.adapter is None or version is not None
            if not (room and bounds):
                below = len(self.running) + len(new) + self._short < self.config.max_running
                if bounds and below and agreed and admits(r, state):
                    self._short += 1  # it would start but for a KV row: one more borrowed (``RowBook.plan``)
                live.unblock(now)  # held back by bounds now, not by its adapter
                continue
            if (versions is not None and r.adapter is not None and version is None) or not admits(r, state):
                live.blocked_since = now if live.blocked_since is None else live.blocked_since
                if ref is not None and (versions is None or version is not None):
                    self._blocked[ref] = None
                continue
            live.unblock(now)
            live.version = version
            new.append(live)
            tokens += r.input_len
            if ref is not None:
                adapters[ref] = None
        return new

    def _start(self, live: _Live, now: float) -> Item:
        live.row, live.prefill_s = self.rows.take(), now
        self.running[live.request.rid] = live
        return Item(live.request.rid, live.request.adapter, live.row, 0, live.request.input_len, live.version)

    def _hold(self) -> tuple[AdapterRef, ...]:
        return tuple(self._running_adapters())

    def _upgrades(self, versions: Mapping[str, AdapterVersions] | None,
                  planned: tuple[AdapterRef, ...]) -> tuple[AdapterRef, ...]:
        """Re-registered versions to load once (each): for adapters of requests here that are still served
        at an older version (READY on every rank) while the current one is not yet."""
        if versions is None:
            return ()
        out: list[AdapterRef] = []
        names = {lv.request.adapter for lv in (*self.running.values(), *self.waiting) if lv.request.adapter}
        for name in sorted(names):
            v = versions[name]
            if v.current is not None and v.serve is not None and v.serve != v.current:
                key = AdapterKey(name, v.current)
                if key not in self._upgraded and key not in planned:
                    self._upgraded.add(key)
                    out.append(key)
        return tuple(out)


def _is_ready(ref: AdapterRef, ready: Mapping[str, Readiness], versions: Mapping[str, AdapterVersions] | None) -> bool:
    """Whether ``ref`` is READY on every rank: its adapter is, at that very version."""
    name = ref.name if isinstance(ref, AdapterKey) else ref
    if isinstance(ref, AdapterKey) and ready.get(str(ref)) is Readiness.READY:  # a request naming this version
        return True
    if ready.get(name, Readiness.NOT_READY) is not Readiness.READY:
        return False
    return versions is None or not isinstance(ref, AdapterKey) or versions[name].serve == ref.version
