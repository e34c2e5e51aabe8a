"""Where a reference-engine step spends its time on the GPU: per-step wall times and a torch profile.

    python -m bench.probes.engine_profile --adapters /tmp/ad8b --out OUT [--layers 32] [--batch 32]

Runs one rank (TP 1) of ``llama-3.1-8b``: one prefill of ``--batch`` requests, then decode steps with
and without LoRA adapters, replayed as CUDA graphs (the default) and eager (``*_eager_ms``), and a
``torch.profiler`` trace of a few eager decode steps (top ops by self CPU
and by CUDA time, kernel launches per step), so step overheads (launches, syncs) can be told from the
math. Items run grouped by adapter (as the scheduler orders them) and, ``decode_lora_row_order_ms``,
in KV-row order. ``lora_call_us``: host time of one call of the engine's LoRA op (q/k/v at the decode batch, real
launches, nothing synced), the per-call cost the 4 x layers calls of a step pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lora_cache.adapters.synth import SynthConfig, make_adapters
from workers.engine.config import EngineConfig
from workers.engine.model import QKV
from workers.engine.rank import RankEngine
from workers.engine.scheduler import DECODE, PREFILL, Item, StepPlan
from workers.engine.tp import Comm


def _decode(engine: RankEngine, items: list[Item], step: int, adapters: bool) -> float:
    its = tuple(Item(it.rid, it.adapter if adapters else None, it.row, it.length + step, 1) for it in items)
    hold = tuple(sorted({it.adapter for it in its if it.adapter}))
    res = engine.execute(StepPlan(DECODE, its, hold))
    assert res is not None
    return (res.end_s - res.start_s) * 1e3


def lora_call_us(engine: RankEngine, items: list[Item], calls: int = 256) -> float:
    """Host time per call of the engine's LoRA op at the decode batch (best of 5 loops, no sync inside)."""
    num_slots = engine.cache.config.num_slots  # any slots will do: this times the host side only
    slots = [engine.index[it.adapter] % num_slots if it.adapter else -1 for it in items]
    engine.lora.begin(slots, [1] * len(items), prefill=False)
    d_in, width = engine.model.shape.hidden_size, sum(engine.cache.meta.dims[m][1] for m in QKV)
    x = torch.randn(len(items), d_in, device=engine.device).to(engine.dtype)
    y = torch.zeros(len(items), width, device=engine.device, dtype=engine.dtype)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            engine.lora(x, y, i % len(engine.model.layers), QKV)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--adapters", default="/tmp/ad8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--distinct", type=int, default=4)
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if not any(Path(ns.adapters).glob("*/adapter_config.json")):
        make_adapters(ns.adapters, SynthConfig(model="llama-3.1-8b", count=8, rank="16,64"))
    config = EngineConfig(adapters=ns.adapters, model="llama-3.1-8b", num_layers=ns.layers, device="cuda",
                          num_slots=8, max_running=ns.batch, max_adapters=ns.distinct)
    engine = RankEngine(config, Comm())
    t0 = time.perf_counter()
    engine.warm_up()  # compiles the kernels and captures the decode graphs
    out: dict[str, object] = {"warm_up_s": time.perf_counter() - t0,
                              "graphs": len(engine.graphs.graphs) if engine.graphs is not None else 0}
    names = engine.names[: ns.distinct]
    items = [Item(i, names[i % len(names)], i, 0, 128) for i in range(ns.batch)]
    items.sort(key=lambda it: it.adapter or "")
    res = engine.execute(StepPlan(PREFILL, tuple(items), tuple(names)))
    assert res is not None
    out["prefill_ms"] = (res.end_s - res.start_s) * 1e3
    steps = 0
    by_row = sorted(items, key=lambda it: it.row)  # KV rows in order: attention reads the cache in place
    eighth = items[: max(1, len(items) // 4)]
    graphs = engine.graphs
    # graph replays (the engine's default on the GPU), then the same steps eager
    for suffix, use in (("", graphs), ("_eager", None)):
        engine.graphs = use
        for label, order, adapters in (("decode_lora", items, True), ("decode_base", items, False),
                                       ("decode_lora_row_order", by_row, True),
                                       (f"decode_lora_batch{len(eighth)}", eighth, True)):
            times = []
            for _ in range(12):
                steps += 1
                times.append(_decode(engine, order, steps, adapters))
            out[f"{label}{suffix}_ms"] = statistics.median(times[2:])
    engine.graphs = None  # the profile below shows the eager step's launches
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            steps += 1
            _decode(engine, items, steps, True)
    averages = prof.key_averages()
    out["launches_per_step"] = sum(e.count for e in averages if "LaunchKernel" in e.key) / 3
    out["lora_call_us"] = lora_call_us(engine, items)
    table_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=30)
    table_cuda = averages.table(sort_by="self_cuda_time_total", row_limit=20)
    (ns.out / "profile_cpu.txt").write_text(table_cpu)
    (ns.out / "profile_cuda.txt").write_text(table_cuda)
    print(table_cpu)
    print(table_cuda)
    engine.close()
    print(json.dumps(out, indent=2))
    (ns.out / "engine_profile.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
