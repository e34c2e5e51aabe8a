"""The embedded-default main job for now: make demo adapters, load them through one worker cache.

Every step acquires a batch's adapters, computes one LoRA delta per request straight from the slot
pool and checks it against the adapter file (invariant 1), then releases the batch.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors import safe_open

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import peft_key
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import ReadinessRecord
from workers.cache import WorkerCache, WorkerConfig


def _report(record: ReadinessRecord) -> None:
    src = "host tier" if record.host_hit else f"disk {record.disk_ms:6.2f} ms"
    print(f"  READY {record.adapter}@{record.version[:8]} rank {record.tp_rank} slot {record.slot:2d}  "
          f"{record.nbytes / 1024:8.1f} KiB  {src}  h2d {record.h2d_ms:6.3f} ms  ready in {record.ready_ms:6.2f} ms")


def _check_delta(cache: WorkerCache, name: str, slot: int) -> float:
    """Max |delta(slot) - delta(file)| for layer 0 q_proj on a random input."""
    spec = cache.catalog.get(name)
    layout = cache.layout_of(name)
    a = cache.slot_view(slot, layout, 0, "q_proj", "A").float()
    b = cache.slot_view(slot, layout, 0, "q_proj", "B").float()
    with safe_open(str(spec.weights), framework="pt") as f:
        ref_a = f.get_slice(peft_key(0, "q_proj", "A"))[layout.entry(0, "q_proj", "A").rows].float()
        ref_b = f.get_slice(peft_key(0, "q_proj", "B"))[layout.entry(0, "q_proj", "B").rows].float()
    x = torch.randn(3, a.shape[1])
    return float(((x @ a.T.cpu()) @ b.T.cpu() - (x @ ref_a.T) @ ref_b.T).abs().max())


def run_demo(out: Path, synth: SynthConfig, config: WorkerConfig, steps: int, seed: int) -> dict[str, object]:
    print(f"making {synth.count} {synth.model} adapters (ranks {synth.rank}) in {out}")
    make_adapters(out, synth)
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(str(out),), model=synth.model,
                                           max_rank=max(synth.ranks())))
    names = [s.name for s in catalog.register_dir(out)]
    cache = WorkerCache(config, catalog, on_ready=_report)
    print(f"worker: {config.num_slots} slots of {cache.slot_numel * cache.dtype.itemsize / 1024:.1f} KiB on "
          f"{cache.device}, TP rank {config.tp_rank}/{config.tp}, {len(names)} adapters registered")
    print(f"prefetching {min(len(names), config.num_slots) // 2} adapters (as the controller would):")
    for name in names[: config.num_slots // 2]:
        cache.prefetch(name).result(timeout=60)
    rng, worst = random.Random(seed), 0.0
    print(f"running {steps} engine steps of 4 requests (zipf-like adapter choice):")
    for _ in range(steps):
        batch = cache.acquire([names[min(int(rng.paretovariate(1.2)) - 1, len(names) - 1)] for _ in range(4)])
        worst = max(worst, *(_check_delta(cache, n if isinstance(n, str) else n.name, s)
                                for n, s in zip(batch.adapters, batch.slots)))
        cache.release(batch)
        cache.check_integrity()
    stats = cache.stats()
    cache.close()
    print(f"every request computed with its own adapter's weights (max |delta error| {worst:.2e})")
    for key in ("gpu_hits", "gpu_misses", "host_hits", "host_misses", "loads", "evictions",
                "bytes_disk_to_host", "bytes_host_to_gpu", "ready_ms"):
        print(f"  {key:18} {stats[key]}")
    return stats
