"""Write real PEFT-layout adapters with random weights (``lora-cache make-adapters``)."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, peft_key
from lora_cache.adapters.shapes import DEFAULT_MODEL, MODULE_ORDER, ModelShape, resolve_model
from lora_cache.errors import ConfigError


@dataclass(frozen=True)
class SynthConfig:
    """How many adapters to write and of what shape."""

    model: str = field(default=DEFAULT_MODEL, metadata={
        "path": "name_or_file", "help": "named model shape or path to its config.json"})
    count: int = field(default=4, metadata={"help": "number of adapters"})
    rank: str = field(default="16", metadata={"help": "rank, or comma-separated ranks used in turn (mixed ranks)"})
    alpha: float = field(default=32.0, metadata={"help": "lora_alpha"})
    targets: str = field(default=",".join(MODULE_ORDER), metadata={"help": "comma-separated target modules"})
    dtype: str = field(default="bfloat16", metadata={"help": "float16, bfloat16 or float32"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    prefix: str = field(default="adapter", metadata={"help": "directory name prefix"})

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"count must be >= 1, got {self.count}")
        if not self.ranks() or min(self.ranks()) < 1:
            raise ConfigError(f"rank must be positive integers like '16' or '8,16,64', got {self.rank!r}")
        bad = [t for t in self.target_list() if t not in MODULE_ORDER]
        if bad:
            raise ConfigError(f"unknown target modules {bad}; choose from {list(MODULE_ORDER)}")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ConfigError(f"dtype must be float16, bfloat16 or float32, got {self.dtype!r}")

    def ranks(self) -> list[int]:
        try:
            return [int(r) for r in self.rank.split(",") if r.strip()]
        except ValueError as e:
            raise ConfigError(f"rank must be integers like '16' or '8,16,64', got {self.rank!r}") from e

    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]


def write_adapter(out: Path, shape: ModelShape, rank: int, alpha: float, targets: list[str],
                  dtype: torch.dtype, gen: torch.Generator) -> Path:
    """One adapter directory: adapter_config.json + adapter_model.safetensors, PEFT key names."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(shape.num_layers):
        for module in targets:
            d_in, d_out = shape.dims(module)
            a = torch.randn(rank, d_in, generator=gen) / d_in**0.5
            b = torch.randn(d_out, rank, generator=gen) / rank**0.5  # nonzero, so every slot's content is distinct
            tensors[peft_key(layer, module, "A")] = a.to(dtype)
            tensors[peft_key(layer, module, "B")] = b.to(dtype)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
              "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
              "task_type": "CAUSAL_LM", "base_model_name_or_path": shape.name}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def make_adapters(out: str | Path, config: SynthConfig) -> list[Path]:
    shape, ranks = resolve_model(config.model), config.ranks()
    gen = torch.Generator().manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    return [write_adapter(Path(out) / f"{config.prefix}-{i:03d}", shape, ranks[i % len(ranks)], config.alpha,
                          config.target_list(), dtype, gen) for i in range(config.count)]


def make_named_adapters(out: str | Path, config: SynthConfig, names: list[str], jobs: int = 1,
                        skip: Collection[str] = ()) -> list[Path]:
    """Adapters under ``out`` named ``names`` (whatever they are: a trace's own), ranks used in turn in the
    order given. Each adapter's weights are seeded by ``config.seed`` and its name alone, so making one
    again, or among other names, writes the same bytes (the same version). ``skip``: names not written (those
    made already), each still counted in the ranks' turn, so a catalog completed in parts holds the ranks a whole
    one does. ``jobs`` > 1: written by that many processes (an 8B catalog of 100 adapters: ~2 minutes in one
    process), each adapter the same bytes. Returns the paths written."""
    if jobs < 1:
        raise ConfigError(f"jobs is {jobs}; give 1 or more processes")
    work = [(str(out), config, i, name) for i, name in enumerate(names) if name not in skip]
    if not work:
        return []
    if jobs == 1 or len(work) < 2:
        return [_write_named(*w) for w in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the parent may hold torch's threads (fork would copy their locks mid-use)
    threads = max(1, (os.cpu_count() or 1) // jobs)  # torch's threads in each: oversubscribed, they crawl
    with ProcessPoolExecutor(min(jobs, len(work)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        return list(pool.map(_write_named, *zip(*work)))


def _write_named(out: str, config: SynthConfig, index: int, name: str) -> Path:
    """``make_named_adapters``' ``index``-th adapter (module level: a process pool calls it)."""
    shape, ranks = resolve_model(config.model), config.ranks()
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + zlib.crc32(name.encode()))
    return write_adapter(Path(out) / name, shape, ranks[index % len(ranks)], config.alpha, config.target_list(),
                         getattr(torch, config.dtype), gen)
