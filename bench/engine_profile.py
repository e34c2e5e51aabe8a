"""Where a reference-engine step spends its time on the GPU: per-step wall times and a torch profile.

    python -m bench.engine_profile --adapters /tmp/ad8b --out OUT [--layers 32] [--batch 32]

Runs one rank (TP 1) of ``llama-3.1-8b``: one prefill of ``--batch`` requests, then decode steps with
and without LoRA adapters, and a ``torch.profiler`` trace of a few decode steps (top ops by self CPU
and by CUDA time), so step overheads (launches, syncs) can be told from the math.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from lora_cache.synth import SynthConfig, make_adapters
from workers.engine.batching import DECODE, PREFILL, Item, StepPlan
from workers.engine.config import EngineConfig
from workers.engine.rank import RankEngine
from workers.engine.tp import Comm


def _decode(engine: RankEngine, items: list[Item], step: int, adapters: bool) -> float:
    its = tuple(Item(it.rid, it.adapter if adapters else None, it.row, it.length + step, 1) for it in items)
    hold = tuple(sorted({it.adapter for it in its if it.adapter}))
    res = engine.execute(StepPlan(DECODE, its, hold))
    assert res is not None
    return (res.end_s - res.start_s) * 1e3


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
    names = engine.names[: ns.distinct]
    items = [Item(i, names[i % len(names)], i, 0, 128) for i in range(ns.batch)]
    items.sort(key=lambda it: it.adapter or "")
    res = engine.execute(StepPlan(PREFILL, tuple(items), tuple(names)))
    assert res is not None
    out: dict[str, object] = {"prefill_ms": (res.end_s - res.start_s) * 1e3}
    steps = 0
    for label, adapters in (("decode_lora_ms", True), ("decode_base_ms", False)):
        times = []
        for _ in range(12):
            steps += 1
            times.append(_decode(engine, items, steps, adapters))
        out[label] = statistics.median(times[2:])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            steps += 1
            _decode(engine, items, steps, True)
    table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    table_cuda = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    (ns.out / "profile_cpu.txt").write_text(table_cpu)
    (ns.out / "profile_cuda.txt").write_text(table_cuda)
    print(table_cpu)
    print(table_cuda)
    engine.close()
    print(json.dumps(out, indent=2))
    (ns.out / "engine_profile.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
