"""Continuous batching on rank 0, plain Python: waiting and running requests, bounds, step plans.

Each round the scheduler turns the clock and the replica's adapter readiness into one ``StepPlan``
(broadcast to every rank): a prefill batch of newly admitted requests when any fit (prefill first, like
SGLang's default), else one decode token for every running request, else a wait. The admission rule
decides which waiting requests may run; bounds (running requests, distinct adapters, prefill tokens)
are checked here. Time is passed in, never read, so the scheduler is testable without a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lora_cache.errors import ConfigError
from workers.engine.admission import AdmissionRule, Readiness
from workers.engine.config import EngineConfig
from workers.engine.timings import RequestRecord
from workers.engine.workload import Request

PREFILL, DECODE, WAIT, STOP = "prefill", "decode", "wait", "stop"


class Item(NamedTuple):
    """One request's tokens in a step: positions ``start .. start + length`` of KV row ``row``."""

    rid: int
    adapter: str | None
    row: int
    start: int
    length: int


class StepPlan(NamedTuple):
    """What every rank does this round (rank 0 decides, the others follow)."""

    kind: str  # PREFILL, DECODE, WAIT or STOP
    items: tuple[Item, ...] = ()
    hold: tuple[str, ...] = ()  # adapters held for the step: the batch's and the running requests'
    prefetch: tuple[str, ...] = ()  # loads to start (after the step's acquire, so they evict none of it)
    wanted: tuple[str, ...] = ()  # adapters the ranks keep resident (pinned) from the next round on
    wait_for: tuple[str, ...] = ()  # WAIT: the held-back requests' adapters; the first load done ends it
    timeout_s: float | None = None  # WAIT: at most this long (the next arrival); None: until a load is done


@dataclass
class _Live:
    """A request's progress (mutable while it runs)."""

    request: Request
    row: int = -1
    prefill_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    load_wait_s: float = 0.0
    blocked_since: float | None = None  # held back by admission (its adapter not ready) since
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
                             torch.stack(self.outputs) if self.outputs else None)


def check_requests(requests: Sequence[Request], config: EngineConfig, adapters: Sequence[str]) -> None:
    """Every request must fit the engine: a clear error naming the first that does not."""
    known = set(adapters)
    if len({r.rid for r in requests}) != len(requests):
        raise ConfigError("request ids (rid) must be unique")
    for r in requests:
        if r.adapter is not None and r.adapter not in known:
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
                 inflight: int = 0) -> None:
        """``inflight`` > 0: a closed loop; requests arrive in ``requests`` order (their ``arrival_s`` is
        replaced by the time they arrive) whenever fewer than ``inflight`` are waiting or running."""
        if inflight < 0:
            raise ConfigError(f"inflight must be >= 0 (0: open loop, arrivals as given), got {inflight}")
        self.config, self.rule, self.inflight = config, rule, inflight
        self.live = {r.rid: _Live(r) for r in requests}
        order = (lambda r: r.rid) if inflight else (lambda r: (r.arrival_s, r.rid))
        self.pending = deque(sorted(requests, key=order))  # not arrived yet
        self.waiting: list[_Live] = []  # arrived, not admitted, in arrival order
        self.running: dict[int, _Live] = {}  # admitted, in admission order
        self.free_rows = deque(range(config.max_running))  # KV rows
        self._blocked: dict[str, None] = {}  # adapters of requests that fit now but wait for their load

    # -- one round -----------------------------------------------------------------------------------
    def plan(self, now: float, ready: Mapping[str, Readiness]) -> StepPlan:
        self._arrive(now)
        if self.rule.prefetch:
            self._fail_broken(ready)
        new = tuple(self._start(live, now) for live in self._admit(now, ready))
        wanted = self._wanted() if self.rule.prefetch else ()  # after admission: the batch's adapters first
        prefetch = tuple(a for a in wanted if ready.get(a, Readiness.NOT_READY) is not Readiness.READY)
        if new:
            return StepPlan(PREFILL, new, self._hold(), prefetch, wanted)
        if self.running:
            items = tuple(Item(rid, lv.request.adapter, lv.row, lv.request.input_len + len(lv.token_s) - 1, 1)
                          for rid, lv in self.running.items())
            return StepPlan(DECODE, items, self._hold(), prefetch, wanted)
        if self.waiting or self.pending:
            timeout = self.pending[0].arrival_s - now if self.pending and not self.inflight else None
            blocked = {lv.request.adapter: None for lv in self.waiting if lv.blocked_since is not None}
            return StepPlan(WAIT, (), (), prefetch, wanted, tuple(a for a in blocked if a in wanted), timeout)
        return StepPlan(STOP)

    def finish_step(self, plan: StepPlan, end_s: float, load_wait_s: float,
                    outputs: Mapping[int, torch.Tensor] | None = None) -> None:
        """The step's tokens were ready at ``end_s``; ``load_wait_s`` of it was spent blocked on loads."""
        for item in plan.items:
            live = self.live[item.rid]
            live.token_s.append(end_s)
            live.load_wait_s += load_wait_s
            if outputs is not None:
                live.outputs.append(outputs[item.rid])
            if len(live.token_s) == live.request.output_len:
                del self.running[item.rid]
                self.free_rows.append(live.row)

    def records(self) -> list[RequestRecord]:
        return [self.live[rid].record() for rid in sorted(self.live)]

    def queue(self, plan: StepPlan | None = None) -> list[tuple[str, float]]:
        """(adapter, arrival) of every waiting request with an adapter, in queue order: what an engine
        reports to the controller (lifecycle step 1; new arrivals count towards popularity there).

        ``plan``: the requests it admits lead the report, so a request admitted in the round it arrived
        is still seen once: the controller counts it and fulfils its hint (else the hint would linger
        as pending, crowding out fresh ones, until it expires)."""
        items = plan.items if plan is not None and plan.kind == PREFILL else ()
        admitted = [(it.adapter, self.live[it.rid].request.arrival_s) for it in items if it.adapter is not None]
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

    def _running_adapters(self) -> dict[str, None]:
        return {lv.request.adapter: None for lv in self.running.values() if lv.request.adapter is not None}

    def _wanted(self) -> tuple[str, ...]:
        """Adapters to keep resident: the running requests', then those of waiting requests that the
        admission pass would have taken but for their load ("load on first use"), in queue order.

        The rest of the waiting queue is not loaded here: prefetching a replica's whole queue is the
        controller's ``queue`` policy, so the two stay separate baselines."""
        wanted = self._running_adapters()
        for adapter in self._blocked:
            if len(wanted) >= self.config.num_slots:
                break
            wanted[adapter] = None
        return tuple(wanted)

    def _admit(self, now: float, ready: Mapping[str, Readiness]) -> list[_Live]:
        """Waiting requests for the next prefill batch, in queue order, skipping those that do not fit."""
        adapters, tokens = self._running_adapters(), 0
        new: list[_Live] = []
        self._blocked = {}
        for live in self.waiting:
            r = live.request
            room = len(self.running) + len(new) < self.config.max_running
            fits = (room and tokens + r.input_len <= self.config.max_prefill_tokens
                    and (r.adapter is None or r.adapter in adapters or len(adapters) < self.config.max_adapters))
            if not fits:
                live.unblock(now)  # held back by bounds now, not by its adapter
                continue
            state = Readiness.READY if r.adapter is None else ready.get(r.adapter, Readiness.NOT_READY)
            if not self.rule.admits(r, state):
                live.blocked_since = now if live.blocked_since is None else live.blocked_since
                if r.adapter is not None:
                    self._blocked[r.adapter] = None
                continue
            live.unblock(now)
            new.append(live)
            tokens += r.input_len
            if r.adapter is not None:
                adapters[r.adapter] = None
        for live in new:
            self.waiting.remove(live)
        group: dict[str | None, int] = {}  # one adapter's prompts side by side: one SGMV segment
        for live in new:
            group.setdefault(live.request.adapter, len(group))
        return sorted(new, key=lambda lv: group[lv.request.adapter])

    def _start(self, live: _Live, now: float) -> Item:
        live.row, live.prefill_s = self.free_rows.popleft(), now
        self.running[live.request.rid] = live
        return Item(live.request.rid, live.request.adapter, live.row, 0, live.request.input_len)

    def _hold(self) -> tuple[str, ...]:
        return tuple(self._running_adapters())
