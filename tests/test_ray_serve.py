"""Ray Serve routed by lora-cache (``lora_cache.integrations.ray_serve``), on a real local Ray with a real Serve app:
three replicas of the reference engine (``examples/ray_serve_lora.py``), each attached to the controller as a
lora-cache replica; ``LoraCacheRouter`` ranks them locally by lora-cache's rule over the readiness the controller
streams, and hints the controller.

Requests for many adapters spread over the replicas; a request goes to a replica where its adapter is READY once the
router has heard so; the hints reach the controller; no request waits for a controller call (no ``Route`` call at
all, even for an adapter the router has not seen); a completed request's hint is withdrawn; a killed replica leaves
the router's ranking and the controller's fleet; a TP-2 ``CacheReplica`` leases one version on both ranks with one
call to the other rank per request; with lora-cache stopped, Serve routes by itself and every request still
succeeds. The module shares one cluster (tests run in file order; the last stops lora-cache).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load, save

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from examples.ray_serve_lora import app  # noqa: E402
from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import WEIGHTS_FILE  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.api.client import LoraCacheClient  # noqa: E402
from lora_cache.api.client_values import ReadinessEvent  # noqa: E402
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.integrations.ray_serve import CacheReplica, ReplicaCacheConfig, router_config  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray

ADAPTERS = [f"adapter-{i:03d}" for i in range(8)]
UNROUTED = "adapter-008"  # registered at start, first requested by test_no_request_waits_for_a_controller_call
REPLICAS = 3


class App:
    def __init__(self, service: Any, gateway: Any, handle: Any, client: LoraCacheClient) -> None:
        self.service, self.gateway, self.handle, self.client = service, gateway, handle, client
        self.gateway_up = True

    def stop_gateway(self) -> None:
        if self.gateway_up:
            self.gateway_up = False
            self.gateway.stop()

    def call(self, adapter: str) -> dict[str, Any]:
        return self.handle.options(multiplexed_model_id=adapter).remote({}).result(timeout_s=60)

    def advised(self, adapter: str) -> list[str]:
        return [r.replica for r in self.client.route([adapter])[0].replicas]

    def serve_replicas(self) -> set[str]:
        return {r.replica for r in self.client.status().replicas if r.replica.startswith("serve-")}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    root = Path(tmp_path_factory.mktemp("adapters"))
    make_adapters(root, SynthConfig(model="tiny", count=len(ADAPTERS) + 1, rank="8,16"))
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False)
    try:
        service = start(
            ServeConfig(adapters=str(root), replicas=0),
            CatalogConfig(model="tiny", max_rank=16),
            PlannerConfig(policy="global"),
            WorkerConfig(),
        )
        gateway = start_gateway_thread(GatewayConfig(grpc_port=0), service.controller)
        served = App(service, gateway, None, LoraCacheClient(gateway.target, timeout_s=10))
        try:
            cache = ReplicaCacheConfig(num_slots=3, worker={"host": HostTierConfig(host_bytes=16 << 20, pin=False)})
            # No HTTP proxy: the tests call through handles, and on a loaded 2-core machine the proxy actor's start
            # was once cancelled past Serve's own timeout, failing the module's set-up.
            serve.start(proxy_location="Disabled")
            served.handle = serve.run(
                app("lora-cache", gateway.target, REPLICAS, cache, retry_s=60.0),
                name="lora",
                route_prefix=None,
            )
            wait_for(
                lambda: len(served.serve_replicas()) == REPLICAS,
                "every Serve replica attached",
                timeout=60,
                detail=lambda: str(served.serve_replicas()),
            )
            yield served
        finally:
            serve.shutdown()
            served.client.close()
            served.stop_gateway()
            service.stop()
    finally:
        ray.shutdown()


def test_requests_for_many_adapters_spread_over_the_replicas(served: App) -> None:
    out = [
        served.handle.options(multiplexed_model_id=ADAPTERS[i % len(ADAPTERS)]).remote({})
        for i in range(4 * len(ADAPTERS))
    ]
    results = [r.result(timeout_s=60) for r in out]
    assert [r["adapter"] for r in results] == [ADAPTERS[i % len(ADAPTERS)] for i in range(len(results))]
    used = {r["replica"] for r in results}
    assert len(used) > 1, f"every request went to one replica: {used}"
    assert used <= served.serve_replicas(), "a response names a replica the controller does not know"


def _where(served: App) -> str:
    status = served.client.status()
    return (
        f"ready on: { {a: served.client.lookup(a).ready for a in ADAPTERS} }; ready residencies "
        f"{status.ready_residencies}, held {status.held_residencies}, workers {status.workers}, "
        f"commands {status.commands_sent}"
    )


def _history(served: App, adapter: str) -> str:
    """``adapter``'s readiness events the controller still keeps, oldest first (a failure's detail)."""
    events = served.client.watch(adapter=adapter, after_seq=0, duration_s=1.0)
    return "; ".join(f"{getattr(e, 'seq', '-')} {getattr(e, 'replica', '')} {getattr(e, 'ready', e)}" for e in events)


def _was_ready_on(served: App, adapter: str, version: str, replica: str) -> bool:
    """Whether the controller kept a replica-level READY event of ``adapter@version`` on ``replica`` (it may have been
    evicted since)."""
    return any(isinstance(e, ReadinessEvent) and (e.replica, e.version, e.ready) == (replica, version, True)
               for e in served.client.watch(adapter=adapter, after_seq=0, duration_s=0.5))


def _ready_on(served: App, adapter: str) -> set[str]:
    return set(served.client.lookup(adapter).ready)


def _router(served: App) -> Any:
    """The deployment's ``LoraCacheRouter`` in this process (the handle's; Serve's private path to it). Serve makes it
    on the handle's first use, on the handle's event loop, once the deployment's replicas reach it: a test run alone
    (no request before it) initialises the handle and waits for that."""
    handle = served.handle
    if not handle.is_initialized:
        handle._init()
    inner = handle._router._asyncio_router
    wait_for(lambda: inner._request_router is not None, "the handle's request router made", timeout=60)
    return inner._request_router


def _router_state(served: App) -> str:
    """The router's own state (a failure's detail): its counts, whether its stream is live, its in-flight counts."""
    router = _router(served)
    down = router._down_until - time.monotonic()
    return (
        f"router {id(router):#x}: counts {router.counts}, live {router._live}, down for {max(0.0, down):.1f} s "
        f"more (last: {router.last_down or 'never'}), in flight {dict(router._inflight)}, sent {router._sent}"
    )


def _heard(served: App) -> dict[str, set[str]]:
    """adapter -> replicas where the router's readiness stream says READY (read from this thread while the router's
    event loop updates it: a read that meets a change is read again)."""
    while True:
        try:
            return {a: set(where) for a, where in list(_router(served)._ready.items())}
        except RuntimeError:  # changed size during the copy
            continue


def _router_knows(served: App, adapter: str) -> set[str]:
    """Where the controller and the router (its readiness stream) both have ``adapter`` READY."""
    return _ready_on(served, adapter) & _heard(served).get(adapter, set())


def test_the_router_prefers_a_replica_where_the_adapter_is_ready(served: App) -> None:
    """Once the router has heard that an adapter is READY somewhere, it ranks such a replica first and the request
    finds its adapter READY there. Where: any replica READY by then. The planner may add a copy between the wait
    and the call (a home of a hot adapter), and the router may take it: the wait's set is not the only answer.
    Serve may still send a request elsewhere (its queue-length check of the first pick timed out, 0.1 s at first,
    under load): the router counts it (``off_first``), and then the request need not find its adapter READY; most
    requests must go where the router ranked."""
    calls, off_before = 0, _router(served).counts["off_first"]
    for adapter in ADAPTERS[:4]:
        served.call(adapter)  # loaded where it went, if it was READY nowhere
        wait_for(
            partial(_router_knows, served, adapter),
            f"{adapter} ready somewhere, and the router heard so",
            timeout=30,
            detail=lambda: _where(served),
        )
        for _ in range(3):  # one at a time: every replica has room, so the router's first choice takes it
            first, off = _router(served).counts["ready_first"], _router(served).counts["off_first"]
            heard = _heard(served).get(adapter, set())
            result = served.call(adapter)
            calls += 1
            assert _router(served).counts["ready_first"] > first, (
                f"{adapter}: no READY replica ranked first; the router had heard it READY on {heard} before the call; "
                f"it went to {result['replica']} (hit {result['hit']}); {_router_state(served)}; now {_where(served)}"
            )
            assert result["hit"] or _router(served).counts["off_first"] > off, (
                f"{adapter} was not READY on {result['replica']} when the request arrived ({result}); the router "
                f"had heard it READY on {heard} before the call; {_router_state(served)}; now {_where(served)}; "
                f"its events: {_history(served, adapter)}"
            )
    assert _router(served).counts["off_first"] - off_before < calls / 2, _router_state(served)


def test_the_router_takes_a_tag_for_the_version_it_names(served: App) -> None:
    """Issue 44 item 3: a multiplexed id ``A@TAG`` (a trainer's step) names no version the readiness stream shows; the
    router looks the tag up once, in the background (never on a request's path), and then ranks the replica where
    that version is READY first, as for ``A@VERSION``."""
    import json

    from lora_cache.adapters.peft import CONFIG_FILE

    root = Path(ray.get(served.service.controller.catalog_config.remote()).adapter_roots[0])
    src = root / ADAPTERS[0]
    name = "tagged-serve"
    version = served.client.push(name, load((src / WEIGHTS_FILE).read_bytes()),
                                 json.loads((src / CONFIG_FILE).read_text()), tag=5).version
    try:
        first = served.call(f"{name}@5")  # the replica's lease resolves the tag itself
        router = _router(served)
        wait_for(lambda: router._tags.get(f"{name}@5") == f"{name}@{version}", "the tag looked up", timeout=30,
                 detail=lambda: str(router._tags))
        wait_for(lambda: first["replica"] in _heard(served).get(name, set()), "its READY heard", timeout=30,
                 detail=lambda: _router_state(served))
        before = router.counts["ready_first"]
        again = served.call(f"{name}@5")
        assert router.counts["ready_first"] > before, (again, _router_state(served))
    finally:
        ray.get(served.service.controller.unregister_adapter.remote(name), timeout=60)


def test_a_hint_past_its_deadline_pauses_the_hints_not_the_ranking(served: App) -> None:
    """A busy controller answers a Hint after the router's deadline (under a burst on CI's 2 cores, 0.5 s passed):
    the router sends no hints for ``retry_s`` and goes on ranking by the readiness stream, a READY replica first.
    Before, it routed by Serve's own rule for ``retry_s`` (here 60 s) and the stream was closed. The deadlines are
    real: the router's is set below any round trip through the gateway to the controller."""
    router, adapter = _router(served), ADAPTERS[0]
    settings = router.settings
    served.call(adapter)
    wait_for(partial(_router_knows, served, adapter), f"{adapter} ready somewhere, and the router heard so", 30)
    # hints not paused now: under load an earlier test's hint can pass its deadline and pause them for retry_s
    # (60 s), and then this test's hint is never sent (once so: hint_pauses 7 before it, none after, in 30 s)
    router._hints_until = 0.0
    paused = router.counts["hint_pauses"]
    router.settings = dataclasses.replace(settings, hint_timeout_s=1e-4)
    try:
        served.call(adapter)
        wait_for(
            lambda: router.counts["hint_pauses"] > paused,
            "a hint past its deadline",
            30,
            detail=lambda: _router_state(served),
        )
        calls, first = router.counts["hint_calls"], router.counts["ready_first"]
        for _ in range(3):
            served.call(adapter)
        assert router.counts["ready_first"] >= first + 3, _router_state(served)  # more where Serve asked again
        assert router._live and router._down_until <= time.monotonic(), _router_state(served)
        assert router.counts["hint_calls"] == calls, "hints were sent while paused"
        assert "DEADLINE_EXCEEDED" in router.last_pause and not router.last_down, _router_state(served)
    finally:
        router.settings = settings
        router._hints_until = 0.0  # the module's later tests hint again at once (retry_s here is 60 s)


def test_the_router_hints_the_controller_as_it_routes(served: App) -> None:
    before = served.client.status().hints_received
    for adapter in ADAPTERS[:5]:
        served.call(adapter)
    wait_for(
        lambda: served.client.status().hints_received >= before + 5,
        "5 more hints at the controller",
        detail=lambda: f"{served.client.status().hints_received} received, {before} before",
    )


def test_no_request_waits_for_a_controller_call(served: App) -> None:
    """The router ranks from what the controller streams (readiness) and its own in-flight counts: a request, even
    one for an adapter it has never routed (nothing known of it but its name), is ranked with no call to lora-cache
    on its path (before, an adapter without fresh advice waited for ``Route``: 26-48 % of requests in
    bench/RESULTS.md, and its advice was refreshed by more ``Route`` calls)."""
    served.call(ADAPTERS[0])  # the handle's router exists once the handle has routed a request
    router = _router(served)
    before = ray.get(served.service.controller.status.remote())["routes_asked"]
    advised, fallback = router.counts["advised"], router.counts["fallback"]
    names = [UNROUTED, *ADAPTERS * 2]
    calls = [served.handle.options(multiplexed_model_id=a).remote({}) for a in names]
    assert [c.result(timeout_s=60)["adapter"] for c in calls] == names
    asked = ray.get(served.service.controller.status.remote())["routes_asked"] - before
    assert asked == 0, f"{asked} Route calls for {len(calls)} requests"
    assert router.counts["fallback"] == fallback, "a request fell back to Serve's ranking with lora-cache up"
    assert router.counts["advised"] - advised >= len(calls), router.counts


def _active_hints(served: App) -> dict[str, int]:
    hints: dict[str, int] = ray.get(served.service.controller.status.remote())["active_hints"]
    return {r: n for r, n in hints.items() if n}


def test_a_completed_request_leaves_no_hint_at_the_controller(served: App) -> None:
    """A hint says "a request for this adapter is on its way there": once the request is done the router
    withdraws it. Before, a request the engine admitted at once (never seen queued) left its hint a need for
    the planner's hint_ttl_s (30 s), and the planner kept loading and evicting for requests long gone."""
    before = served.client.status().hints_received
    calls = [served.handle.options(multiplexed_model_id=a).remote({}) for a in ADAPTERS * 3]
    assert [c.result(timeout_s=60)["adapter"] for c in calls] == ADAPTERS * 3
    wait_for(
        lambda: served.client.status().hints_received > before,
        "the router's hints at the controller",
        detail=lambda: f"{served.client.status().hints_received} received, {before} before",
    )
    wait_for(
        lambda: not _active_hints(served),
        "no active hint once every request completed",
        timeout=10,
        detail=lambda: str(_active_hints(served)),
    )


def test_a_killed_replica_leaves_the_advice_and_requests_go_on(served: App) -> None:
    victim_name = served.call(ADAPTERS[0])["replica"]
    unique = victim_name.rsplit("-", 1)[-1]
    actor = next(
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(unique)
    )
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    before = served.serve_replicas()
    wait_for(
        lambda: (
            all(victim_name not in served.advised(a) for a in ADAPTERS)
            and all(victim_name not in where for where in _router(served)._ready.values())
        ),
        f"{victim_name} out of the advice and the router's readiness",
        timeout=45,
        detail=lambda: str({a: served.advised(a) for a in ADAPTERS}),
    )
    results = [served.call(a) for a in ADAPTERS]
    assert all(r["replica"] != victim_name for r in results)
    new = wait_for(  # Serve starts a new process (Ray, torch, the engine) that attaches: on 2 cores busy with
        lambda: served.serve_replicas() - before,  # other work once past 60 s (2026-12-05), so 120
        "Serve's new replica attached",
        timeout=120,
        detail=lambda: str(served.serve_replicas()),
    )
    assert all(set(served.advised(a)) <= (before | new) - {victim_name} for a in ADAPTERS)
    # Serve never brings a replica back under its id: its lora-cache replica leaves the fleet (Status, the plans)
    wait_for(
        lambda: victim_name not in served.serve_replicas(),
        f"{victim_name} out of the controller's fleet",
        timeout=30,
        detail=lambda: str(served.serve_replicas()),
    )


@serve.deployment(ray_actor_options={"num_cpus": 0})
class TwoRanks:
    """A Serve replica of TP 2 on CPU: rank 0 in the replica, rank 1 in ``CacheReplica``'s rank actor."""

    def __init__(self, cache: ReplicaCacheConfig) -> None:
        self.cache = CacheReplica(cache)

    async def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        async with self.cache.lease() as lease:  # one version agreed over both ranks, held on each
            return {"replica": self.cache.name, "key": tuple(lease.key), "slots": list(lease.slots)}

    async def rank_calls(self) -> dict[str, int]:
        counts: dict[str, int] = await self.cache.ranks[0].counts.remote()
        return counts


def test_a_tp2_replica_leases_one_version_on_both_ranks(served: App) -> None:
    cache = ReplicaCacheConfig(tp=2, num_slots=2, worker={"host": HostTierConfig(host_bytes=16 << 20, pin=False)})
    deployment: Any = TwoRanks
    handle = serve.run(
        deployment.options(request_router_config=router_config(server=served.gateway.target)).bind(cache),
        name="tp2",
        route_prefix=None,
    )
    try:
        before = handle.rank_calls.remote().result(timeout_s=30)  # the start's own check: one rows call
        results = [handle.options(multiplexed_model_id=a).remote({}).result(timeout_s=60) for a in ADAPTERS[:3] * 2]
        # one call to the other rank per lease (hold exactly rank 0's version), its release not waited for; no
        # version exchange while the ranks know the same versions (before: rows, acquire and release, each awaited)
        after = handle.rank_calls.remote().result(timeout_s=30)
        calls = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert calls.get("rows", 0) == 0 and calls.get("hold") == len(results), (before, after)
        name = results[0]["replica"]
        workers = {r.replica: len(r.workers) for r in served.client.status().replicas}
        assert workers[name] == 2, f"{name} has {workers[name]} ranks at the controller"
        for r, adapter in zip(results, ADAPTERS[:3] * 2):
            assert r["key"] == (adapter, served.client.lookup(adapter).version), r
            assert len(r["slots"]) == 2 and all(s >= 0 for s in r["slots"]), r
        last = served.client.lookup(ADAPTERS[2]).version
        wait_for(  # READY on both ranks (invariant 8): once heard, the planner may evict it again (on 2 slots, for
            # the fleet's homes: once seen in a full CI run, 2026-12-05), so the controller's events count too
            lambda: name in _ready_on(served, ADAPTERS[2]) or _was_ready_on(served, ADAPTERS[2], last, name),
            f"{ADAPTERS[2]} ready on both ranks of {name}",
            timeout=30,
            detail=lambda: f"{_where(served)}; its events: {_history(served, ADAPTERS[2])}",
        )
        # issue 44 item 3: a request names one version (NAME@VERSION); both ranks hold exactly it, the older one too
        import ray

        hot = ADAPTERS[1]
        old = served.client.lookup(hot).version
        root = Path(ray.get(served.service.controller.catalog_config.remote()).adapter_roots[0])
        renewed = root / f"{hot}-v2"
        shutil.copytree(root / hot, renewed)
        weights = load((renewed / WEIGHTS_FILE).read_bytes())
        (renewed / WEIGHTS_FILE).write_bytes(save({k: v * 2 for k, v in weights.items()}))
        new = served.client.register(hot, str(renewed)).version
        assert new != old
        for version in (old, new, old):
            r = handle.options(multiplexed_model_id=f"{hot}@{version}").remote({}).result(timeout_s=60)
            assert r["key"] == (hot, version) and len(r["slots"]) == 2 and min(r["slots"]) >= 0, r
        with pytest.raises(Exception, match="no version or pushed tag 'feedbeef' kept"):
            handle.options(multiplexed_model_id=f"{hot}@feedbeef").remote({}).result(timeout_s=60)
    finally:
        serve.delete("tp2")
    wait_for(  # the Serve replica went with its app: its lora-cache replica leaves the fleet
        lambda: not any(r.startswith("serve-TwoRanks-") for r in served.serve_replicas()),
        "the TP-2 replica out of the controller's fleet",
        timeout=30,
        detail=lambda: str(served.serve_replicas()),
    )


def test_an_adapter_registered_after_the_app_started_is_served_without_a_restart(served: App) -> None:
    """Issue 44 item 1: adapters registered while the Serve app runs, of each rank up to the pool's (here 8 and 16,
    the largest), serve on its replicas at their first request; no replica restarts."""
    import ray

    root = Path(ray.get(served.service.controller.catalog_config.remote()).adapter_roots[0])
    made = make_adapters(root, SynthConfig(model="tiny", count=2, rank="8,16", prefix="later"))
    replicas = served.serve_replicas()
    for path in made:
        served.client.register(path.name, str(path))
    results = [served.call(path.name) for path in made for _ in range(3)]
    assert [r["adapter"] for r in results] == [p.name for p in made for _ in range(3)]
    assert served.serve_replicas() == replicas, "a replica restarted or left"


def test_with_lora_cache_stopped_serve_routes_by_itself(served: App) -> None:
    """With the gateway gone the readiness stream breaks, and for ``retry_s`` (60 s here) every request is routed by
    Serve's own rule (``LoraCacheRouter._serve_choice``, on the public mixins): each one, and each succeeds."""
    router = _router(served)
    served.stop_gateway()  # the router's stream and Hint calls now fail fast: Serve's own ranking
    wait_for(lambda: not router._live, "the router saw its readiness stream break", timeout=30)
    fallback = router.counts["fallback"]
    results = [served.handle.options(multiplexed_model_id=a).remote({}) for a in ADAPTERS * 2]
    assert [r.result(timeout_s=60)["adapter"] for r in results] == ADAPTERS * 2
    assert router.counts["fallback"] - fallback >= len(results), router.counts
