"""Layer-pipelined loads on one GPU (issue 21): what a missed adapter adds to a prefill's TTFT, and the
bandwidth of chunked copies against the one-copy load.

For each rank and prompt length, one prefill step of one request (``RankEngine.execute``, Llama-3.1-8B
shapes, base weights shared across layers) is timed from the step's start (acquire included) to its
tokens: with the adapter resident, a host-tier hit (staged, no slot) and a page-cache read (the file
read before, dropped from the host tier), each under whole-adapter waits (``ondemand``) and per-layer
chunk waits (``pipelined``). Medians of ``--repeats``. Then, from a staged shard, one copy of the whole
packed shard against its chunk plan's copies (events on the copy stream).

    python -m bench.probes.pipeline [--ranks 16,64] [--prompts 128,512,1024,2048] [--repeats 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.vocab import AdapterKey
from workers.engine.config import EngineConfig
from workers.engine.rank import RankEngine
from workers.engine.scheduler import PREFILL, Item, StepPlan
from workers.engine.tp import Comm
from workers.staging.host_config import HostTierConfig

MODES = {"ondemand": False, "pipelined": True}  # rule -> acquire(pipelined=)


def _engine(root: Path, rank: int, max_prompt: int) -> RankEngine:
    config = EngineConfig(adapters=str(root), model="llama-3.1-8b", device="cuda", num_slots=2, max_rank=rank,
                          max_running=2, max_adapters=2, max_prefill_tokens=max_prompt, max_seq_len=max_prompt + 16,
                          admission="pipelined", share_weights=True, cuda_graphs=False,
                          host=HostTierConfig(host_bytes=4 << 30))
    engine = RankEngine(config, Comm())
    engine.warm_up()
    return engine


def _prepare(engine: RankEngine, name: str, where: str) -> None:
    cache = engine.cache
    key = AdapterKey(name, cache.catalog.get(name).version)
    cache.prefetch(name).result(timeout=300)  # read once: the file is in the page cache from here on
    cache.settle()
    if where == "resident":
        return
    assert cache.evict(name), f"{name} could not be evicted"
    if where == "page-cache":
        assert cache.host.drop(key), f"{name} could not be dropped from the host tier"
    torch.cuda.synchronize()


def _ttft(engine: RankEngine, name: str, prompt: int, rid: int) -> float:
    plan = StepPlan(PREFILL, (Item(rid, name, 0, 0, prompt),))
    step = engine.execute(plan)
    assert step is not None
    return (step.end_s - step.start_s) * 1e3


def ttft_table(engine: RankEngine, names: list[str], prompts: list[int], repeats: int) -> list[dict[str, Any]]:
    rows, rid = [], 0
    for prompt in prompts:
        _prepare(engine, names[0], "resident")
        _ttft(engine, names[0], prompt, rid)  # compile this length's kernels outside the clock
        for mode, pipelined in MODES.items():
            engine.pipelined = pipelined
            for where in ("resident", "host-hit", "page-cache"):
                times = []
                for i in range(repeats):
                    name = names[i % len(names)]
                    _prepare(engine, name, where)
                    rid += 1
                    times.append(_ttft(engine, name, prompt, rid))
                rows.append({"prompt": prompt, "mode": mode, "where": where, "ttft_ms": statistics.median(times),
                             "all_ms": [round(t, 3) for t in times]})
    return rows


def copy_bandwidth(engine: RankEngine, name: str, repeats: int) -> dict[str, float]:
    """GB/s of the one-copy load and of the chunk plan's copies, from the staged shard into a free slot."""
    cache = engine.cache
    spec, layout, plan = cache.catalog.get(name), cache.layout_of(name), cache.plan_of(name)
    staged, _ = cache.host.fetch(spec, layout)
    src = staged.result(timeout=300).tensor
    dst = torch.empty(layout.numel, dtype=cache.dtype, device=cache.device)
    streams = cache.streams
    out: dict[str, list[float]] = {"one_copy": [], "chunked": []}
    for _ in range(repeats + 1):
        for what in out:
            torch.cuda.synchronize()
            if what == "one_copy":
                start, end = streams.copy_chunk(dst, src)
            else:
                start = None
                for c in plan.chunks:
                    s, end = streams.copy_chunk(dst[c.start : c.stop], src[c.start : c.stop])
                    start = start or s
            torch.cuda.synchronize()
            out[what].append(layout.nbytes / (streams.elapsed_ms(start, end) * 1e-3) / 1e9)
    cache.host.release(AdapterKey(name, spec.version))
    one, chunked = statistics.median(out["one_copy"][1:]), statistics.median(out["chunked"][1:])
    return {"chunks": len(plan.chunks), "bytes": layout.nbytes, "one_copy_gbps": one, "chunked_gbps": chunked,
            "ratio": chunked / one}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--prompts", default="128,512,1024,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "ranks": {}}
    for rank in (int(x) for x in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            make_adapters(root, SynthConfig(model="llama-3.1-8b", count=3, rank=str(rank)))
            engine = _engine(root, rank, max(prompts))
            names = engine.names
            try:
                rows = ttft_table(engine, names, prompts, args.repeats)
                bw = copy_bandwidth(engine, names[0], args.repeats)
            finally:
                engine.close()
        result["ranks"][rank] = {"ttft": rows, "copy": bw}
        print(json.dumps({"rank": rank, "copy": bw}), flush=True)
        for r in rows:
            print(json.dumps({"rank": rank, **{k: v for k, v in r.items() if k != "all_ms"}}), flush=True)
    summary = {}
    for rank, data in result["ranks"].items():
        base = {(r["prompt"], r["mode"]): r["ttft_ms"] for r in data["ttft"] if r["where"] == "resident"}
        for r in data["ttft"]:
            if r["where"] != "resident":
                summary[f"r{rank} p{r['prompt']} {r['mode']} {r['where']}"] = round(
                    r["ttft_ms"] / base[(r["prompt"], r["mode"])] - 1, 3)
    result["added_fraction"] = summary
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
