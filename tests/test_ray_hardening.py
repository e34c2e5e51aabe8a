"""The service under faults and hostile clients, through the gateway on a local Ray (issue 35, items 1 and 2).

A TP rank SIGKILLed under hinted traffic, sampled through the gateway every few ms (item 1):

A TP-2 replica is ready for two adapters; routers hint loads to both replicas all along. One worker actor of
that replica is killed with SIGKILL (Ray restarts it, empty). Meanwhile one thread samples ``Lookup`` and
``Route`` back to back (a few ms apart) and another follows ``WatchReadiness``. Invariant 4: the replica is
ready for an adapter only while every rank holds it ready. A READY is *wrong* if it was asked for after the
controller learned of the death (its lifeline call failed; ``status()["recent_losses"]``) and before the
restarted rank had reloaded the adapter (its own load log). The test also reports the READYs answered
between the SIGKILL itself and the controller learning of it (the detection window), which no answer can
avoid without asking every rank on every lookup; it asserts that window is short (the death watch), and that
the lost replica leaves the ranking and takes no hints until the restarted rank reports.

A forged engine rank (item 2): with an engine's token it attaches and claims READY for an adapter never
registered and for a registered one under a forged version, more adapters than its slots, and a shape other
than its hello's; none of it is believed (Lookup, Watch, Route never list it ready), its replica leaves the
fleet when it detaches, a router's token cannot attach at all, and hellos that would wait for a taken name
are bounded and one at a time, so the good rank that comes next attaches.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.api import relay_codec as codec  # noqa: E402
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2 as pb  # noqa: E402
from lora_cache.api.v1 import lora_cache_service_pb2_grpc as pb_grpc  # noqa: E402
from lora_cache.app.serve import ServeConfig, start, wait_ready  # noqa: E402
from lora_cache.controller.links import PING_MISSES, PING_TIMEOUT_S  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from lora_cache.vocab import WorkerId  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

VICTIM_REPLICA = "replica-0"
HELD = ["adapter-000", "adapter-001"]  # ready on the victim's replica before the kill
# The controller learns of a SIGKILLed rank when the kernel closes its lifeline: after the process's memory is torn
# down (Linux frees the address space before the files), 25-35 ms per resident GB on this 2-core machine
# (python -m bench.probes.kill_close: 0.7 ms at 0 MB, 37.5 at 1 GB, 106 at 4 GB; CUDA-pinned memory costs nothing,
# 0.3 ms at 16 GB on an H200 host), plus a turn of the controller's
# loop, which is what a loaded machine stretches (91-210 ms for a 0.3 GB victim beside three busy test runs on
# this machine, 67 ms quiet). The bound asserted: DETECT_BASE_S, for the loop, plus DETECT_PER_GB_S per GB the
# victim held (it was up to 1.4 s before the lifeline, when Ray's restart told it).
DETECT_BASE_S = 0.5
DETECT_PER_GB_S = 0.1
# A hung (SIGSTOP) rank keeps its lifeline: the pings find it. One goes out every HEALTH_S (the controller's default)
# and a rank that leaves PING_MISSES in a row unanswered for PING_TIMEOUT_S each is lost; stopped just after it
# answered one, it is found PING_MISSES * (HEALTH_S + PING_TIMEOUT_S) later, plus a turn of the loop (DETECT_BASE_S)
# twice for each round of pings (its sleep and its gather each wait on a loaded loop). Measured 2026-11-30: 3.63-3.89 s
# in three runs here, 4.66 s in the fresh-clone CI and 5.10 s in one run here, against a bound of 4.5 s (one turn in
# all) and then 5.0 s (one per round). The CI's stop 50 asserted the one-miss worst case without the turn, and found
# one in 2.01 s; with one miss, a rank just restarted by Ray was lost again for a slow answer (its CI failure).
HEALTH_S = 0.5
HUNG_FOUND_S = PING_MISSES * (HEALTH_S + PING_TIMEOUT_S + 2 * DETECT_BASE_S)


class Sample(NamedTuple):
    sent: float  # wall clock, the call sent
    got: float  # wall clock, its answer received (the controller's state it reports is from between the two)
    rpc: str  # "lookup" or "route"
    adapter: str
    ready: bool  # the victim's replica answered READY for the adapter
    ranked: bool  # the victim's replica was in the answer at all (Route: ranked; Lookup: ready or loading)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("adapters")
    make_adapters(root, SynthConfig(model="tiny", count=6, rank="8"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    svc = gateway = None
    try:
        svc = start(
            ServeConfig(adapters=str(root), replicas=2, tp=2),
            CatalogConfig(adapter_roots=(str(root),), model="tiny", max_rank=8),
            PlannerConfig(policy="global"),
            WorkerConfig(num_slots=8, host=HostTierConfig(host_bytes=1 << 22, pin=False)),
        )
        for role in ("router", "engine"):
            (root.parent / f"{root.name}-{role}").write_text(f"{role}-token")
        with (root.parent / f"{root.name}-engine").open("a") as engines:  # replica-1's own engine credential
            engines.write("\nreplica-1-token replica-1\nreplica-1-rank-1-token replica-1/1 solo/0\n")
        gateway = start_gateway_thread(
            GatewayConfig(
                grpc_port=0,
                token_file=str(_write(root.parent / f"{root.name}-all", "all-token")),
                router_token_file=str(root.parent / f"{root.name}-router"),
                engine_token_file=str(root.parent / f"{root.name}-engine"),
            ),
            svc.controller,
        )
        channel = grpc.insecure_channel(gateway.target)
        yield svc, pb_grpc.LoraCacheServiceStub(channel)
        channel.close()
    finally:
        if gateway is not None:
            gateway.stop()
        if svc is not None:
            svc.stop()
        ray.shutdown()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


ENGINE = (("authorization", "Bearer engine-token"),)
ROUTER = (("authorization", "Bearer router-token"),)


def _sampler(stub: Any, stop: threading.Event, out: list[Sample]) -> None:
    k = 0
    while not stop.is_set():
        adapter = HELD[k % 2]
        k += 1
        sent = time.time()
        try:
            found = stub.Lookup(pb.LookupRequest(adapter=adapter), metadata=ROUTER, timeout=10)
            out.append(
                Sample(
                    sent,
                    time.time(),
                    "lookup",
                    adapter,
                    VICTIM_REPLICA in found.ready_replicas,
                    VICTIM_REPLICA in (*found.ready_replicas, *found.loading_replicas),
                )
            )
            sent = time.time()
            (advice,) = stub.Route(
                pb.RouteRequest(items=[pb.RouteItem(adapter=adapter)]), metadata=ROUTER, timeout=10
            ).items
            mine = [r for r in advice.replicas if r.replica == VICTIM_REPLICA]
            ready = any(r.reason == pb.ROUTE_REASON_READY for r in mine)
            out.append(Sample(sent, time.time(), "route", adapter, ready, bool(mine)))
        except grpc.RpcError:
            continue
        time.sleep(0.002)


def _watcher(stub: Any, cursor: int, out: list[tuple[float, pb.ReadinessEvent]]) -> grpc.Future:
    stream = stub.WatchReadiness(pb.WatchReadinessRequest(replica=VICTIM_REPLICA, after_seq=cursor), metadata=ROUTER)

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
        hints = [
            pb.PrefetchHint(hint_id=f"h-{k}-{r}", adapter=f"adapter-00{2 + k % 4}", replica=f"replica-{r}")
            for r in (0, 1)
        ]
        k += 1
        sent = time.time()
        try:
            answer = stub.Hint(pb.HintRequest(hints=hints), metadata=ROUTER, timeout=10)
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
    threads = [
        threading.Thread(target=_sampler, args=(stub, stop, samples), daemon=True),
        threading.Thread(target=_hinter, args=(stub, stop, hinted), daemon=True),
    ]
    for t in threads:
        t.start()
    wait_for(lambda: len(samples) > 20, "samples before the kill", timeout=30)
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    detect_s = DETECT_BASE_S + DETECT_PER_GB_S * rss_kb / 2**20
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: any(
            w == f"{VICTIM_REPLICA}/1" and t > t_kill for w, t in ray.get(ctl.status.remote())["recent_losses"]
        ),
        "the controller to learn of the death",
        timeout=30,
    )
    t_learn = next(
        t for w, t in ray.get(ctl.status.remote())["recent_losses"] if w == f"{VICTIM_REPLICA}/1" and t > t_kill
    )
    # the restarted rank reloads what the planner wants there; wait until the replica is whole again
    wait_for(lambda: not ray.get(ctl.status.remote())["lost_ranks"], "the restarted rank to report", timeout=60)
    t_back = time.time()
    time.sleep(0.3)  # a few more samples after the return (not a synchronisation: only more data)
    stop.set()
    for t in threads:
        t.join(30)
    stream.cancel()

    reloaded: dict[str, float] = {}  # the new incarnation's first load of each adapter (its log is oldest first;
    for t, r in ray.get(victim.load_log.remote()):  # a later eviction and reload must not move the reference)
        reloaded.setdefault(r.adapter, t)
    assert ray.get(victim.pid.remote()) != pid, "the victim was not restarted"

    def wrong(s: Sample, after: float) -> bool:
        """READY in an answer to a call sent after ``after`` and answered before the restarted rank had reloaded
        the adapter: certainly from before the reload. (An answer received after the reload may report the state
        after it, whenever its call was sent: under load a call waits behind others at the controller.)"""
        return s.ready and after < s.sent and s.got < reloaded.get(s.adapter, float("inf"))

    wrong_after_learn = [s for s in samples if wrong(s, t_learn)]
    in_window = [s for s in samples if wrong(s, t_kill)]
    after_kill = [s for s in samples if s.sent > t_kill]
    wrong_events = [
        (t, e)
        for t, e in events
        if e.state == pb.READINESS_STATE_READY
        and e.adapter in HELD
        and t_learn < t < reloaded.get(e.adapter, float("inf"))
    ]
    not_ready = [(t, e) for t, e in events if e.state == pb.READINESS_STATE_NOT_READY and e.adapter in HELD]
    ranked_while_lost = [
        s for s in samples if s.rpc == "route" and s.ranked and t_learn + 0.05 < s.sent and s.got < t_back - 0.5
    ]
    slowest = max((s.got - s.sent for s in after_kill), default=0.0)
    straddled = [s for s in samples if s.ready and t_learn < s.sent < reloaded.get(s.adapter, float("inf")) <= s.got]
    hinted_while_lost = [(t, n) for t, n in hinted if t_learn + 0.05 < t < t_back - 0.5 and n > 1]
    print(
        f"SIGKILL of {VICTIM_REPLICA}/1: learned after {1000 * (t_learn - t_kill):.1f} ms (bound "
        f"{1000 * detect_s:.0f} ms), replica whole again "
        f"after {t_back - t_kill:.2f} s; {len(after_kill)} samples after the kill (Lookup + Route), "
        f"{len(samples)} in all; wrong READY after the controller learned: {len(wrong_after_learn)}; READY in "
        f"the detection window: {len(in_window)}; Watch READY events before the reload: {len(wrong_events)}; "
        f"Route ranked the lost replica {len(ranked_while_lost)} times; hints taken for it {len(hinted_while_lost)}; "
        f"the slowest answer after the kill took {1000 * slowest:.0f} ms; READY answers to calls sent before the "
        f"reload and answered after it (not wrong): {len(straddled)}"
    )
    assert t_learn - t_kill < detect_s, (
        f"the controller learned of the death after {t_learn - t_kill:.3f} s, beyond the {detect_s:.3f} s its "
        f"process's teardown and a loop turn allow")
    assert not wrong_after_learn, f"wrong READY: {wrong_after_learn[:5]}; reloaded {reloaded}, learned {t_learn}"
    assert not wrong_events, f"READY events before the restarted rank reloaded: {wrong_events[:5]}"
    assert {e.adapter for t, e in not_ready if t >= t_learn} == set(HELD), "no NOT_READY event for the held adapters"
    assert not ranked_while_lost, f"Route ranked the lost replica: {ranked_while_lost[:5]}"
    assert not hinted_while_lost, "hints to the lost replica were taken"
    assert ray.get(ctl.check_integrity.remote())


def test_a_stopped_rank_leaves_the_routes_and_the_hints_once_pinged_and_returns(served) -> None:
    """SIGSTOP (a hung or unreachable rank: its lifeline stays open): pings find it (``HUNG_FOUND_S``); its replica
    leaves the ranking and takes no hints; after SIGCONT it reports and comes back."""
    svc, stub = served
    ctl = svc.controller
    replica, wid = "replica-1", WorkerId("replica-1", 0)
    pid = ray.get(svc.workers[wid].pid.remote())

    def ranked() -> set[str]:
        try:
            (advice,) = stub.Route(
                pb.RouteRequest(items=[pb.RouteItem(adapter="adapter-002")]), metadata=ROUTER, timeout=30
            ).items
        except grpc.RpcError as e:  # the CI's failure (known issues): which ranks were lost, when and how
            status = ray.get(ctl.status.remote())
            raise AssertionError(f"Route failed ({e}); lost ranks {status['lost_ranks']}, losses (worker, when, "
                                 f"how) {status['loss_causes'][-8:]}, SIGSTOP at {t_stop}") from e
        return {r.replica for r in advice.replicas}

    t_stop = 0.0
    assert replica in ranked()
    t_stop = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: str(wid) in ray.get(ctl.status.remote())["lost_ranks"], "the stopped rank found", 10)
        status = ray.get(ctl.status.remote())
        t_found = status["lost_ranks"][str(wid)]
        assert any(w == str(wid) and "pings in a row unanswered" in how for w, _, how in status["loss_causes"]), (
            f"a stopped rank is found by the pings (its lifeline stays open): {status['loss_causes']}")
        assert replica not in ranked()
        hint = pb.PrefetchHint(hint_id=f"stopped-{t_stop}", adapter="adapter-003", replica=replica)
        assert stub.Hint(pb.HintRequest(hints=[hint]), metadata=ROUTER, timeout=30).accepted == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    t_cont = time.time()
    wait_for(lambda: not ray.get(ctl.status.remote())["lost_ranks"], "the resumed rank back", 30)
    print(
        f"SIGSTOP of {wid}: found lost after {t_found - t_stop:.2f} s; back {time.time() - t_cont:.2f} s after SIGCONT"
    )
    assert t_found - t_stop < HUNG_FOUND_S, f"found after {t_found - t_stop:.2f} s, beyond {HUNG_FOUND_S} s"
    assert replica in ranked()
    assert ray.get(ctl.check_integrity.remote())


class Rank:
    """A hand-driven AttachRank stream: what a hostile client with an engine's token can send."""

    def __init__(self, stub: Any, metadata: Any = ENGINE, **hello: Any) -> None:
        fields = {
            "replica": "forged",
            "rank": 0,
            "tp": 1,
            "num_slots": 2,
            "model": "tiny",
            "incarnation": time.time_ns(),
            "liveness_s": 5.0,
            "start_s": 60.0,
            "name_wait_s": 0.0,
        } | hello
        self.hello = pb.AttachHello(**fields)
        self.up: queue.Queue[pb.AttachRankRequest | None] = queue.Queue()
        self.up.put(pb.AttachRankRequest(hello=self.hello))
        self.down = stub.AttachRank(iter(self.up.get, None), metadata=metadata, timeout=120)

    def next(self) -> pb.AttachRankResponse:
        return next(self.down)

    def answer_describe(self, call: pb.RelayedCall, **forged: Any) -> None:
        h = self.hello
        report = {
            "replica": h.replica,
            "rank": h.rank,
            "tp": h.tp,
            "model": "tiny",
            "incarnation": h.incarnation,
            "seq": 0,
            "node": "forger",
            "slots": h.num_slots,
            "host_bytes": 0,
            "adapters": {},
            "epoch": 0,
            "residency": [],
        } | forged
        self.up.put(pb.AttachRankRequest(answer=codec.answer(call.call_id, "describe", True, report)))

    def serve_until_adopted(self, **forged: Any) -> None:
        """Answer the controller's calls (describe with ``forged``, the rest as a real rank would) until adopted."""
        while (m := self.next()).WhichOneof("message") != "adopted":
            if m.WhichOneof("message") != "call":
                continue
            method = m.call.WhichOneof("call")
            if method == "describe":
                self.answer_describe(m.call, **forged)
            elif method == "register_adapters":
                n = len(m.call.register_adapters.adapters)
                self.up.put(
                    pb.AttachRankRequest(answer=codec.answer(m.call.call_id, "register_adapters", True, [("", "")] * n))
                )

    def close(self) -> None:
        self.up.put(None)


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


def test_a_forged_engine_rank_is_not_believed_and_leaves_when_it_detaches(served) -> None:
    svc, stub = served
    ctl = svc.controller
    registered = "adapter-005"
    version = stub.Lookup(pb.LookupRequest(adapter=registered), metadata=ROUTER, timeout=30).version
    code, message = _code(lambda: Rank(stub, metadata=ROUTER).next())
    assert code == grpc.StatusCode.PERMISSION_DENIED and "AttachRank needs the engine role" in message
    code, message = _code(lambda: Rank(stub, tp=100_000).next())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tp is 100000" in message and "give 1 to 64" in message
    code, message = _code(lambda: Rank(stub, name_wait_s=1e9).next())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "must be at most 60 s" in message

    liar = Rank(stub)  # a shape other than its hello's is refused at the gateway
    liar.next()
    m = liar.next()
    liar.answer_describe(m.call, tp=100_000)
    code, message = _code(lambda: [liar.next() for _ in range(100)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "its report says tp 100000, but its hello said 1" in message
    wait_for(lambda: "forged" not in ray.get(ctl.status.remote())["replicas"], "the liar's replica to leave", 30)

    forger = Rank(stub)
    assert forger.next().WhichOneof("message") == "attached"
    forger.serve_until_adopted()
    assert "forged" in ray.get(ctl.status.remote())["replicas"]
    refused = ray.get(ctl.status.remote())["refused_reports"]
    rows = [
        (1, "ghost", "v-ghost", "ready", ""),
        (2, registered, "f0rged", "ready", ""),
        (3, registered, version, "ready", ""),
        (
            4,
            "adapter-004",
            stub.Lookup(pb.LookupRequest(adapter="adapter-004"), metadata=ROUTER, timeout=30).version,
            "ready",
            "",
        ),
        (5, "adapter-003", "anything", "ready", ""),
    ]
    forger.up.put(pb.AttachRankRequest(deltas=codec.deltas(forger.hello.incarnation, rows)))
    wait_for(lambda: ray.get(ctl.status.remote())["refused_reports"] >= refused + 3, "the forged claims refused", 30)
    held = ray.get(ctl.check_integrity.remote()) and ray.get(ctl.lookup.remote("ghost"))
    assert held == {"ready": [], "loading": []}, "an adapter never registered listed as held"
    code, _ = _code(lambda: stub.Lookup(pb.LookupRequest(adapter="ghost"), metadata=ROUTER, timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND

    forger.close()  # the detach: its replica leaves the fleet
    wait_for(lambda: "forged" not in ray.get(ctl.status.remote())["replicas"], "the forged replica to leave", 30)
    (advice,) = stub.Route(pb.RouteRequest(items=[pb.RouteItem(adapter=registered)]), metadata=ROUTER, timeout=30).items
    assert "forged" not in [r.replica for r in advice.replicas]
    assert ray.get(ctl.check_integrity.remote())


def _queued(adapter: str) -> pb.QueuedRequest:
    arrived = Timestamp()
    arrived.GetCurrentTime()
    return pb.QueuedRequest(adapter=adapter, arrival_time=arrived)


def test_an_engine_credential_bound_to_its_replica_speaks_for_no_other(served) -> None:
    """Issue 46 item 1: a bound engine token reports its own replica's queue and attaches as it, and is refused
    (PERMISSION_DENIED, naming the replica and its binding) for any other, changing nothing there. (Before: any
    engine token reported any replica's queue, and the controller planned from it.)"""
    svc, stub = served
    ctl = svc.controller
    own = (("authorization", "Bearer replica-1-token"),)
    ray.get(ctl.report_queue.remote("replica-0", [("adapter-001", time.time())]))
    forged = pb.ReportQueueRequest(replica="replica-0", requests=[_queued(f"adapter-00{k}") for k in range(4)])
    code, message = _code(lambda: stub.ReportQueue(forged, metadata=own, timeout=30))
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, message)
    assert "replica 'replica-0'" in message and "speaks for 'replica-1' only" in message
    assert ray.get(ctl.status.remote())["queue_depths"]["replica-0"] == 1  # replica-0's own report stands
    answer = stub.ReportQueue(pb.ReportQueueRequest(replica="replica-1", requests=[_queued("adapter-002")]),
                              metadata=own, timeout=30)
    assert answer.queue_depth == 1 and ray.get(ctl.status.remote())["queue_depths"]["replica-1"] == 1
    code, message = _code(lambda: Rank(stub, metadata=own, replica="forged").next())
    assert code == grpc.StatusCode.PERMISSION_DENIED and "AttachRank for replica 'forged' rank 0 refused" in message
    assert "forged" not in ray.get(ctl.status.remote())["replicas"]
    # the unbound engine token and a router keep speaking for any replica (a router reports the queues it holds)
    assert stub.ReportQueue(forged, metadata=ROUTER, timeout=30).queue_depth == 4
    ray.get(ctl.report_queue.remote("replica-0", []))
    ray.get(ctl.report_queue.remote("replica-1", []))
    assert ray.get(ctl.check_integrity.remote())


def test_an_engine_credential_bound_to_one_rank_attaches_as_that_rank_only(served) -> None:
    """Issue 46 item 1's "(and rank)": a token bound to ``replica-1/1`` and ``solo/0`` is refused AttachRank as rank 0
    of replica-1 (PERMISSION_DENIED naming the rank and the binding, before anything is made), attaches as solo's
    rank 0, and reports replica-1's queue (its replica's), not replica-0's."""
    svc, stub = served
    rank1 = (("authorization", "Bearer replica-1-rank-1-token"),)
    code, message = _code(lambda: Rank(stub, metadata=rank1, replica="replica-1", rank=0, tp=2).next())
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, message)
    assert "AttachRank for replica 'replica-1' rank 0 refused" in message and "'replica-1/1', 'solo/0' only" in message
    solo = Rank(stub, metadata=rank1, replica="solo")  # bound to solo/0 as well: attaches as that rank
    assert solo.next().WhichOneof("message") == "attached"
    solo.serve_until_adopted()
    solo.close()
    wait_for(lambda: "solo" not in ray.get(svc.controller.status.remote())["replicas"], "solo to leave", 30)
    answer = stub.ReportQueue(pb.ReportQueueRequest(replica="replica-1", requests=[_queued("adapter-002")]),
                              metadata=rank1, timeout=30)
    assert answer.queue_depth == 1
    code, message = _code(lambda: stub.ReportQueue(pb.ReportQueueRequest(replica="replica-0"), metadata=rank1,
                                                   timeout=30))
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, message)
    ray.get(svc.controller.report_queue.remote("replica-1", []))
    assert ray.get(svc.controller.check_integrity.remote())


def test_hellos_waiting_for_a_taken_name_do_not_lock_out_the_next_rank(served) -> None:
    svc, stub = served
    holder = Rank(stub, replica="taken")
    holder.next()
    holder.serve_until_adopted()
    waiters = [Rank(stub, replica="taken", name_wait_s=2.0) for _ in range(7)]
    codes = []
    for w in waiters:
        codes.append(_code(w.next)[0])
    # one waits its 2 s and is refused (the name is held); the others are refused at once
    assert set(codes) == {grpc.StatusCode.FAILED_PRECONDITION}, codes
    good = Rank(stub, replica="next-one")
    assert good.next().WhichOneof("message") == "attached"
    good.serve_until_adopted()
    for r in (holder, good):
        r.close()
    wait_for(
        lambda: not {"taken", "next-one"} & set(ray.get(svc.controller.status.remote())["replicas"]),
        "the attached replicas to leave",
        30,
    )
