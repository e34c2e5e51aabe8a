"""LoRA kernel measurements (issue 5): decode-shape bandwidth vs a device copy, time vs the torch reference,
and the wrappers' Python cost per call.

    python -m bench.probes.kernels --out FILE [--model llama-3.1-8b] [--tokens 1,16,64,128,256] [--ranks 16,64]
                            [--mixes identical,distinct,uniform8,zipf] [--modes bgmv] [--knobs reduce=0,block_k=64]
                            [--sweep] [--only-overhead]
    python -m bench.probes.kernels --smoke --out FILE     # tiny shapes on the CPU: the script runs end to end

For each (mode, rank, adapter mix, tokens): one layer's fused q/k/v LoRA of the model shape in bf16, each
adapter in its own slot of a pool, one ``lora_apply`` per step. Mixes: ``identical`` (one adapter),
``distinct`` (one per token), ``uniformN`` (N adapters, uniform), ``zipf``/``zipfN`` (N adapters, 16 if
not given, Zipf 1.5). Time per call comes from CUDA-graph replays (what a decode engine runs; launch
overhead excluded) and eagerly. Bytes that must move = A and B of every *distinct* adapter of the batch
(once, however many tokens share it) + x read + y read and written; bandwidth = bytes / time, as a
fraction of a device-to-device copy of the same number of bytes timed the same way in the same run
(``of_copy``; goal >= 0.7 at decode batches) and of a 1 GiB copy (``of_peak``).

Overhead: at the engine's decode shape (32 tokens on 4 adapters, q/k/v, rank 64) the Python cost of one
call: ``wrapper_us`` with the Triton launches replaced by no-ops (**launch stubbed**: the wrapper alone),
``full_check_us`` for validating every argument (what each call paid before launch plans were cached),
and on a GPU ``call_us`` with the real launches (CPU time to enqueue a call, no sync).
``--sweep`` also tries every combination of ``--sweep-grid`` BGMV knobs at each shape. Prints markdown, writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from lora_cache.adapters.peft import AdapterConfig, AdapterSpec, LoraModule
from lora_cache.adapters.shapes import MODULE_ORDER, ModelShape, resolve_model
from lora_cache.adapters.shards import shard_layout
from lora_cache.runtime.cliargs import add_config_args, config_from_args
from workers.kernels import BatchMeta, SlotMeta, lora_apply, lora_apply_ref, shard_dims
from workers.kernels.args import check_launch
from workers.kernels.tuning import tuned

GOAL = 0.7  # fraction of the copy bandwidth the decode kernels should reach at decode batches


@dataclass(frozen=True)
class KernelBenchConfig:
    model: str = field(default="llama-3.1-8b", metadata={
        "path": "name_or_file", "help": "named model shape or config.json"})
    tokens: str = field(default="1,16,64,128,256", metadata={"help": "decode batch sizes"})
    ranks: str = field(default="16,64", metadata={"help": "LoRA ranks"})
    mixes: str = field(default="identical,distinct,uniform8,zipf",
                       metadata={"help": "identical, distinct, uniformN (N adapters), zipf or zipfN (Zipf 1.5)"})
    modes: str = field(default="bgmv", metadata={"help": "kernels: bgmv (decode) and/or sgmv (prefill)"})
    modules: str = field(default="q_proj,k_proj,v_proj", metadata={"help": "fused modules of one call"})
    dtype: str = field(default="bfloat16", metadata={"help": "pool and activation dtype"})
    reps: int = field(default=30, metadata={"help": "timed repetitions (graph replays of 10 calls each)"})
    ref_reps: int = field(default=3, metadata={"help": "timed repetitions of the torch reference"})
    copy_mib: int = field(default=1024, metadata={"help": "size of the device copy measured for the peak"})
    knobs: str = field(default="", metadata={"help": "BGMV knobs for the whole run, e.g. reduce=0,block_k=64"})
    sweep: bool = field(default=False, metadata={"help": "also try the BGMV knobs of --sweep-grid at every shape"})
    sweep_grid: str = field(default="block_k=128,256,512;num_warps=4,8;waves=4,8",
                            metadata={"help": "BGMV knob values to combine: NAME=V1,V2;NAME=..."})
    only_overhead: bool = field(default=False, metadata={"help": "measure only the wrappers' Python cost"})
    paged: bool = field(default=False, metadata={
        "help": "the worker's paged pool (issue 43): one flat buffer read through a row stride of 0, each adapter's "
                "offsets from its pages' start, the adapters in a shuffled order of pages"})
    smoke: bool = field(default=False, metadata={"help": "tiny shapes on the CPU (checks the script runs)"})

    def ints(self, name: str) -> list[int]:
        return [int(v) for v in getattr(self, name).split(",") if v.strip()]

    def names(self, name: str) -> list[str]:
        return [v.strip() for v in getattr(self, name).split(",") if v.strip()]


SMOKE: dict[str, Any] = dict(model="tiny", tokens="1,3", ranks="8", mixes="identical,distinct,uniform2,zipf4",
                             modes="bgmv,sgmv", dtype="float32", reps=2, ref_reps=1, copy_mib=4)


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


def graph_ms(step: Callable[[], object], reps: int, device: torch.device, inner: int = 10) -> float:
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
    """Device-to-device copy bandwidth (bytes read + written per second) of a large copy: the peak."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _median_ms(lambda: dst.copy_(src), max(reps, 5), device)
    return 2 * src.numel() / ms / 1e6


def copy_same_ms(nbytes: int, reps: int, device: torch.device) -> float:
    """Time of a device copy that reads and writes ``nbytes`` in all, from graph replays like the kernels."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src), reps, device)


# -- one measured case ---------------------------------------------------------------------------------------
class Case(NamedTuple):
    pool: torch.Tensor
    meta: SlotMeta
    batch: BatchMeta
    x: torch.Tensor
    y: torch.Tensor
    bytes_touched: int  # distinct adapters' A and B once + x + y read and written
    adapters: int  # distinct adapters of the batch


def mix_slots(mix: str, tokens: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(adapters, slot of each token) for a mix name; see the module docstring."""
    if mix == "identical":
        return 1, np.zeros(tokens, dtype=np.int64)
    if mix == "distinct":
        return tokens, rng.permutation(tokens)
    if mix.startswith("uniform"):
        n = int(mix.removeprefix("uniform"))
        return n, rng.integers(0, n, tokens)
    if mix.startswith("zipf"):
        n = int(mix.removeprefix("zipf") or 16)
        return n, np.minimum(rng.zipf(1.5, tokens), n) - 1
    raise ValueError(f"unknown mix {mix!r}: identical, distinct, uniformN, zipf or zipfN")


def build_case(shape: ModelShape, modules: list[str], rank: int, tokens: int, mix: str, mode: str,
               dtype: torch.dtype, device: torch.device, seed: int = 0, chunk: int | None = None,
               paged: bool = False) -> Case:
    """One layer's adapters, one per slot, and a batch of ``tokens`` using them as ``mix`` says; ``paged``: the
    pool as the worker lays out a paged one (``WorkerCache``: a flat buffer, row stride 0, absolute offsets)."""
    one_layer = dataclasses.replace(shape, num_layers=1)
    num_slots, token_slots = mix_slots(mix, tokens, np.random.default_rng(seed))
    spec = AdapterSpec("bench", Path("bench"), AdapterConfig(r=rank, lora_alpha=rank, target_modules=tuple(modules)),
                       tuple(LoraModule(0, m, rank, 1.0) for m in modules), str(dtype)[6:], "v0", 0)
    layout = shard_layout(spec, one_layer, 1, 0, dtype)
    pool = torch.randn(num_slots, layout.numel, device=device).to(dtype) * 0.05
    meta = SlotMeta(num_slots, 1, MODULE_ORDER, device, max_rank=rank, dims=shard_dims(one_layer, 1),
                    slot_numel=layout.numel)
    order = np.random.default_rng(seed + 1).permutation(num_slots) if paged else range(num_slots)
    for slot in range(num_slots):
        meta.write(slot, layout, spec, base=int(order[slot]) * layout.numel if paged else 0)
    if paged:
        pool = pool.reshape(-1).as_strided((num_slots, num_slots * layout.numel), (0, 1))
    batch = BatchMeta(tokens, tokens, device, num_slots=num_slots, chunk_tokens=chunk)
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
    adapters = len(set(token_slots.tolist()))
    touched = adapters * adapter_bytes + (x.numel() + 2 * y.numel()) * dtype.itemsize
    return Case(pool, meta, batch, x, y, touched, adapters)


def measure(case: Case, modules: list[str], mode: str, cfg: KernelBenchConfig, peak: float,
            with_ref: bool = True) -> dict[str, Any]:
    device = case.x.device

    def step(fn: Callable[..., None] = lora_apply) -> None:
        fn(case.x, case.y, case.pool, case.meta, case.batch, 0, modules, mode)

    kernel_ms = graph_ms(step, cfg.reps, device)
    copy_ms = copy_same_ms(case.bytes_touched, cfg.reps, device)
    row = {"adapters": case.adapters, "kernel_ms": kernel_ms, "eager_ms": _median_ms(step, cfg.reps, device),
           "bytes": case.bytes_touched, "GBps": case.bytes_touched / kernel_ms / 1e6, "copy_ms": copy_ms}
    row["of_copy"] = copy_ms / kernel_ms  # = kernel bandwidth / copy bandwidth, same bytes
    row["of_peak"] = row["GBps"] / peak
    if with_ref:
        row["ref_ms"] = _median_ms(lambda: step(lora_apply_ref), cfg.ref_reps, device)
        row["speedup_vs_ref"] = row["ref_ms"] / kernel_ms
    return row


def sweep_grid(spec: str) -> list[dict[str, int]]:
    """``"block_k=128,256;num_warps=4,8"`` -> every combination, as knob dicts for ``tuned("bgmv", ...)``."""
    axes = [(name.strip(), [int(v) for v in values.split(",")])
            for name, values in (part.split("=", 1) for part in spec.split(";") if part.strip())]
    return [dict(zip([a for a, _ in axes], combo)) for combo in itertools.product(*(v for _, v in axes))]


def sweep(shape: ModelShape, modules: list[str], cfg: KernelBenchConfig, dtype: torch.dtype,
          device: torch.device, peak: float) -> list[dict[str, Any]]:
    """BGMV knobs (``--sweep-grid``) at every (rank, mix, tokens >= 16) of the run; one case built per shape."""
    rows = []
    grid = sweep_grid(cfg.sweep_grid)
    for rank, mix, tokens in itertools.product(cfg.ints("ranks"), cfg.names("mixes"), cfg.ints("tokens")):
        if tokens < 16:
            continue
        case = build_case(shape, modules, rank, tokens, mix, "bgmv", dtype, device, paged=cfg.paged)
        for knobs in grid:
            try:
                with tuned("bgmv", **knobs):
                    row = measure(case, modules, "bgmv", cfg, peak, with_ref=False)
            except Exception as e:  # e.g. triton's OutOfResources: tiles too large for shared memory
                if type(e).__name__ != "OutOfResources":
                    raise
                rows.append({"rank": rank, "tokens": tokens, "mix": mix, **knobs, "error": str(e)})
                continue
            rows.append({"rank": rank, "tokens": tokens, "mix": mix, **knobs, **row})
            print(f"sweep rank {rank} {mix} T={tokens} {knobs}: {row['kernel_ms'] * 1e3:.1f} us, "
                  f"{row['of_copy']:.2f} of copy", flush=True)
        del case
    return rows


# -- the wrappers' Python cost per call ------------------------------------------------------------------------
class _NoLaunch:
    """Stands in for a @triton.jit kernel and for its compiled form: every launch does nothing."""

    def __init__(self, kernel: Any) -> None:
        self.fn = kernel.fn  # KernelCall reads the parameter names

    def __getitem__(self, grid: Any) -> Callable[..., _NoLaunch]:
        return self._launch

    def _launch(self, *args: Any, **kwargs: Any) -> _NoLaunch:
        return self  # "compiled": KernelCall keeps ``self[grid]`` as its direct launcher

    def run(self) -> None:
        raise AssertionError("not called: present so KernelCall takes this for a compiled kernel")


@contextlib.contextmanager
def stubbed_launches(meta: SlotMeta) -> Iterator[None]:
    """Every LoRA kernel replaced by a no-op (``meta``'s launch plans rebuilt around the stubs, then dropped):
    what remains of a call is the wrapper's own Python. For the overhead measurement only."""
    from workers.kernels import bgmv, sgmv

    names = [(bgmv, "_bgmv_shrink_kernel"), (bgmv, "_bgmv_expand_kernel"), (sgmv, "_sgmv_kernel")]
    saved = [getattr(module, name) for module, name in names]
    meta.plans.clear()
    try:
        for (module, name), kernel in zip(names, saved):
            setattr(module, name, _NoLaunch(kernel))
        yield
    finally:
        for (module, name), kernel in zip(names, saved):
            setattr(module, name, kernel)
        meta.plans.clear()


def per_call_us(fn: Callable[[], object], device: torch.device, calls: int = 1000, repeats: int = 5) -> float:
    """Host time per call of ``fn`` (best of ``repeats`` loops; on a GPU the work is only enqueued)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return best


def overhead(cfg: KernelBenchConfig, dtype: torch.dtype, device: torch.device) -> list[dict[str, Any]]:
    """Python cost of one call at the engine's decode shape (32 tokens, 4 adapters), per kernel."""
    from workers.kernels.lora import KERNELS

    shape, modules = resolve_model(cfg.model), tuple(cfg.names("modules"))
    tokens, rank = (3, max(cfg.ints("ranks"))) if cfg.smoke else (32, 64)
    rows = []
    for mode in cfg.names("modes"):
        case = build_case(shape, list(modules), rank, tokens, "uniform4", mode, dtype, device, paged=cfg.paged)
        args = (case.x, case.y, case.pool, case.meta, case.batch, 0, modules)
        kernel = KERNELS[mode]
        row: dict[str, Any] = {"mode": mode, "tokens": tokens, "rank": rank}
        if device.type == "cuda":
            lora_apply(*args)  # compile
            row["call_us"] = per_call_us(functools.partial(lora_apply, *args), device, calls=300)
        with stubbed_launches(case.meta):
            row["wrapper_us"] = per_call_us(functools.partial(kernel, *args), device)
        row["full_check_us"] = per_call_us(functools.partial(check_launch, *args), device)
        rows.append(row)
        print(f"overhead {mode}: wrapper {row['wrapper_us']:.1f} us/call (launch stubbed), full check "
              f"{row['full_check_us']:.1f} us" + (f", real call {row['call_us']:.1f} us" if "call_us" in row else ""),
              flush=True)
    return rows


# -- the run -----------------------------------------------------------------------------------------------
def run(cfg: KernelBenchConfig, progress: Path | None = None) -> dict[str, Any]:
    """Every measurement; ``progress``: rewrite the JSON there after each row (a killed run keeps its rows)."""
    device = torch.device("cpu" if cfg.smoke or not torch.cuda.is_available() else "cuda")
    shape, modules, dtype = resolve_model(cfg.model), cfg.names("modules"), getattr(torch, cfg.dtype)
    result: dict[str, Any] = {"config": dataclasses.asdict(cfg), "device": _device_name(device),
                              "torch": torch.__version__, "triton": _triton_version(),
                              "shape": dataclasses.asdict(shape), "goal": GOAL,
                              "overhead": overhead(cfg, dtype, device), "rows": [], "sweep": []}
    if cfg.only_overhead:
        return result
    peak = result["copy_GBps"] = copy_gbps(device, cfg.copy_mib, cfg.reps)
    rows = result["rows"]
    for mode, rank, mix, tokens in itertools.product(cfg.names("modes"), cfg.ints("ranks"), cfg.names("mixes"),
                                                     cfg.ints("tokens")):
        case = build_case(shape, modules, rank, tokens, mix, mode, dtype, device, paged=cfg.paged)
        rows.append({"mode": mode, "rank": rank, "mix": mix, "tokens": tokens,
                     **measure(case, modules, mode, cfg, peak)})
        print(_line(rows[-1]), flush=True)
        if progress is not None:
            progress.write_text(json.dumps(result, indent=2))
        del case
    for mix in cfg.names("mixes"):
        decode = [r["of_copy"] for r in rows if r["mix"] == mix and r["tokens"] >= 16]
        result[f"min_of_copy_{mix}_T>=16"] = min(decode, default=None)
    if cfg.sweep:
        result["sweep"] = sweep(shape, modules, cfg, dtype, device, peak)
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def _line(r: dict[str, Any]) -> str:
    return (f"| {r['mode']} | {r['rank']} | {r['mix']} | {r['tokens']} | {r['adapters']} | "
            f"{r['kernel_ms'] * 1e3:.1f} | {r['eager_ms'] * 1e3:.1f} | {r['ref_ms'] * 1e3:.0f} | "
            f"{r['speedup_vs_ref']:.1f}x | {r['bytes'] / 1e6:.2f} | {r['GBps']:.0f} | {r['copy_ms'] * 1e3:.1f} | "
            f"**{r['of_copy']:.2f}** | {r['of_peak']:.2f} |")


def table(result: dict[str, Any]) -> str:
    lines = [f"LoRA kernels on {result['device']} ({result['shape']['name']}, {result['config']['dtype']}, "
             f"{result['config']['modules']})", "",
             "| kernel | tokens | rank | wrapper us/call (launch stubbed) | full check us | real call us |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {o['mode']} | {o['tokens']} | {o['rank']} | {o['wrapper_us']:.1f} | {o['full_check_us']:.1f} | "
              f"{o.get('call_us', float('nan')):.1f} |" for o in result["overhead"]]
    if result["rows"]:
        lines += ["", f"Copy peak {result['copy_GBps']:.0f} GB/s; of copy = copy of the same bytes (graph-timed) / "
                  f"kernel time, goal {GOAL}", "",
                  "| kernel | rank | mix | tokens | adapters | graph us | eager us | ref us | vs ref | MB | GB/s | "
                  "copy us | of copy | of peak |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [_line(r) for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, KernelBenchConfig)
    parser.add_argument("--out", type=Path, required=True, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    cfg = config_from_args(KernelBenchConfig, args)
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, **{k: v for k, v in SMOKE.items() if getattr(args, k) is None})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    knobs = {k: int(v) for k, v in (kv.split("=") for kv in cfg.knobs.split(",") if kv)}
    with tuned("bgmv", **knobs):
        result = run(cfg, progress=args.out)
    print(table(result))
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
