"""The benchmark's router on the real path (lifecycle step 1): a thread that routes, hints and submits.

``Router`` routes each request ``lead_s`` before its arrival by a rule of ``bench.router.rules`` (the gateway's
``Lookup`` and ``Route`` through ``GatewayRoutes``), hints the chosen replica then (policies with hints)
and submits the request to that replica's engine at its arrival (``StreamFleet.submit``: the hosted
engines' worker actors or the attached engine processes). It counts requests in flight per replica
from the engines' own finished ids, and ends every replica's stream after the last submission.
``served_as_routed`` checks a run's records against the router's choices.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from bench.policies import BenchPolicy
from bench.router.rules import Gateway, LeastLoaded, Rule, make_rule
from lora_cache.api.client import Hint, LoraCacheClient, RouteItem
from workers.engine.workload import Request


class StreamFleet(Protocol):
    """The replicas' engines as the router feeds them (``bench.real.ActorFleet``, ``bench.attached.ProcessFleet``)."""

    def submit(self, replica: str, requests: list[Request]) -> None: ...

    def end_streams(self) -> None: ...

    def finished(self, replica: str, timeout_s: float) -> list[int] | None: ...


def served_as_routed(choices: dict[int, str], results: dict[str, Any]) -> dict[str, Any]:
    """Every request served exactly once, by the replica the router chose (``results``: each replica's
    rank-0 ``EngineResult``), or a RuntimeError naming the first that was not; the per-replica counts."""
    served: dict[int, str] = {}
    for replica, result in results.items():
        for rec in result.records:
            if rec.rid in served:
                raise RuntimeError(f"request {rec.rid} was served by both {served[rec.rid]} and {replica}")
            served[rec.rid] = replica
    if set(served) != set(choices):
        lost, extra = sorted(set(choices) - set(served)), sorted(set(served) - set(choices))
        raise RuntimeError(f"the engines served other requests than were routed: missing {lost[:8]}, "
                           f"unrouted {extra[:8]}")
    wrong = [rid for rid, replica in served.items() if choices[rid] != replica]
    if wrong:
        rid = wrong[0]
        raise RuntimeError(f"{len(wrong)} requests were served elsewhere than routed: request {rid} was routed to "
                           f"{choices[rid]} and served by {served[rid]}")
    counts = {replica: 0 for replica in results}
    for replica in served.values():
        counts[replica] += 1
    return {"requests_per_replica": counts, "served_by": {str(rid): served[rid] for rid in sorted(served)}}



class GatewayRoutes:
    """The rules' ``Gateway`` over gRPC: ``Lookup`` for affinity, ``Route`` for lora-cache; counts its calls. The
    requests the router saw finish (``done``, from its watcher threads) go with the next ``Route`` call, each once
    (its ``finished``: the adapters still in flight on each replica, not a guess from the order of the picks)."""

    def __init__(self, client: LoraCacheClient) -> None:
        self.client = client
        self.lookups = self.routes = self.told = 0
        self._lock = threading.Lock()
        self._done: list[tuple[str, str]] = []  # (replica, adapter) finished since the last Route call

    def done(self, replica: str, adapter: str) -> None:
        with self._lock:
            self._done.append((replica, adapter))

    def ready(self, adapter: str) -> tuple[str, ...]:
        self.lookups += 1
        return self.client.lookup(adapter).ready

    def first(self, adapters: Sequence[str], loads: Mapping[str, int]) -> list[str]:
        self.routes += 1
        with self._lock:
            finished, self._done = self._done, []
        try:
            answer = self.client.route([RouteItem(a) for a in adapters], outstanding=dict(loads), finished=finished)
        except BaseException:
            with self._lock:  # told with the next call instead
                self._done[:0] = finished
            raise
        self.told += len(finished)
        out = []
        for advice in answer:
            if advice.error is not None:
                raise advice.error
            if not advice.replicas:
                raise RuntimeError(f"Route ranked no replica for adapter {advice.adapter!r}")
            out.append(advice.replicas[0].replica)
        return out


class Router(threading.Thread):
    """Routes each request ``lead_s`` before its arrival by ``rule`` (``bench.router.rules``), hints the chosen
    replica then (policies with hints), and submits the request to that replica's engine at its arrival. As a
    router forwards a request first and tells the cache on the side, the requests due now are submitted before
    their batch's hints are sent (at lead 0 the hint call is off the request's path); ``submit_lag_ms`` is each
    request's submission after its arrival, the router's own share of its TTFT.
    Its in-flight count per replica (the loads least-loaded, affinity and lora-cache read) goes up when it
    routes a request and down when the replica's engine reports it finished (a watcher thread per
    replica). After the last submission it ends every replica's stream (also when it fails)."""

    def __init__(self, target: str, fleet: StreamFleet, replicas: list[str], requests: Sequence[Request],
                 start_wall: float, lead_s: float, policy: BenchPolicy, rule: str) -> None:
        super().__init__(name="bench-router", daemon=True)
        self.client = LoraCacheClient(target)
        self.gateway: Gateway = GatewayRoutes(self.client)
        self.rule: Rule = make_rule(rule)
        self.fleet, self.replicas, self.rule_name = fleet, replicas, rule
        self.todo = deque(sorted(requests, key=lambda r: (r.arrival_s, r.rid)))  # routed at arrival - lead_s
        # lora-cache: each finished request's adapter, told to Route with its next call (``GatewayRoutes.done``)
        self.adapter_of = {r.rid: r.adapter for r in requests} if rule == "lora-cache" else {}
        self.due: list[tuple[float, int, str, Request]] = []  # routed, submitted at arrival: a heap
        self.start_wall, self.lead_s, self.policy = start_wall, lead_s, policy
        self._lock = threading.Lock()  # protects loads and finished_on (the watchers write them)
        self.loads = dict.fromkeys(replicas, 0)  # routed and not finished, per replica
        self.finished_on: dict[int, str] = {}  # rid -> the replica that reported it finished
        self.choices: dict[int, str] = {}  # rid -> the replica the rule chose
        self.hinted: dict[int, str] = {}  # rid -> the replica hinted
        self.hint_calls = 0
        self.submitted_s: dict[int, float] = {}  # rid -> when it was submitted (seconds on the run's clock)
        self.lag_s: dict[int, float] = {}  # rid -> its submission's time after its arrival
        self.hint_s: dict[int, float] = {}  # rid -> when its hint was sent (seconds on the run's clock)
        self.errors: list[str] = []  # every failed call (a lost hint costs latency; a lost route, fairness)
        self._halt = threading.Event()
        self._watchers = [threading.Thread(target=self._watch, args=(r,), name=f"bench-finished-{r}", daemon=True)
                          for r in replicas]
        for w in self._watchers:
            w.start()
        self.start()

    def run(self) -> None:
        try:
            while (self.todo or self.due) and not self._halt.is_set():
                now = time.time() - self.start_wall
                batch = []
                while self.todo and self.todo[0].arrival_s - self.lead_s <= now:
                    batch.append(self.todo.popleft())
                hints = self._route(batch, now) if batch else []
                self._submit(now)
                self._hint(hints)
                self._halt.wait(max(0.0, min(0.05, self._next_s() - (time.time() - self.start_wall))))
        except Exception as e:  # the streams still end below: the run finishes and reports it
            self.errors.append(f"router: {type(e).__name__}: {e}")
        finally:
            try:
                self.fleet.end_streams()
            except Exception as e:
                self.errors.append(f"submit or end of stream: {type(e).__name__}: {e}")

    def _next_s(self) -> float:
        nxt = [self.todo[0].arrival_s - self.lead_s] if self.todo else []
        return min([*nxt, self.due[0][0]] if self.due else nxt, default=0.0)

    def _route(self, batch: list[Request], now: float) -> list[tuple[int, Hint]]:
        """The rule's picks for the requests due together (on a snapshot of the loads); their hints, to send."""
        with self._lock:
            loads = dict(self.loads)
        adapters = [r.adapter for r in batch]
        try:
            picks = self.rule.route(adapters, dict(loads), self.gateway)
        except Exception as e:  # reported at the end; least-loaded keeps the run going meanwhile
            self.errors.append(f"{self.rule_name} routing: {type(e).__name__}: {e}")
            picks = LeastLoaded().route(adapters, dict(loads), self.gateway)
        with self._lock:
            for replica in picks:
                self.loads[replica] += 1
        hints = []
        for r, replica in zip(batch, picks):
            self.choices[r.rid] = replica
            heapq.heappush(self.due, (r.arrival_s, r.rid, replica, r))
            if self.policy.hints and r.adapter is not None:
                hints.append((r.rid, Hint(f"{self.policy.name}-{r.rid}", r.adapter, replica,
                                          max(0.0, r.arrival_s - now))))
                self.hinted[r.rid] = replica
        return hints

    def _hint(self, hints: list[tuple[int, Hint]]) -> None:
        if hints:
            sent = time.time() - self.start_wall
            self.hint_s.update((rid, sent) for rid, _ in hints)
            try:
                result = self.client.hint([h for _, h in hints])
                self.hint_calls += 1
                self.errors += [f"hint {r.hint_id}: {r.error}" for r in result.rejections]  # each answered alone
            except Exception as e:
                self.errors.append(f"hint: {type(e).__name__}: {e}")

    def _submit(self, now: float) -> None:
        """Every routed request whose arrival has come, to its replica's engine (one call per replica)."""
        out: dict[str, list[Request]] = {}
        while self.due and self.due[0][0] <= now:
            _, _, replica, request = heapq.heappop(self.due)
            out.setdefault(replica, []).append(request)
        for replica, requests in out.items():
            self.fleet.submit(replica, requests)
            sent = time.time() - self.start_wall
            self.submitted_s.update((r.rid, sent) for r in requests)
            self.lag_s.update((r.rid, sent - r.arrival_s) for r in requests)

    def _watch(self, replica: str) -> None:
        """Until the replica's run is over (None), or, once stopped, a poll that finds nothing new."""
        while True:
            try:
                rids = self.fleet.finished(replica, 0.5)
            except Exception as e:
                self.errors.append(f"finished ({replica}): {type(e).__name__}: {e}")
                return
            if rids is None or (not rids and self._halt.is_set()):
                return
            with self._lock:
                self.loads[replica] -= len(rids)
                self.finished_on.update(dict.fromkeys(rids, replica))
            if isinstance(self.gateway, GatewayRoutes):  # only Route is told (adapter_of is empty for other rules)
                for rid in rids:
                    if (adapter := self.adapter_of.get(rid)) is not None:
                        self.gateway.done(replica, adapter)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=60)
        for w in self._watchers:
            w.join(timeout=60)
        self.client.close()

    def check(self) -> None:
        """Raise if a call failed, or a request finished elsewhere than routed (the engines' own reports)."""
        if self.errors:
            raise RuntimeError(f"router: {len(self.errors)} calls failed; first: {self.errors[0]}")
        wrong = {rid: (self.choices.get(rid), replica) for rid, replica in self.finished_on.items()
                 if self.choices.get(rid) != replica}
        if wrong or len(self.finished_on) != len(self.choices):
            raise RuntimeError(f"router: {len(self.finished_on)} of {len(self.choices)} requests reported finished; "
                               f"finished elsewhere than routed (routed, finished on): {dict(list(wrong.items())[:4])}")

    def describe(self) -> dict[str, Any]:
        """The routing of the run, for results.json."""
        calls = {"route_calls": self.gateway.routes, "lookup_calls": self.gateway.lookups,
                 "finishes_told": self.gateway.told} if isinstance(self.gateway, GatewayRoutes) else {}
        return {"router": self.rule_name, "choices": {str(k): v for k, v in sorted(self.choices.items())},
                "hints": {str(k): v for k, v in sorted(self.hinted.items())}, "hint_calls": self.hint_calls, **calls,
                "submit_lag_ms": lag_summary(list(self.lag_s.values())),
                "submitted_s": {str(k): v for k, v in sorted(self.submitted_s.items())},
                "hint_sent_s": {str(k): v for k, v in sorted(self.hint_s.items())}}


def lag_summary(lags_s: Sequence[float]) -> dict[str, float]:
    """Mean, p99 and max of the requests' submission lags, in ms (empty: no request submitted)."""
    if not lags_s:
        return {}
    ms = 1e3 * np.asarray(lags_s, dtype=np.float64)
    return {"mean": float(ms.mean()), "p99": float(np.percentile(ms, 99)), "max": float(ms.max())}
