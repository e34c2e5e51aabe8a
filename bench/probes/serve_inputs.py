"""The Ray Serve probe's inputs (``bench.probes.ray_serve``): its options checked, its adapters, its workload.

A split of ``ray_serve.py`` along its seam: everything here is decided before Ray starts (a bad option is a
ConfigError naming the option, its value and the fix; the adapter directory written or reused; the open-loop
arrivals), and the same under both routings; ``ray_serve.py`` runs the app, the service and the measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEVICES = ("cpu", "cuda")
GPU_ENGINE: dict[str, Any] = dict(  # the reference engine on a GPU (EngineConfig's defaults otherwise)
    device="cuda",
    dtype="bfloat16",
    cuda_graphs=True,
    # one set of random base weights for every layer (as bench.run --engine real): the same math and bytes read
    # per layer, a fraction of the build time and memory
    share_weights=True,
    max_running=32,
    max_prefill_tokens=4096,
    max_seq_len=2048,
)


def ranks(args: argparse.Namespace) -> list[int]:
    return [int(r) for r in args.adapter_ranks.split(",")]


def max_rank(args: argparse.Namespace) -> int:
    return max(ranks(args))


def dtype(args: argparse.Namespace) -> str:
    return "bfloat16" if args.device == "cuda" else "float32"


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``examples.ray_serve_lora.engine_config``'s overrides: the same slots per replica under both routings."""
    gpu = GPU_ENGINE if args.device == "cuda" else {}
    return {
        **gpu,
        "model": args.model,
        "num_slots": args.slots,
        "max_adapters": min(4, args.slots),
        "max_rank": max_rank(args),
        **json.loads(args.engine),
    }


def check(args: argparse.Namespace) -> None:
    """Every option checked before anything starts (Ray, adapters): a ConfigError naming the option, its value
    and the fix."""
    from examples.ray_serve_lora import engine_config
    from lora_cache.adapters.shapes import resolve_model
    from lora_cache.errors import ConfigError

    if args.device not in DEVICES:
        raise ConfigError(f"--device {args.device!r} is not a device of this probe; use one of {', '.join(DEVICES)}")
    try:
        resolve_model(args.model)
    except ConfigError as e:
        raise ConfigError(f"--model {args.model!r}: {e}") from None
    try:
        got = ranks(args)
    except ValueError:
        got = []
    if not got or min(got) < 1:
        raise ConfigError(f"--adapter-ranks {args.adapter_ranks!r}: give LoRA ranks >= 1, comma-separated (16,64)")
    for name in ("replicas", "slots", "adapters", "requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.adapters < args.replicas:
        raise ConfigError(
            f"--adapters {args.adapters} is fewer than --replicas {args.replicas} (each replica is "
            "warmed up with an adapter of its own); raise --adapters"
        )
    if args.rate <= 0 or args.host_mib < 0:
        raise ConfigError(f"--rate ({args.rate}) must be > 0 and --host-mib ({args.host_mib}) >= 0")
    for name in ("engine", "router"):
        try:
            value = json.loads(getattr(args, name))
        except ValueError as e:
            raise ConfigError(
                f"--{name} {getattr(args, name)!r} is not JSON ({e}); give an object, e.g. '{{}}'"
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"--{name} {getattr(args, name)!r}: give a JSON object of settings, e.g. '{{}}'")
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.replicas:
            raise ConfigError(
                f"--device cuda with --replicas {args.replicas} needs {args.replicas} GPUs (one a "
                f"replica), this machine has {gpus}; lower --replicas or use --device cpu"
            )
    try:
        engine = engine_config(**engine_overrides(args))
    except TypeError as e:  # an unknown --engine field
        raise ConfigError(
            f"--engine {args.engine!r}: {e}; name EngineConfig fields (workers/engine/config.py)"
        ) from None
    if args.input_len + args.output_len > engine.max_seq_len:
        raise ConfigError(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the engine's "
            f"max_seq_len ({engine.max_seq_len}); shorten them or pass --engine "
            "'{\"max_seq_len\": N}'"
        )


def adapters_for(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The adapter directory and the workload's names. The tiny model without ``--adapter-dir``: a fresh temporary
    directory. Otherwise ``bench.run``'s (``--adapter-dir``, or ``$TMPDIR/lora-cache-bench-adapters-MODEL``):
    ``adapter-NNN``, the missing ones written, those there reused."""
    if args.model == "tiny" and not args.adapter_dir:
        from lora_cache.adapters.synth import SynthConfig, make_adapters

        root = tempfile.mkdtemp(prefix="serve-bench-")
        make_adapters(root, SynthConfig(model="tiny", count=args.adapters, rank=args.adapter_ranks))
        return root, sorted(d.name for d in Path(root).iterdir())
    from bench.run import ensure_adapters

    default = Path(os.environ.get("TMPDIR") or "/tmp") / f"lora-cache-bench-adapters-{args.model}"
    width = max(3, len(str(args.adapters - 1)))  # bench.workloads' names
    names = [f"adapter-{i:0{width}d}" for i in range(args.adapters)]
    where = Path(args.adapter_dir) if args.adapter_dir else default
    t0 = time.perf_counter()
    workers = max(1, min(16, (os.cpu_count() or 1) // 2, len(names)))  # an 8B adapter is seconds of one core
    if workers == 1:
        ensure_adapters(where, args.model, args.adapter_ranks, names)
    else:  # each adapter seeded by its name alone: the same bytes as one process would write
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        threads = max(1, (os.cpu_count() or 1) // workers)  # each writer's torch threads: no oversubscription
        with ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_writer_threads, initargs=(threads,)
        ) as pool:
            # runs of names starting at a multiple of the ranks' count: each name gets the rank one process gives it
            k = len(ranks(args))
            size = math.ceil(math.ceil(len(names) / workers) / k) * k
            parts = [names[i : i + size] for i in range(0, len(names), size)]
            futures = [pool.submit(ensure_adapters, where, args.model, args.adapter_ranks, part) for part in parts]
            for done, future in enumerate(as_completed(futures), 1):
                future.result()
                print(
                    f"adapters: {done} of {len(parts)} parts written ({time.perf_counter() - t0:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"adapters: {len(names)} under {where} ({time.perf_counter() - t0:.1f} s, {workers} processes)",
        file=sys.stderr,
        flush=True,
    )
    return str(where), names


def _writer_threads(threads: int) -> None:
    """An adapter-writing process's torch threads (the machine's cores shared among the writers)."""
    import torch

    torch.set_num_threads(threads)


def workload(adapters: list[str], requests: int, rate: float, alpha: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** alpha for i in range(len(adapters))]
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate)
        out.append((t, rng.choices(adapters, weights)[0]))
    return out
