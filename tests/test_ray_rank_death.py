"""A TP rank SIGKILLed under hinted traffic, sampled through the gateway every few ms (issue 35, item 1).

A TP-2 replica is ready for two adapters; routers hint loads to both replicas all along. One worker actor of
that replica is killed with SIGKILL (Ray restarts it, empty). Meanwhile one thread samples ``Lookup`` and
``Route`` back to back (a few ms apart) and another follows ``WatchReadiness``. Invariant 4: the replica is
ready for an adapter only while every rank holds it ready. A READY is *wrong* if it was asked for after the
controller learned of the death (its lifeline call failed; ``status()["recent_losses"]``) and before the
restarted rank had reloaded the adapter (its own load log). The test also reports the READYs answered
between the SIGKILL itself and the controller learning of it (the detection window), which no answer can
avoid without asking every rank on every lookup; it asserts that window is short (the death watch), and that
the lost replica leaves the ranking and takes no hints until the restarted rank reports.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2 as pb  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc  # noqa: E402
from lora_cache.app.serve import ServeConfig, start, wait_ready  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.vocab import WorkerId  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.host_tier import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

VICTIM_REPLICA = "replica-0"
HELD = ["adapter-000", "adapter-001"]  # ready on the victim's replica before the kill
DETECT_S = 0.5  # the controller learns of a SIGKILLed rank within this (it was up to 1.4 s before the lifeline)


class Sample(NamedTuple):
    sent: float  # wall clock
    rpc: str  # "lookup" or "route"
    adapter: str
    ready: bool  # the victim's replica answered READY for the adapter
    ranked: bool  # the victim's replica was in the answer at all (Route: ranked; Lookup: ready or loading)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=6, rank="8"))
    ray.init(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    svc = gateway = None
    try:
        svc = start(ServeConfig(adapters=str(root), replicas=2, tp=2),
                    CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=8),
                    PlannerConfig(policy="global"),
                    WorkerConfig(num_slots=8, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        gateway = start_gateway_thread(GatewayConfig(grpc_port=0), svc.controller)
        channel = grpc.insecure_channel(gateway.target)
        yield svc, pb_grpc.LoraCacheServiceStub(channel)
        channel.close()
    finally:
        if gateway is not None:
            gateway.stop()
        if svc is not None:
            svc.stop()
        ray.shutdown()


def _sampler(stub: Any, stop: threading.Event, out: list[Sample]) -> None:
    k = 0
    while not stop.is_set():
        adapter = HELD[k % 2]
        k += 1
        sent = time.time()
        try:
            found = stub.Lookup(pb.LookupRequest(adapter=adapter), timeout=10)
            out.append(Sample(sent, "lookup", adapter, VICTIM_REPLICA in found.ready_replicas,
                              VICTIM_REPLICA in (*found.ready_replicas, *found.loading_replicas)))
            sent = time.time()
            (advice,) = stub.Route(pb.RouteRequest(items=[pb.RouteItem(adapter=adapter)]), timeout=10).items
            mine = [r for r in advice.replicas if r.replica == VICTIM_REPLICA]
            out.append(Sample(sent, "route", adapter, any(r.reason == pb.ROUTE_REASON_READY for r in mine),
                              bool(mine)))
        except grpc.RpcError:
            continue
        time.sleep(0.002)


def _watcher(stub: Any, cursor: int, out: list[tuple[float, pb.ReadinessEvent]]) -> grpc.Future:
    stream = stub.WatchReadiness(pb.WatchReadinessRequest(replica=VICTIM_REPLICA, after_seq=cursor))

    def follow() -> None:
        try:
            for message in stream:
                for e in message.events:
                    out.append((time.time(), e))
        except grpc.RpcError:
            pass

    threading.Thread(target=follow, daemon=True).start()
    return stream


def _hinter(stub: Any, stop: threading.Event, taken: list[tuple[float, int]]) -> None:
    k = 0
    while not stop.is_set():
        hints = [pb.PrefetchHint(hint_id=f"h-{k}-{r}", adapter=f"adapter-00{2 + k % 4}", replica=f"replica-{r}")
                 for r in (0, 1)]
        k += 1
        sent = time.time()
        try:
            answer = stub.Hint(pb.HintRequest(hints=hints), timeout=10)
            taken.append((sent, answer.accepted))
        except grpc.RpcError:
            pass
        time.sleep(0.01)


def test_a_sigkilled_rank_is_never_advertised_ready_once_the_controller_knows(served) -> None:
    svc, stub = served
    ctl = svc.controller
    ray.get(ctl.report_queue.remote(VICTIM_REPLICA, [(a, time.time()) for a in HELD]))
    for a in HELD:
        wait_ready(ctl, a, VICTIM_REPLICA, 60)
    ray.get(ctl.report_queue.remote(VICTIM_REPLICA, []))
    victim = svc.workers[WorkerId(VICTIM_REPLICA, 1)]
    pid = ray.get(victim.pid.remote())
    cursor = ray.get(ctl.begin_watch.remote(VICTIM_REPLICA, None))

    samples: list[Sample] = []
    events: list[tuple[float, pb.ReadinessEvent]] = []
    hinted: list[tuple[float, int]] = []
    stop = threading.Event()
    stream = _watcher(stub, cursor, events)
    threads = [threading.Thread(target=_sampler, args=(stub, stop, samples), daemon=True),
               threading.Thread(target=_hinter, args=(stub, stop, hinted), daemon=True)]
    for t in threads:
        t.start()
    wait_for(lambda: len(samples) > 20, "samples before the kill", timeout=30)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: any(w == f"{VICTIM_REPLICA}/1" and t > t_kill
                         for w, t in ray.get(ctl.status.remote())["recent_losses"]),
             "the controller to learn of the death", timeout=30)
    t_learn = next(t for w, t in ray.get(ctl.status.remote())["recent_losses"]
                   if w == f"{VICTIM_REPLICA}/1" and t > t_kill)
    # the restarted rank reloads what the planner wants there; wait until the replica is whole again
    wait_for(lambda: not ray.get(ctl.status.remote())["lost_ranks"], "the restarted rank to report", timeout=60)
    t_back = time.time()
    time.sleep(0.3)  # a few more samples after the return (not a synchronisation: only more data)
    stop.set()
    for t in threads:
        t.join(30)
    stream.cancel()

    reloaded = {r.adapter: t for t, r in ray.get(victim.load_log.remote())}  # the new incarnation's loads
    assert ray.get(victim.pid.remote()) != pid, "the victim was not restarted"

    def wrong(s: Sample, after: float) -> bool:
        return s.ready and after < s.sent < reloaded.get(s.adapter, float("inf"))

    wrong_after_learn = [s for s in samples if wrong(s, t_learn)]
    in_window = [s for s in samples if wrong(s, t_kill)]
    after_kill = [s for s in samples if s.sent > t_kill]
    wrong_events = [(t, e) for t, e in events if e.state == pb.READINESS_STATE_READY and e.adapter in HELD
                    and t_learn < t < reloaded.get(e.adapter, float("inf"))]
    not_ready = [(t, e) for t, e in events if e.state == pb.READINESS_STATE_NOT_READY and e.adapter in HELD]
    ranked_while_lost = [s for s in samples if s.rpc == "route" and s.ranked and t_learn + 0.05 < s.sent < t_back - 0.5]
    hinted_while_lost = [(t, n) for t, n in hinted if t_learn + 0.05 < t < t_back - 0.5 and n > 1]
    print(f"SIGKILL of {VICTIM_REPLICA}/1: learned after {1000 * (t_learn - t_kill):.1f} ms, replica whole again "
          f"after {t_back - t_kill:.2f} s; {len(after_kill)} samples after the kill (Lookup + Route), "
          f"{len(samples)} in all; wrong READY after the controller learned: {len(wrong_after_learn)}; READY in "
          f"the detection window: {len(in_window)}; Watch READY events before the reload: {len(wrong_events)}; "
          f"Route ranked the lost replica {len(ranked_while_lost)} times; hints taken for it {len(hinted_while_lost)}")
    assert t_learn - t_kill < DETECT_S, f"the controller learned of the death after {t_learn - t_kill:.2f} s"
    assert not wrong_after_learn, f"wrong READY: {wrong_after_learn[:5]}"
    assert not wrong_events, f"READY events before the restarted rank reloaded: {wrong_events[:5]}"
    assert {e.adapter for t, e in not_ready if t >= t_learn} == set(HELD), "no NOT_READY event for the held adapters"
    assert not ranked_while_lost, f"Route ranked the lost replica: {ranked_while_lost[:5]}"
    assert not hinted_while_lost, "hints to the lost replica were taken"
    assert ray.get(ctl.check_integrity.remote())
