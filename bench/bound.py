"""What no policy that cannot see the future can beat: a floor under every figure of a run but the oracle's.

``python -m bench.bound RESULTS [RESULTS ...]`` (a ``bench.run`` results file, either engine); ``bench.run`` puts the
same floors in its results (``floor``) and under its table.

The benchmark's ``zipf`` and ``uniform`` popularities draw each request's adapter independently of every other
request, from fixed probabilities (the independent reference model; ``zipf:A,K`` with a new ranking in each of K
phases, fixed within each). Whatever the fleet holds when a request arrives (its GPU slots and host tiers) was
chosen without knowing which adapter the request names, so the chance that it names an adapter held nowhere is at
least one less the most probability a holding that fits can cover, and such a request waits for the store's read
less the router's lead (a hint can start the read that much before the request). A holding fits only if the
fleet's host tiers take every shard the GPU slots do not; relaxed here to: its shard bytes fit the host tiers' bytes
plus one largest shard per GPU slot, and covered fractionally (the fractional knapsack, best value per byte first).
The relaxation only widens what fits, so each figure is a floor for every online policy:

- ``missed``: the least share of requests whose adapter is held nowhere (value: the probability);
- ``stall_ms``: the least expected wait for store reads per request (value: probability x (read - lead));
- ``tail_ms``: the largest wait w such that more than 1 - ``quantile`` of requests wait at least w whatever is held
  (the adapters whose wait is >= w, less the most of their probability that fits): the ``quantile`` (p99) of the
  requests' load waits is at least that, in expectation (a window of a few hundred requests draws around it).

The oracle escapes it: it holds every adapter (one slot per adapter), which no fleet of these slots can. Contention
between reads, the copies to the GPU, queueing and the engine's adapter lanes only add to these. A read's time is the
fastest any of the run's store reads took per byte (its loads' ``disk_ms``: a floor too), or ``--read-gbps``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workloads import Popularity, WorkloadSpec, parse_popularity
from lora_cache.adapters.shapes import resolve_model
from lora_cache.errors import ConfigError

IRM = ("zipf", "uniform")  # popularities whose requests are drawn independently from fixed probabilities


@dataclass(frozen=True)
class Bound:
    """The floors of the module docstring for one fleet and workload."""

    missed: float  # share of requests
    stall_ms: float  # per request
    tail_ms: float  # the quantile's load wait
    quantile: float


def _independent(popularity: str) -> Popularity:
    spec = parse_popularity(popularity)
    if spec.kind not in IRM:
        raise ConfigError(f"popularity {popularity!r} does not draw requests independently from fixed probabilities; "
                          f"the floor holds for {' or '.join(IRM)} only (bursty, distinct and trace runs have none)")
    return spec


def probabilities(popularity: str, names: Sequence[str]) -> dict[str, float]:
    """Each adapter's probability per request under ``popularity`` (the benchmark's Zipf: rank i of ``names`` has
    weight 1 / (i + 1) ** A; in a phased Zipf each phase ranks the names anew, with the same weights)."""
    spec = _independent(popularity)
    if not names:
        raise ConfigError("no adapters: give the run's adapter names")
    weights = [1.0 if spec.kind == "uniform" else 1.0 / (i + 1) ** spec.alpha for i in range(len(names))]
    total = sum(weights)
    return {name: w / total for name, w in zip(names, weights)}


def _cover(items: Sequence[tuple[float, int]], capacity: float) -> float:
    """The fractional knapsack: the most value that ``capacity`` bytes hold of (value, bytes) items."""
    got, left = 0.0, float(capacity)
    for value, nbytes in sorted(items, key=lambda it: (-it[0] / max(1, it[1]), it[1])):
        if left <= 0:
            break
        if nbytes <= left:
            got, left = got + value, left - nbytes
        else:
            got, left = got + value * left / nbytes, 0.0
    return got


def online_floor(prob: Mapping[str, float], nbytes: Mapping[str, int], wait_s: Mapping[str, float], slots: int,
                 host_bytes: int, quantile: float = 0.99) -> Bound:
    """The floors for a fleet of ``slots`` GPU slots and ``host_bytes`` of host tier in all (per rank: a TP replica's
    ranks each hold their own shard), adapters of ``prob`` with shards of ``nbytes`` whose misses wait ``wait_s``
    (the read less the router's lead, >= 0)."""
    if not 0.0 < quantile < 1.0:
        raise ConfigError(f"quantile is {quantile}; give a share in (0, 1), e.g. 0.99 for the p99")
    if slots < 0 or host_bytes < 0:
        raise ConfigError(f"slots ({slots}) and host bytes ({host_bytes}) must be >= 0")
    names = list(prob)
    if not names or any(nbytes.get(n, 0) <= 0 or n not in wait_s for n in names):
        raise ConfigError("every adapter needs a shard size (> 0 bytes) and a wait; give both for each name")
    capacity = host_bytes + slots * max(nbytes[n] for n in names)
    waits = {n: max(0.0, wait_s[n]) for n in names}
    missed = 1.0 - _cover([(prob[n], nbytes[n]) for n in names], capacity)
    held = _cover([(prob[n] * waits[n], nbytes[n]) for n in names], capacity)
    stall = sum(prob[n] * waits[n] for n in names) - held
    tail = 0.0
    for w in sorted(set(waits.values()), reverse=True):
        slow = [n for n in names if waits[n] >= w]
        if w > 0 and sum(prob[n] for n in slow) - _cover([(prob[n], nbytes[n]) for n in slow], capacity) > \
                1.0 - quantile:
            tail = w
            break
    return Bound(max(0.0, missed), max(0.0, stall) * 1e3, tail * 1e3, quantile)


def shard_bytes(model: str, ranks: Sequence[int], names: Sequence[str], tp: int,
                dtype: str = "bfloat16") -> dict[str, int]:
    """Each adapter's bytes per TP rank as the benchmark writes them (name i has rank ``ranks[i % len(ranks)]``,
    every targeted module of ``model``)."""
    from bench.sim.controller import SyntheticCatalog
    from bench.sim.fleet import shard_bytes as sizes

    catalog = SyntheticCatalog(resolve_model(model), {n: ranks[i % len(ranks)] for i, n in enumerate(names)}, dtype)
    return sizes(catalog, tp, dtype)


def fastest_read(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> float | None:
    """Bytes per second of the fastest store read among the runs' loads (host-tier misses), None if none read."""
    rates = [float(ld["nbytes"]) / (float(ld["disk_ms"]) / 1e3) for loads in runs.values() for ld in loads
             if not ld.get("host_hit", True) and ld.get("disk_ms") and float(ld["disk_ms"]) > 0]
    return max(rates) if rates else None


def for_results(doc: Mapping[str, Any], quantile: float = 0.99, read_gbps: float | None = None) -> Bound:
    """The floors for a ``bench.run`` results document's fleet, workload and store."""
    bench, workload = doc["config"]["bench"], doc["config"]["workload"]
    if int(bench.get("num_layers") or 0):
        raise ConfigError(f"the run ran {bench['num_layers']} layers of {bench['model']} (--num-layers), so its shards "
                          "are not the whole model's; the floor is for whole models: rerun without --num-layers")
    _independent(str(workload["popularity"]))  # before the names: a trace's are in its file
    count = int(workload["adapters"])
    names = WorkloadSpec(popularity=str(workload["popularity"]), num_adapters=count).adapter_names(0)
    prob = probabilities(str(workload["popularity"]), names)
    ranks = [int(r) for r in str(bench["adapter_ranks"]).split(",")]
    nbytes = shard_bytes(str(bench["model"]), ranks, names, int(bench["tp"]))
    rate = read_gbps * 1e9 if read_gbps else fastest_read(doc.get("loads", {}))
    if not rate:
        raise ConfigError("the run read nothing from its store, so no read time is known; pass --read-gbps (the "
                          "store's bandwidth per read, GB/s)")
    lead = float(bench.get("hint_lead_s") or 0.0)
    wait = {n: nbytes[n] / rate - lead for n in names}
    replicas = int(bench["replicas"])
    if int(bench["host_bytes"]) <= 0:
        raise ConfigError("the run's host tier was sized automatically (--host-bytes 0) and its bytes are not in the "
                          "results; rerun with --host-bytes N to have a floor")
    return online_floor(prob, nbytes, wait, replicas * int(bench["slots"]), replicas * int(bench["host_bytes"]),
                        quantile)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.report import read_results

    parser = argparse.ArgumentParser(prog="python -m bench.bound", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench.run results files (results.json[.gz])")
    parser.add_argument("--quantile", type=float, default=0.99, help="the tail's quantile (0.99: the p99)")
    parser.add_argument("--read-gbps", type=float, default=None,
                        help="a store read's bandwidth, GB/s (default: the fastest of the run's own reads)")
    args = parser.parse_args(argv)
    print(f"| results | missed % floor | load wait ms/req floor | p{args.quantile * 100:g} load wait floor ms | "
          f"measured: policy, load wait ms/req / p{args.quantile * 100:g} |")
    print("| --- | ---: | ---: | ---: | --- |")
    failed = 0
    for path in args.results:
        try:
            doc = read_results(path)
            bound = for_results(doc, args.quantile, args.read_gbps)
        except ConfigError as e:
            print(f"{path}: {e}", file=sys.stderr)
            failed += 1
            continue
        measured = ", ".join(f"{p} {f['mean_load_wait_ms']:.1f} / {f['p99_load_wait_ms']:.0f}"
                             for p, f in doc["figures"].items())
        print(f"| {path} | {bound.missed * 100:.2f} | {bound.stall_ms:.1f} | {bound.tail_ms:.0f} | {measured} |")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
