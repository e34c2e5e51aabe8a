"""The engine's one frozen config (options of ``python -m workers.engine`` are generated from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lora_cache.adapters.shapes import ModelShape, resolve_model
from lora_cache.errors import ConfigError
from workers.engine.admission import ADMISSION
from workers.staging.host_config import HostTierConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """One replica: its model shape, TP size, batching bounds, admission rule and cache."""

    adapters: str = field(default="", metadata={
        "path": True, "help": "directory of PEFT adapter directories (name = dir name)"})
    model: str = field(default="llama-3.1-8b", metadata={
        "path": "name_or_file", "help": "named model shape or path to its config.json"})
    num_layers: int = field(default=0, metadata={"help": "layers to run (0: all of the model's)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel size (one process per rank)"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda (rank k on cuda:k) or auto"})
    dtype: str = field(default="auto", metadata={"help": "compute and slot dtype (auto: bfloat16 on cuda, "
                                                         "float32 on cpu)"})
    num_slots: int = field(default=8, metadata={"help": "GPU adapter slots per rank"})
    page_rank: int = field(default=0, metadata={"help": "GPU pages sized for this LoRA rank (0: one page per slot); "
                                                        "see WorkerConfig"})
    pool_pages: int = field(default=0, metadata={"help": "GPU pages per rank (0: num_slots adapters of max_rank)"})
    chunk_bytes: int = field(default=4 << 20, metadata={
        "help": "least bytes of a load's layer-ordered chunks (0: a chunk per layer); see WorkerConfig"})
    max_rank: int = field(default=64, metadata={"help": "largest LoRA rank served (sizes the slots)"})
    max_running: int = field(default=32, metadata={"help": "most requests running (prefilled, decoding) at once"})
    kv_rows: int = field(default=0, metadata={
        "help": "KV rows kept in the adapter pool's pages, lent at start (0: the engine's own KV cache of "
                "max_running rows); past them, up to max_running, rows borrowed from the pool's idle pages as the "
                "batch grows and given back when it shrinks (workers/engine/kv_rows.py)"})
    kv_return_s: float = field(default=1.0, metadata={
        "help": "borrowed KV rows unused this long go back to the adapter pool"})
    max_adapters: int = field(default=4, metadata={"help": "most distinct adapters among running requests"})
    max_prefill_tokens: int = field(default=4096, metadata={"help": "prompt tokens per prefill step"})
    max_seq_len: int = field(default=2048, metadata={"help": "longest input + output of a request (KV rows)"})
    admission: str = field(default="ondemand", metadata={"help": f"admission rule: {'|'.join(ADMISSION)}"})
    rope: bool = field(default=True, metadata={"help": "rotary position embeddings on q and k"})
    rope_theta: float = field(default=500000.0, metadata={"help": "RoPE base"})
    share_weights: bool = field(default=False, metadata={"help": "one set of base weights for every layer"})
    seed: int = field(default=0, metadata={"help": "seed of base weights and prompts"})
    record_outputs: bool = field(default=False, metadata={"help": "keep each token's output hidden state "
                                                                  "(a device-to-host copy per step)"})
    cuda_graphs: bool = field(default=True, metadata={"help": "replay decode steps as CUDA graphs (GPU only; "
                                                              "captured at warm-up, one per batch and KV bucket)"})
    audit_steps: bool = field(default=False, metadata={"help": "log, per step and rank, the adapter version of "
                                                               "every item and a digest of its slot's bytes "
                                                               "(tests; a device-to-host copy per adapter)"})
    graph_kv_block: int = field(default=512, metadata={"help": "KV-length bucket of the decode graphs (keys)"})
    agree_timeout_s: float = field(default=60.0, metadata={
        "help": "a waiting request whose adapter's TP ranks agree on no version (a registration that reached some "
                "ranks only) this long fails alone (0: waits for ever)"})
    host: HostTierConfig = field(default_factory=HostTierConfig)

    def __post_init__(self) -> None:
        for name in ("tp", "num_slots", "max_rank", "max_running", "max_adapters", "max_prefill_tokens",
                     "graph_kv_block"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2 (one prompt and one output token), got {self.max_seq_len}")
        if not 0 <= self.kv_rows <= self.max_running:
            raise ConfigError(f"kv_rows must be within 0..max_running ({self.max_running}), got {self.kv_rows}; "
                              "0 keeps max_running rows of the engine's own (nothing borrowed)")
        if self.kv_return_s < 0:
            raise ConfigError(f"kv_return_s must be >= 0, got {self.kv_return_s}")
        if self.agree_timeout_s < 0:
            raise ConfigError(f"agree_timeout_s must be >= 0 (0: no limit), got {self.agree_timeout_s}")
        if self.chunk_bytes < 0:
            raise ConfigError(f"chunk_bytes must be >= 0 (0: a chunk per layer), got {self.chunk_bytes}")
        if self.max_adapters > self.num_slots:
            raise ConfigError(f"max_adapters ({self.max_adapters}) must not exceed num_slots ({self.num_slots}): "
                              "a batch's adapters must all fit in the slots; lower max_adapters or add slots")
        if self.admission not in ADMISSION:
            raise ConfigError(f"admission {self.admission!r} is not a registered rule; use one of {sorted(ADMISSION)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self._check_shape(self.shape())
        self._check_device()

    def _check_shape(self, shape: ModelShape) -> None:
        if not 0 <= self.num_layers <= shape.num_layers:
            raise ConfigError(f"num_layers ({self.num_layers}) must be in 0..{shape.num_layers} for {shape.name} "
                              "(0 runs every layer)")
        for what, size in (("num_heads", shape.num_heads), ("num_kv_heads", shape.num_kv_heads),
                           ("intermediate_size", shape.intermediate_size)):
            if size % self.tp:
                raise ConfigError(f"tp ({self.tp}) must divide {shape.name}'s {what} ({size}); "
                                  f"use a TP size that divides {size}")
        if self.rope and shape.head_dim % 2:
            raise ConfigError(f"rope needs an even head_dim, {shape.name} has {shape.head_dim}; pass --no-rope")

    def _check_device(self) -> None:
        kind = self.device.split(":")[0]
        if kind not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if ":" in self.device:
            raise ConfigError(f"device {self.device!r}: name the kind only (cuda); rank k runs on cuda:k")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if kind == "cuda" and gpus < self.tp:
            raise ConfigError(f"device cuda with tp {self.tp} needs {self.tp} GPUs, this machine has {gpus}; "
                              "lower --tp or use --device cpu")

    def shape(self) -> ModelShape:
        return resolve_model(self.model)

    @property
    def layers(self) -> int:
        return self.num_layers or self.shape().num_layers

    def device_kind(self) -> str:
        """cpu or cuda: ``auto`` takes the GPUs when there are enough for every rank."""
        if self.device != "auto":
            return self.device
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "cuda" if gpus >= self.tp else "cpu"

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device_kind() == "cuda" else torch.float32
        return getattr(torch, self.dtype)
