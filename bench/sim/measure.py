"""Measure a calibration on this machine's CPU with the reference engine, and check the simulator against it.

    python -m bench.sim.measure --adapters /tmp/adt --out bench/calibration/cpu-tiny.json [--logs DIR]

1. Steps: one ``RankEngine`` (TP 1, CPU, the ``tiny`` model, float32 slots) runs prefill steps of
   1-8 prompts of 16-256 tokens and decode steps of 1-32 requests over 1-4 distinct adapters, every
   adapter READY first (no load in any timed step); each shape's median of ``--repeats`` is one log row.
2. Loads: the rank's ``WorkerCache`` loads every adapter cold (a disk read into the host tier), then
   again from the host tier after an evict; each load's ``ReadinessRecord`` is one log row.
3. ``fit_calibration`` fits the costs. The control latencies are not measured here (no Ray): they
   are the worker outbox's 5 ms flush interval and a 1 ms actor call (bench/RESULTS.md measured a
   hint becoming replica-READY in 6 ms on this machine's local Ray).
4. Check: the same requests (``python -m workers.engine``'s defaults: 64 requests over 16 adapters,
   8 slots; at ``--rates``) go through ``run_engine`` (one replica, ondemand then overlap;
   ``--check-runs`` times, as the real runs vary) and through ``simulate`` with the fitted
   calibration; the summaries are printed.

Steps run with one torch intra-op thread (see ``main``): run ``python -m workers.engine`` with
``OMP_NUM_THREADS=1`` to compare with the calibration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from bench.policies import BENCH_POLICIES
from bench.sim.calibration import Calibration, fit_calibration
from bench.sim.fleet import SimConfig, simulate
from bench.workloads import Workload, WorkloadSpec
from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.cache import WorkerCache
from workers.engine.catalog import load_catalog
from workers.engine.config import EngineConfig
from workers.engine.engine import run_engine
from workers.engine.rank import RankEngine
from workers.engine.scheduler import DECODE, PREFILL, Item, StepPlan
from workers.engine.tp import Comm
from workers.engine.workload import WorkloadConfig, make_requests

SHOWN = ("duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_load_wait_ms")
REPORT_LATENCY_MS, COMMAND_LATENCY_MS = 5.0, 1.0
ADAPTER_RANKS = "8,16"  # python -m workers.engine --make-adapters' default


def time_steps(engine: RankEngine, repeats: int) -> list[dict[str, object]]:
    """Median ms of each prefill and decode shape (adapters READY beforehand)."""
    names = engine.names
    for name in names[: engine.config.num_slots]:
        engine.cache.prefetch(name).result()
    rows: list[dict[str, object]] = []
    for items in (1, 2, 4, 8):
        for tokens in (16, 64, 128, 256):
            batch = tuple(Item(i, names[i % 4], i, 0, tokens) for i in range(items))
            ms = _median_ms(engine, StepPlan(PREFILL, batch, _adapters(batch)), repeats)
            rows.append({"kind": "prefill", "items": items, "tokens": items * tokens, "adapters": min(items, 4),
                         "ms": ms})
    for items in (1, 2, 4, 8, 16, 32):
        for distinct in (1, 2, 4):
            batch = tuple(Item(i, names[i % distinct], i, 300, 1) for i in range(items))
            ms = _median_ms(engine, StepPlan(DECODE, batch, _adapters(batch)), repeats)
            rows.append({"kind": "decode", "items": items, "tokens": items, "adapters": min(items, distinct),
                         "ms": ms})
    return rows


def _adapters(batch: tuple[Item, ...]) -> tuple[str, ...]:
    return tuple(sorted({it.adapter for it in batch if it.adapter is not None}))


def _median_ms(engine: RankEngine, plan: StepPlan, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        step = engine.execute(plan)
        assert step is not None and step.load_wait_s == 0.0
        times.append((step.end_s - step.start_s) * 1e3)
    return statistics.median(times[1:])


def time_loads(engine: RankEngine) -> list[dict[str, object]]:
    """Every adapter loaded from disk, then again from the host tier."""
    cache, rows = engine.cache, list[dict[str, object]]()
    if not isinstance(cache, WorkerCache):
        raise TypeError(f"time_loads needs the engine's own WorkerCache to evict from, not {type(cache).__name__}")
    for name in engine.names:
        cache.evict(name)
    for _ in range(2):  # cold, then host-tier hits
        for name in engine.names:
            record = cache.prefetch(name).result()
            rows.append({"nbytes": record.nbytes, "ready_ms": record.ready_ms, "h2d_ms": record.h2d_ms,
                         "disk_ms": record.disk_ms, "host_hit": record.host_hit})
            cache.evict(name)
    return rows


def check(config: EngineConfig, calibration: Calibration, workload: WorkloadConfig) -> dict[str, dict[str, float]]:
    """The same requests on the real engine and on the simulator (one replica, the engine's bounds and rule)."""
    names = load_catalog(config).names()
    requests = make_requests(workload, names)
    real = run_engine(config, requests).summary()
    spec = WorkloadSpec(requests=len(requests))
    sim_config = SimConfig(replicas=1, tp=1, slots=config.num_slots, max_running=config.max_running,
                           max_adapters=config.max_adapters, max_prefill_tokens=config.max_prefill_tokens,
                           model=config.model, adapter_ranks=ADAPTER_RANKS, host_bytes=config.host.sized(1).host_bytes)
    workload_ = Workload(spec, names, requests, 0)
    sim = simulate(sim_config, BENCH_POLICIES[config.admission], workload_, calibration).summary()
    return {"real": real, "sim": sim}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=Path, default=Path("/tmp/adt"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--logs", type=Path, help="also write the step and load logs (JSONL) here")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rates", default="10,20", help="request rates of the check (64 requests each)")
    p.add_argument("--check-runs", type=int, default=3, help="real engine runs per rate and rule (they vary)")
    ns = p.parse_args()
    # One intra-op thread: on a shared 2-core machine two OpenMP threads against other load made step
    # times erratic (decode medians of 30-160 ms instead of 2-8 ms). Run the engine the same way to compare.
    torch.set_num_threads(1)
    if not any(ns.adapters.glob("*/adapter_config.json")):
        make_adapters(ns.adapters, SynthConfig(model="tiny", count=16, rank=ADAPTER_RANKS))
    config = EngineConfig(adapters=str(ns.adapters), model="tiny", device="cpu", num_slots=8, max_seq_len=2048)
    engine = RankEngine(config, Comm())
    try:
        steps, loads = time_steps(engine, ns.repeats), time_loads(engine)
    finally:
        engine.close()
    base = Calibration(slot_dtype="float32", report_latency_ms=REPORT_LATENCY_MS, command_latency_ms=COMMAND_LATENCY_MS)
    source = (f"python -m bench.sim.measure on {time.strftime('%Y-%m-%d')}: RankEngine TP1 CPU float32, tiny model, "
              f"{len(steps)} step shapes (median of {ns.repeats}), {len(loads)} loads; control latencies assumed "
              "(outbox flush 5 ms, actor call 1 ms)")
    calibration = fit_calibration(steps, loads, name="cpu-tiny", source=source, base=base)
    ns.out.write_text(calibration.to_json())
    if ns.logs:
        ns.logs.mkdir(parents=True, exist_ok=True)
        (ns.logs / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        (ns.logs / "loads.jsonl").write_text("".join(json.dumps(ld) + "\n" for ld in loads))
    print(calibration.to_json())
    for rate in map(float, ns.rates.split(",")):
        for admission in ("ondemand", "overlap"):
            for run in range(ns.check_runs):
                compared = check(dataclasses.replace(config, admission=admission), calibration,
                                 WorkloadConfig(requests=64, rate=rate))
                for side, summary in compared.items():
                    if side == "real" or run == 0:
                        print(f"rate {rate:g} {admission} {side}", json.dumps({k: round(summary[k], 2) for k in SHOWN}),
                              flush=True)


if __name__ == "__main__":
    main()
