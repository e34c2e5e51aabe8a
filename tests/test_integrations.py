"""The Ray Serve integration's plain parts, without a cluster: settings that name the value and the fix, the
one mapping of Serve replica ids to lora-cache replica names that the router and the replicas share, the router's
fallback (Serve's rule on the mixins' answers), the order of a hint and its withdrawal (a real gateway in a thread,
no cluster), and the integrations' use of Ray's public API only.
(The integration on a real Serve app: tests/test_ray_serve.py.)"""

from __future__ import annotations

import ast
import asyncio
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve.request_router import ReplicaID

import lora_cache.integrations
from lora_cache.errors import ConfigError
from lora_cache.integrations.ray_serve import (
    LoraCacheRouter,
    ReplicaCacheConfig,
    RouterSettings,
    replica_name,
    router_config,
)
from lora_cache.routing.ranking import ReplicaLoad, Residence, rank
from lora_cache.routing.traffic import Traffic
from workers.attach.attachment import AttachConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server": "nowhere"}, "is not host:port"),
        ({"hint_timeout_s": 0}, r"hint_timeout_s is 0; give a short positive deadline"),
        ({"hint_timeout_s": 30}, r"hint_timeout_s is 30; give a short positive deadline \(<= 10 s\)"),
        ({"retry_s": -1}, r"retry_s \(-1\), loading_s \(5.0\) and traffic_s \(0.0\) must be >= 0 seconds"),
        ({"traffic_s": -1}, r"traffic_s \(-1\) must be >= 0 seconds"),
        ({"epsilon": -1}, r"epsilon is -1; give a number >= 0"),
    ],
)
def test_router_settings_name_the_value_and_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterSettings(**kwargs)  # type: ignore[arg-type]


def test_replica_config_refuses_what_cannot_attach() -> None:
    with pytest.raises(ConfigError, match=r"tp \(0\) and num_slots \(8\) must be >= 1"):
        ReplicaCacheConfig(tp=0)
    assert ReplicaCacheConfig(tp=2).worker_config(1).tp_rank == 1


def _replica_id(deployment: str, unique_id: str) -> ReplicaID:
    """A Serve replica's id, from the full id Serve names its replica actors by (``SERVE_REPLICA::app#name#id``)."""
    return ReplicaID.from_full_id_str(f"SERVE_REPLICA::app#{deployment}#{unique_id}")


@pytest.mark.parametrize("deployment", ["LoraEngine", "my app:v2/llm", "a b"])
def test_a_serve_replica_maps_to_one_valid_lora_cache_replica_name(deployment: str) -> None:
    rid = _replica_id(deployment, "abc123xy")
    assert (rid.deployment_id.name, rid.unique_id) == (deployment, "abc123xy")
    name = replica_name(rid)
    assert name == replica_name(_replica_id(deployment, "abc123xy"))
    assert name.endswith("-abc123xy") and name.startswith("serve-")
    AttachConfig(replica=name)  # a name the attach seam takes (no ':' or '/')
    assert replica_name(_replica_id(deployment, "zzz")) != name


class _Mixins:
    """What ``LoraCacheRouter._serve_choice`` asks of Serve's mixins: their answer for this attempt, recorded."""

    def __init__(self, allowed: set[str] | None) -> None:
        self.allowed, self.asked = allowed, ""

    def apply_multiplex_routing(self, pending_request: Any) -> set[str] | None:
        self.asked = "multiplex"
        return self.allowed

    def apply_locality_routing(self, pending_request: Any) -> set[str] | None:
        self.asked = "locality"
        return self.allowed


@pytest.mark.parametrize("allowed", [None, set(), {"b"}, {"a", "c"}, {"a", "b", "c", "d"}])
@pytest.mark.parametrize("adapter", ["adapter-003", ""])
def test_the_fallback_picks_two_of_what_serves_mixins_allow(allowed: set[str] | None, adapter: str) -> None:
    """Serve's own rule while lora-cache is down: multiplex affinity narrows a request with an adapter, locality one
    without; then at most two of those, one rank, for Serve's queue-length check. An empty answer, or ``None`` (what
    Ray 2.56.1-2.57's multiplex step returns for an adapter on no replica once its first fallback is taken: the real
    Serve test crashed there), is no rank this attempt: Serve backs off and asks again."""
    replicas = [SimpleNamespace(replica_id=r) for r in "abcd"]
    mixins = _Mixins(allowed)
    for _ in range(20):
        ranks = LoraCacheRouter._serve_choice(mixins, adapter, replicas, SimpleNamespace())  # type: ignore[arg-type]
        assert mixins.asked == ("multiplex" if adapter else "locality")
        if not allowed:
            assert ranks == []
            continue
        [rank] = ranks
        ids = [r.replica_id for r in rank]
        assert len(ids) == min(2, len(allowed)) == len(set(ids)) and set(ids) <= allowed


def _private_ray_uses(path: Path) -> list[str]:
    """Where ``path`` reaches a private Ray module (``ray._private``, ``ray.serve._private``, ...): an import, an
    attribute (``ray._private.worker`` after ``import ray``) or a dotted name in a string (a class path given to
    Serve, ``importlib``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Attribute):
            names = ["ray._private"] if node.attr == "_private" else []  # `ray._private.x`, `serve._private.x`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("ray.") else []
        else:
            continue
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "ray" and "._private" in n]
    return found


def test_the_integrations_use_only_rays_public_api() -> None:
    """Issue 45: the router subclassed ``ray.serve._private``'s ``PowerOfTwoChoicesRequestRouter``; private modules
    move between Ray releases without notice. The integrations use ``ray.serve.request_router`` and the rest of
    Ray's public API only (the scan finds imports, attributes and class paths in strings; it was checked to find
    the old import)."""
    package = Path(lora_cache.integrations.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert {"ray_serve.py", "serve_replica.py"} <= {f.name for f in files}
    assert not [use for path in files for use in _private_ray_uses(path)]


def test_router_config_names_the_router_class() -> None:
    config = router_config(server="10.0.0.5:50051", hint_timeout_s=0.1)
    assert config.get_request_router_class() is LoraCacheRouter
    assert config.request_router_kwargs["server"] == "10.0.0.5:50051"


def _place(settings: RouterSettings, replicas: list[str], requests: list[str]) -> dict[str, set[str]]:
    """``requests`` (one each 1/12 s, each done before the next: nothing in flight) ranked as ``LoraCacheRouter._rank``
    ranks them: an adapter is READY where it was first sent and stays there; its first request is cold everywhere."""
    config, traffic = settings.ranking(), Traffic(settings.traffic_s)
    where: dict[str, set[str]] = {}
    for i, adapter in enumerate(requests):
        now = i / 12
        home = where.setdefault(adapter, set())
        views = [
            ReplicaLoad(r, Residence.READY if r in home else Residence.COLD, 0.0, recent=traffic.get(r, now))
            for r in replicas
        ]
        pick = rank(adapter, views, config)[0].replica
        home.add(pick)
        traffic.add(pick, now)
    return where


def test_the_routers_cold_picks_balance_the_replicas_traffic_whatever_their_names() -> None:
    """Issue 32 (sixth round): Serve replica ids are random, and rendezvous hashing alone put the two hottest adapters
    on one replica in about a third of the runs (up to 86 % of the traffic on one replica, its other slots churning,
    another nearly idle: more misses and queueing than Serve's own routing). The router counts the requests it sent
    each replica lately and sends a cold adapter to the least busy one (``traffic_s``; off by default: it balances
    traffic, not slots, and loaded more than the hash order in 3 of 5 paired runs): whatever the replica names, no
    replica takes more than 60 % of the traffic, and 45 % at most on average over the runs (hash order alone, the
    default: 86 % and 55 %)."""
    rng = random.Random(7)
    names = [f"adapter-{i:03d}" for i in range(16)]
    weights = [1 / (i + 1) for i in range(16)]  # the benchmark's Zipf popularity
    shares = []
    for _ in range(40):
        replicas = [f"serve-LoraEngine-{rng.getrandbits(40):010x}" for _ in range(3)]
        requests = rng.choices(names, weights, k=240)
        where = _place(RouterSettings(traffic_s=10.0), replicas, requests)
        shares.append(max(sum(r in where[a] for a in requests) for r in replicas) / len(requests))
    assert max(shares) <= 0.6, shares
    assert sum(shares) / len(shares) <= 0.45, shares


def test_the_router_reads_a_named_version_as_ready_only_where_that_version_is() -> None:
    """Issue 44 item 3: a multiplexed id ``A@VERSION`` is READY only on replicas the stream shows READY at that very
    version; ``A`` at any version of it; a tag (no version the stream shows) nowhere: ranked by load, as cold."""
    from lora_cache.integrations.ray_serve import ready_replicas

    ready = {"a": {"r0": {"v1"}, "r1": {"v1", "v2"}}, "b": {"r2": {"v9"}}}
    assert ready_replicas(ready, "a") == {"r0", "r1"}
    assert ready_replicas(ready, "a@v2") == {"r1"} and ready_replicas(ready, "a@v1") == {"r0", "r1"}
    assert ready_replicas(ready, "a@step-7") == set() and ready_replicas(ready, "c") == set()


class _GatedController:
    """A real ``ControllerCore`` behind the ``.remote`` surface the gateway's hint paths use; each hint batch waits
    at the controller until ``release`` is set (``arrived`` says one is there). ``log``: what the core took, in
    order: ("hint", ids) once applied, ("cancel", ids, how many were active)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.arrived, self.release = threading.Event(), threading.Event()
        self.log: list[tuple[Any, ...]] = []
        self.hint_batches = SimpleNamespace(remote=self._hint_batches)
        self.cancel_hints = SimpleNamespace(remote=self._cancel_hints)
        self.status = SimpleNamespace(remote=self._status)
        self.worker_stats = SimpleNamespace(remote=self._worker_stats)

    async def _hint_batches(self, batches: list[Any]) -> list[Any]:
        self.arrived.set()
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait)
        outcomes = self.core.hint_batches(batches, time.time())
        self.log.append(("hint", [h[0] for b in batches for h in b]))
        return outcomes

    async def _cancel_hints(self, hint_ids: list[str]) -> int:
        cancelled = sum(self.core.cancel_hint(h, time.time()) for h in hint_ids)
        self.log.append(("cancel", list(hint_ids), cancelled))
        return cancelled

    async def _status(self) -> dict[str, Any]:
        return dict(self.core.status())

    async def _worker_stats(self) -> list[Any]:
        return []


def test_a_request_completed_while_its_hint_is_in_flight_is_withdrawn_after_the_hint_lands(tiny_adapters) -> None:
    """The fresh-clone CI's one failure (2026-12-02): a request completed while its Hint call was still in flight
    had its CancelHint sent at once; the cancel overtook the hint at the controller (a cancel of an id not active is
    nothing), the hint landed after it and stayed a need for the planner's hint_ttl_s. Pinned with a barrier: the
    hint waits at a real controller core behind a real gateway while the request completes; its cancel is sent only
    once the Hint answers, and withdraws it."""
    from lora_cache.adapters.catalog import CatalogConfig
    from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
    from lora_cache.controller.core import ControllerConfig, ControllerCore

    path = tiny_adapters(1)[0]
    core = ControllerCore(
        ControllerConfig(CatalogConfig(adapter_roots=(str(path.parent),), model="tiny", max_rank=16)), epoch=1
    )
    core.register_adapter(path.name, str(path))
    replica = _replica_id("LoraEngine", "abc123xy")
    core.add_replica(replica_name(replica), 1, 2)
    ctl = _GatedController(core)
    gw = start_gateway_thread(GatewayConfig(grpc_port=0), ctl)

    async def scenario() -> LoraCacheRouter:
        router = LoraCacheRouter.__new__(LoraCacheRouter)  # Serve's own constructor needs a running deployment
        router.initialize_state(**asdict(RouterSettings(server=gw.target, hint_batch_s=0, hint_timeout_s=10)))
        pending = SimpleNamespace(metadata=SimpleNamespace(internal_request_id="req-1", multiplexed_model_id=path.name))
        router.on_request_routed(pending, replica, None)  # type: ignore[arg-type]
        (hint_call,) = router._tasks
        await asyncio.get_running_loop().run_in_executor(None, ctl.arrived.wait)  # the hint is at the controller
        router.on_request_completed(replica, "req-1")
        await asyncio.gather(*(t for t in list(router._tasks) if t is not hint_call))  # a cancel sent now lands now
        ctl.release.set()
        while router._tasks:
            await asyncio.gather(*list(router._tasks))
        return router

    try:
        router = asyncio.run(scenario())
    finally:
        ctl.release.set()
        gw.stop()
    assert ctl.log == [("hint", ["req-1"]), ("cancel", ["req-1"], 1)], "the cancel overtook its hint"
    assert core.planner.view.hints(replica_name(replica)) == (), "a completed request's hint is still a need"
    assert not (router._flying or router._done_flying or router._hinted), "the router still tracks the request"
    assert (router.counts["hint_calls"], router.counts["cancel_calls"], router.counts["hint_errors"]) == (1, 1, 0)
