"""The benchmark router's rules (lifecycle step 1): which replica each request goes to. Plain Python.

The simulator routes with these very rules (``bench.sim.fleet.ROUTERS``, over a gateway made of the
simulated fleet), so a real run and its simulation (``bench.sim.check``) route alike; only their sources differ:

- ``round-robin``: request i to replica i mod R, in routing order (arrival order);
- ``least-loaded``: the fewest requests routed there and not finished (the router's own count);
  ties: the lowest replica index;
- ``affinity`` (llm-d's lora-affinity, Ray Serve's multiplexing): the least-loaded replica where the
  adapter is READY on every rank (the gateway's ``Lookup``), else the least-loaded one;
- ``lora-cache``: the first replica of the gateway's ``Route`` ranking, the router's own counts passed as
  the loads; a base-model request goes to the least-loaded replica.

A rule routes the requests due together in one call (``route``), in order, each pick counting in the
loads before the next; ``lora-cache`` asks ``Route`` once for each run of consecutive adapter requests
(the advice adds each pick's load itself, as a stream of single calls would). The rules read the gateway
through the ``Gateway`` protocol, so tests give them a fake one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

from lora_cache.errors import ConfigError


class Gateway(Protocol):
    """What a rule may ask lora-cache (``bench.router.real.GatewayRoutes`` answers over gRPC)."""

    def ready(self, adapter: str) -> Collection[str]:
        """Replicas where ``adapter``'s current version is READY on every rank (``Lookup``)."""
        ...

    def first(self, adapters: Sequence[str], loads: Mapping[str, int]) -> list[str]:
        """The best replica for each adapter's request, in order (``Route``; ``loads``: in flight per replica)."""
        ...


class Rule(Protocol):
    def route(self, adapters: Sequence[str | None], loads: dict[str, int], gateway: Gateway) -> list[str]:
        """The replica of each request (its adapter, None: the base model), in order; ``loads`` (every
        replica, in index order: requests routed there and not finished) takes each pick."""
        ...


def least_loaded(loads: Mapping[str, int], among: Iterable[str] | None = None) -> str:
    """The replica with the fewest in flight among ``among`` (default: all); ties: the lowest index."""
    order = {r: i for i, r in enumerate(loads)}
    return min(loads if among is None else among, key=lambda r: (loads[r], order[r]))


def _take(loads: dict[str, int], replica: str) -> str:
    loads[replica] += 1
    return replica


class RoundRobin:
    """Request i to replica i mod R (the i-th request this rule routes)."""

    def __init__(self) -> None:
        self.next = 0

    def route(self, adapters: Sequence[str | None], loads: dict[str, int], gateway: Gateway) -> list[str]:
        names = list(loads)
        out = []
        for _ in adapters:
            out.append(_take(loads, names[self.next % len(names)]))
            self.next += 1
        return out


class LeastLoaded:
    def route(self, adapters: Sequence[str | None], loads: dict[str, int], gateway: Gateway) -> list[str]:
        return [_take(loads, least_loaded(loads)) for _ in adapters]


class Affinity:
    def route(self, adapters: Sequence[str | None], loads: dict[str, int], gateway: Gateway) -> list[str]:
        ready: dict[str, Collection[str]] = {}  # one Lookup per adapter of the batch
        out = []
        for adapter in adapters:
            if adapter is not None and adapter not in ready:
                ready[adapter] = gateway.ready(adapter)
            here = [r for r in loads if r in ready[adapter]] if adapter is not None else []
            out.append(_take(loads, least_loaded(loads, here or None)))
        return out


class LoraCache:
    def route(self, adapters: Sequence[str | None], loads: dict[str, int], gateway: Gateway) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(adapters):
            adapter = adapters[i]
            if adapter is None:
                out.append(_take(loads, least_loaded(loads)))
                i += 1
                continue
            run = [adapters[j] for j in range(i, _run_end(adapters, i))]
            picks = gateway.first([a for a in run if a is not None], dict(loads))
            if len(picks) != len(run) or any(p not in loads for p in picks):
                raise ConfigError(f"Route answered {picks} for {len(run)} requests over replicas {list(loads)}; "
                                  "the gateway must rank the router's replicas for every item")
            out += [_take(loads, p) for p in picks]
            i += len(run)
        return out


def _run_end(adapters: Sequence[str | None], i: int) -> int:
    while i < len(adapters) and adapters[i] is not None:
        i += 1
    return i


RULES: dict[str, type[Rule]] = {"round-robin": RoundRobin, "least-loaded": LeastLoaded, "affinity": Affinity,
                                "lora-cache": LoraCache}


def make_rule(name: str) -> Rule:
    if name not in RULES:
        raise ConfigError(f"router {name!r} is not registered; choose one of {', '.join(RULES)}")
    return RULES[name]()
