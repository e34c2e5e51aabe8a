"""Requests and a synthetic request stream (Poisson arrivals, uniform or Zipf adapter popularity)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lora_cache.errors import ConfigError


@dataclass(frozen=True)
class WorkloadConfig:
    """A synthetic request stream: arrivals, lengths and adapter popularity."""

    requests: int = field(default=32, metadata={"help": "number of requests"})
    rate: float = field(default=0.0, metadata={"help": "Poisson arrival rate in requests/s (0: all at once)"})
    input_len: int = field(default=128, metadata={"help": "prompt tokens (the maximum when len_jitter > 0)"})
    output_len: int = field(default=32, metadata={"help": "output tokens (the maximum when len_jitter > 0)"})
    len_jitter: float = field(default=0.0, metadata={"help": "lengths uniform in [len * (1 - jitter), len]"})
    popularity: str = field(default="uniform", metadata={"help": "adapter choice: uniform or zipf"})
    zipf_alpha: float = field(default=1.5, metadata={"help": "Zipf exponent of adapter popularity"})
    base_fraction: float = field(default=0.0, metadata={"help": "fraction of requests with no adapter"})
    workload_seed: int = field(default=0, metadata={"help": "seed of arrivals, lengths and adapter choice"})

    def __post_init__(self) -> None:
        for name in ("requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rate < 0:
            raise ConfigError(f"rate must be >= 0 requests/s (0 sends every request at once), got {self.rate}")
        if not 0 <= self.len_jitter < 1:
            raise ConfigError(f"len_jitter must be in [0, 1), got {self.len_jitter}")
        if self.popularity not in ("uniform", "zipf"):
            raise ConfigError(f"popularity must be uniform or zipf, got {self.popularity!r}")
        if self.zipf_alpha <= 0:
            raise ConfigError(f"zipf_alpha must be > 0, got {self.zipf_alpha}")
        if not 0 <= self.base_fraction <= 1:
            raise ConfigError(f"base_fraction must be in [0, 1], got {self.base_fraction}")


class Request(NamedTuple):
    """One request: its adapter (None: the base model), lengths in tokens, arrival in seconds from start."""

    rid: int
    adapter: str | None
    input_len: int
    output_len: int
    arrival_s: float = 0.0


def make_requests(config: WorkloadConfig, adapters: Sequence[str]) -> list[Request]:
    """``config.requests`` requests over ``adapters`` (adapter i has Zipf weight 1 / (i + 1) ** alpha)."""
    if not adapters:
        raise ConfigError("a workload needs at least one adapter; register adapters first")
    rng = random.Random(config.workload_seed)
    weights = [1.0 if config.popularity == "uniform" else 1 / (i + 1) ** config.zipf_alpha
               for i in range(len(adapters))]
    t, out = 0.0, []
    for rid in range(config.requests):
        if config.rate > 0 and rid:
            t += rng.expovariate(config.rate)
        adapter = None if rng.random() < config.base_fraction else rng.choices(adapters, weights)[0]
        out.append(Request(rid, adapter, _length(rng, config.input_len, config.len_jitter),
                           _length(rng, config.output_len, config.len_jitter), t))
    return out


def _length(rng: random.Random, top: int, jitter: float) -> int:
    return max(1, round(rng.uniform(top * (1 - jitter), top)))
