"""LoRA kernel measurements (issue 5): decode-shape bandwidth vs a device copy, and time vs the torch reference.

    python -m bench.kernels --out FILE [--model llama-3.1-8b] [--tokens 1,2,4,...,256] [--ranks 16,64]
                            [--mixes distinct,uniform8] [--modes bgmv] [--sweep]
    python -m bench.kernels --smoke --out FILE     # tiny shapes on the CPU: the script runs end to end

For each (mode, rank, adapter mix, tokens): one layer's fused q/k/v LoRA of the model shape in bf16, each
adapter in its own slot of a pool, one ``lora_apply`` per step. Time per call is measured from CUDA-graph
replays (what a decode engine runs; launch overhead excluded) and eagerly. Bytes touched = A and B of
every distinct adapter in the batch + x + y read and written; bandwidth = bytes / time, as a fraction
of a device-to-device copy's bandwidth measured in the same run (goal >= 0.7 at large decode batches).
``--sweep`` also tries other BGMV block sizes at the largest batch. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from lora_cache.cliargs import add_config_args, config_from_args
from lora_cache.peft import AdapterConfig, AdapterSpec, LoraModule
from lora_cache.shapes import MODULE_ORDER, ModelShape, resolve_model
from lora_cache.shards import shard_layout
from workers.kernels import BatchMeta, SlotMeta, lora_apply, lora_apply_ref, shard_dims
from workers.kernels.tuning import tuned

GOAL = 0.7  # fraction of the copy bandwidth the decode kernels should reach at large batches


@dataclass(frozen=True)
class KernelBenchConfig:
    model: str = field(default="llama-3.1-8b", metadata={"help": "named model shape or config.json"})
    tokens: str = field(default="1,2,4,8,16,32,64,128,256", metadata={"help": "decode batch sizes"})
    ranks: str = field(default="16,64", metadata={"help": "LoRA ranks"})
    mixes: str = field(default="distinct,uniform8", metadata={"help": "distinct (one adapter per token) or "
                                                                       "uniformN (tokens share N adapters)"})
    modes: str = field(default="bgmv", metadata={"help": "kernels: bgmv (decode) and/or sgmv (prefill)"})
    modules: str = field(default="q_proj,k_proj,v_proj", metadata={"help": "fused modules of one call"})
    dtype: str = field(default="bfloat16", metadata={"help": "pool and activation dtype"})
    reps: int = field(default=30, metadata={"help": "timed repetitions (graph replays of 10 calls each)"})
    ref_reps: int = field(default=3, metadata={"help": "timed repetitions of the torch reference"})
    copy_mib: int = field(default=1024, metadata={"help": "size of the device copy measured for the roofline"})
    sweep: bool = field(default=False, metadata={"help": "also try other BGMV block sizes at the largest batch"})
    smoke: bool = field(default=False, metadata={"help": "tiny shapes on the CPU (checks the script runs)"})

    def ints(self, name: str) -> list[int]:
        return [int(v) for v in getattr(self, name).split(",") if v.strip()]

    def names(self, name: str) -> list[str]:
        return [v.strip() for v in getattr(self, name).split(",") if v.strip()]


SMOKE: dict[str, Any] = dict(model="tiny", tokens="1,3", ranks="8", mixes="distinct,uniform2", modes="bgmv,sgmv",
                             dtype="float32", reps=2, ref_reps=1, copy_mib=4)


# -- timing ------------------------------------------------------------------------------------------------
def _median_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def graph_ms(step: Callable[[], None], reps: int, device: torch.device, inner: int = 10) -> float:
    """Median time of one ``step`` from replays of a CUDA graph of ``inner`` steps (eager on the CPU)."""
    if device.type != "cuda":
        return _median_ms(step, reps, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            step()
    graph.replay()
    return _median_ms(graph.replay, reps, device) / inner


def copy_gbps(device: torch.device, mib: int, reps: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), the roofline of this run."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _median_ms(lambda: dst.copy_(src), max(reps, 5), device)
    return 2 * src.numel() / ms / 1e6


# -- one measured case ---------------------------------------------------------------------------------------
class Case(NamedTuple):
    pool: torch.Tensor
    meta: SlotMeta
    batch: BatchMeta
    x: torch.Tensor
    y: torch.Tensor
    bytes_touched: int


def build_case(shape: ModelShape, modules: list[str], rank: int, tokens: int, mix: str, mode: str,
               dtype: torch.dtype, device: torch.device, seed: int = 0) -> Case:
    """One layer's adapters, one per slot, and a batch of ``tokens`` using them as ``mix`` says."""
    one_layer = dataclasses.replace(shape, num_layers=1)
    rng = np.random.default_rng(seed)
    num_slots = tokens if mix == "distinct" else int(mix.removeprefix("uniform"))
    token_slots = rng.permutation(tokens) if mix == "distinct" else rng.integers(0, num_slots, tokens)
    spec = AdapterSpec("bench", Path("bench"), AdapterConfig(r=rank, lora_alpha=rank, target_modules=tuple(modules)),
                       tuple(LoraModule(0, m, rank, 1.0) for m in modules), str(dtype)[6:], "v0", 0)
    layout = shard_layout(spec, one_layer, 1, 0, dtype)
    pool = torch.randn(num_slots, layout.numel, device=device).to(dtype) * 0.05
    meta = SlotMeta(num_slots, 1, MODULE_ORDER, device, max_rank=rank, dims=shard_dims(one_layer, 1),
                    slot_numel=layout.numel)
    for slot in range(num_slots):
        meta.write(slot, layout, spec)
    batch = BatchMeta(tokens, tokens, device, num_slots=num_slots)
    if mode == "sgmv":
        grouped = np.sort(token_slots)
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        batch.set_segments(np.diff(np.r_[starts, tokens]).tolist(), grouped[starts].tolist())
    else:
        batch.set_tokens(token_slots.tolist())
    d_in, width = shape.dims(modules[0])[0], sum(shape.dims(m)[1] for m in modules)
    x = torch.randn(tokens, d_in, device=device).to(dtype)
    y = torch.zeros(tokens, width, device=device, dtype=dtype)
    adapter_bytes = sum(rank * (d_in + shape.dims(m)[1]) for m in modules) * dtype.itemsize
    touched = len(set(token_slots.tolist())) * adapter_bytes + (x.numel() + 2 * y.numel()) * dtype.itemsize
    return Case(pool, meta, batch, x, y, touched)


def measure(case: Case, modules: list[str], mode: str, cfg: KernelBenchConfig, copy: float,
            with_ref: bool = True) -> dict[str, Any]:
    device = case.x.device

    def step(fn: Callable[..., None] = lora_apply) -> None:
        fn(case.x, case.y, case.pool, case.meta, case.batch, 0, modules, mode)

    kernel_ms = graph_ms(step, cfg.reps, device)
    row = {"kernel_ms": kernel_ms, "eager_ms": _median_ms(step, cfg.reps, device),
           "bytes": case.bytes_touched, "GBps": case.bytes_touched / kernel_ms / 1e6}
    row["of_copy"] = row["GBps"] / copy
    if with_ref:
        row["ref_ms"] = _median_ms(lambda: step(lora_apply_ref), cfg.ref_reps, device)
        row["speedup_vs_ref"] = row["ref_ms"] / kernel_ms
    return row


def sweep(shape: ModelShape, modules: list[str], cfg: KernelBenchConfig, dtype: torch.dtype,
          device: torch.device, copy: float) -> list[dict[str, Any]]:
    """BGMV block sizes at the largest distinct batch, for each rank: which knobs reach the roofline."""
    rows = []
    tokens = max(cfg.ints("tokens"))
    for rank in cfg.ints("ranks"):
        case = build_case(shape, modules, rank, tokens, "distinct", "bgmv", dtype, device)
        grid = itertools.product((16, 64), (128, 256, 512), (64, 128, 256), (4, 8))
        for block_r, block_k, block_n, num_warps in grid:
            knobs = dict(block_r=block_r, block_k=block_k, block_n=block_n, num_warps=num_warps)
            with tuned("bgmv", **knobs):
                row = measure(case, modules, "bgmv", cfg, copy, with_ref=False)
            rows.append({"rank": rank, "tokens": tokens, **knobs, **row})
            print(f"sweep rank {rank} {knobs}: {row['kernel_ms'] * 1e3:.1f} us, {row['of_copy']:.2f} of copy",
                  flush=True)
    return rows


# -- the run -----------------------------------------------------------------------------------------------
def run(cfg: KernelBenchConfig) -> dict[str, Any]:
    device = torch.device("cpu" if cfg.smoke or not torch.cuda.is_available() else "cuda")
    shape, modules, dtype = resolve_model(cfg.model), cfg.names("modules"), getattr(torch, cfg.dtype)
    copy = copy_gbps(device, cfg.copy_mib, cfg.reps)
    rows = []
    for mode, rank, mix, tokens in itertools.product(cfg.names("modes"), cfg.ints("ranks"), cfg.names("mixes"),
                                                     cfg.ints("tokens")):
        case = build_case(shape, modules, rank, tokens, mix, mode, dtype, device)
        rows.append({"mode": mode, "rank": rank, "mix": mix, "tokens": tokens,
                     **measure(case, modules, mode, cfg, copy)})
        print(_line(rows[-1]), flush=True)
        del case
    large = [r["of_copy"] for r in rows if r["mix"] == "distinct" and r["tokens"] >= 64]
    return {"config": dataclasses.asdict(cfg), "device": _device_name(device), "torch": torch.__version__,
            "triton": _triton_version(), "shape": dataclasses.asdict(shape), "copy_GBps": copy, "goal": GOAL,
            "best_of_copy_distinct_T>=64": max(large, default=None), "rows": rows,
            "sweep": sweep(shape, modules, cfg, dtype, device, copy) if cfg.sweep else []}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def _line(r: dict[str, Any]) -> str:
    return (f"| {r['mode']} | {r['rank']} | {r['mix']} | {r['tokens']} | {r['kernel_ms'] * 1e3:.1f} | "
            f"{r['eager_ms'] * 1e3:.1f} | {r['GBps']:.0f} | {r['of_copy']:.2f} | {r['ref_ms'] * 1e3:.0f} | "
            f"{r['speedup_vs_ref']:.1f}x |")


def table(result: dict[str, Any]) -> str:
    head = (f"LoRA kernels on {result['device']} ({result['shape']['name']}, {result['config']['dtype']}, "
            f"{result['config']['modules']}); copy bandwidth {result['copy_GBps']:.0f} GB/s, goal {GOAL} of it\n\n"
            "| kernel | rank | mix | tokens | graph us | eager us | GB/s | of copy | ref us | vs ref |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    return "\n".join([head, *(_line(r) for r in result["rows"])])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, KernelBenchConfig)
    parser.add_argument("--out", type=Path, required=True, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    cfg = config_from_args(KernelBenchConfig, args)
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, **{k: v for k, v in SMOKE.items() if getattr(args, k) is None})
    result = run(cfg)
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
