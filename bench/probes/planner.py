"""Planner scale: one queue update of one replica, then an incremental replan, at fleet scale (CPU).

    python -m bench.probes.planner [--replicas 1000] [--adapters 10000] [--updates 2000] [--out FILE.json]

A fleet of `replicas` TP groups and a catalog of `adapters` (shard sizes of ranks 8/16/32/64, Zipf
popularity, alpha 1.5 by default) is warmed up: every replica gets a queue of a few adapters, the
whole fleet is planned (a few rounds, until popular adapters fill the free room) and every worker
reports its prefetches READY. Then, `updates` times, one random replica serves its oldest request
and receives a new one (Zipf), and the timer covers `report_queue` + `plan(now)`
(time.perf_counter_ns, one process pinned to one core when the OS allows). Also timed once: the
first `plan_all` over the whole (cold) fleet. Prints a markdown table last.
Target: median <= 1 ms per update.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

from lora_cache.planner import (
    AdapterInfo,
    Planner,
    PlannerConfig,
    QueueEntry,
    ReplicaSpec,
    ResidencyEntry,
    SlotState,
)

SHARD_BYTES_BY_RANK = {8: 7 << 20, 16: 14 << 20, 32: 28 << 20, 64: 56 << 20}  # ~8B model, TP 2, bf16


class ZipfSampler:
    """Adapter names drawn with P(k-th most popular) ~ 1 / k**alpha; popularity order is shuffled."""

    def __init__(self, names: list[str], alpha: float, rng: random.Random) -> None:
        self.names = names[:]
        rng.shuffle(self.names)
        self.cum = list(itertools.accumulate(1.0 / (k ** alpha) for k in range(1, len(names) + 1)))
        self.rng = rng

    def draw(self, k: int = 1) -> list[str]:
        return self.rng.choices(self.names, cum_weights=self.cum, k=k)


def build(args: argparse.Namespace, rng: random.Random) -> tuple[Planner, ZipfSampler]:
    ranks = list(SHARD_BYTES_BY_RANK)
    infos = [AdapterInfo(f"adapter-{i:05d}", "v1", SHARD_BYTES_BY_RANK[rng.choice(ranks)])
             for i in range(args.adapters)]
    slot_bytes = max(SHARD_BYTES_BY_RANK.values())
    specs = [ReplicaSpec(f"replica-{r:04d}", tuple(f"replica-{r:04d}/rank{k}" for k in range(args.tp)),
                         args.slots, args.slots * slot_bytes // 2) for r in range(args.replicas)]
    planner = Planner(PlannerConfig(policy=args.policy), 1, infos, specs)
    return planner, ZipfSampler([i.name for i in infos], args.alpha, rng)


def warm_up(planner: Planner, zipf: ZipfSampler, args: argparse.Namespace) -> float:
    """Queues everywhere, a full plan, every prefetch reported READY; the time of the full plan (s)."""
    arrival = itertools.count()
    for replica in planner.view.replicas():
        entries = [QueueEntry(a, float(next(arrival))) for a in zipf.draw(args.queue)]
        planner.report_queue(replica, entries, 0.0)
    start = time.perf_counter_ns()
    planner.plan_all(0.0)
    full_plan_s = (time.perf_counter_ns() - start) / 1e9
    for _ in range(args.warm_rounds):  # speculation is limited per plan: fill the free room first
        if planner.plan_all(0.0).is_empty:
            break
    for replica in planner.view.replicas():
        for worker in planner.view.workers(replica):
            held = [ResidencyEntry(k.name, k.version, SlotState.READY) for k in planner.view.residency(worker)]
            planner.report_residency(worker, held)
    planner.plan(0.0)
    return full_plan_s


def timed_updates(planner: Planner, zipf: ZipfSampler, args: argparse.Namespace,
                  rng: random.Random) -> tuple[list[int], int]:
    """Nanoseconds of each report_queue + plan, and the number of commands they produced."""
    replicas = planner.view.replicas()
    arrival = 1e9
    samples, commands = [], 0
    for step in range(args.updates):
        now = 1.0 + step * args.interval_s
        replica = rng.choice(replicas)
        arrival += 1
        entries = [*planner.view.queue(replica)[1:], QueueEntry(zipf.draw()[0], arrival)]
        start = time.perf_counter_ns()
        planner.report_queue(replica, entries, now)
        plan = planner.plan(now)
        samples.append(time.perf_counter_ns() - start)
        commands += len(plan.commands())
    return samples, commands


def percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, round(q * (len(sorted_ns) - 1)))] / 1e3


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--tp", type=int, default=2, help="workers (TP ranks) per replica")
    parser.add_argument("--slots", type=int, default=16, help="adapter slots per worker")
    parser.add_argument("--queue", type=int, default=4, help="waiting requests per replica")
    parser.add_argument("--alpha", type=float, default=1.5, help="Zipf exponent of adapter popularity")
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--warm-rounds", type=int, default=8, help="plan_all rounds before timing")
    parser.add_argument("--interval-s", type=float, default=0.001, help="controller time between updates")
    parser.add_argument("--policy", default="global")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rng = random.Random(args.seed)
    build_start = time.perf_counter()
    planner, zipf = build(args, rng)
    full_plan_s = warm_up(planner, zipf, args)
    setup_s = time.perf_counter() - build_start
    gc.collect()
    samples, commands = timed_updates(planner, zipf, args, rng)
    planner.check_integrity()
    ordered = sorted(samples)
    figures: dict[str, object] = {
        "replicas": args.replicas, "adapters": args.adapters, "tp": args.tp, "slots_per_worker": args.slots,
        "queue": args.queue, "alpha": args.alpha, "policy": args.policy, "updates": args.updates,
        "update_median_us": percentile(ordered, 0.5), "update_p99_us": percentile(ordered, 0.99),
        "update_mean_us": statistics.fmean(ordered) / 1e3, "update_max_us": ordered[-1] / 1e3,
        "commands_per_update": commands / args.updates, "plan_all_ms": full_plan_s * 1e3,
        "setup_s": setup_s, "target_median_us": 1000.0,
    }
    print_table(figures)
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def print_table(f: dict[str, object]) -> None:
    print(f"\nplanner: {f['replicas']} replicas x TP {f['tp']} x {f['slots_per_worker']} slots, "
          f"{f['adapters']} adapters (Zipf {f['alpha']}), queues of {f['queue']}, policy {f['policy']}\n")
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| report_queue + plan, median | {f['update_median_us']:.1f} us (target <= 1000 us) |")
    print(f"| report_queue + plan, p99 | {f['update_p99_us']:.1f} us |")
    print(f"| report_queue + plan, mean / max | {f['update_mean_us']:.1f} / {f['update_max_us']:.1f} us |")
    print(f"| commands per update | {f['commands_per_update']:.2f} |")
    print(f"| plan_all, whole fleet (once) | {f['plan_all_ms']:.1f} ms |")
    print(f"| updates timed | {f['updates']} |")


if __name__ == "__main__":
    main()
