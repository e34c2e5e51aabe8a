"""Model shapes: which LoRA target modules exist and their (in, out) sizes.

A shape comes from the named table below or from a Hugging Face ``config.json`` (``--model PATH``).
Sharding facts (which module is column- or row-parallel) are a table too, used by ``shards.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from lora_cache.errors import ConfigError


class Parallel(Enum):
    COLUMN = "column"  # output features split across TP ranks
    ROW = "row"  # input features split across TP ranks


# module -> (parent block in the PEFT key, how the base layer is split under TP)
MODULES: dict[str, tuple[str, Parallel]] = {
    "q_proj": ("self_attn", Parallel.COLUMN),
    "k_proj": ("self_attn", Parallel.COLUMN),
    "v_proj": ("self_attn", Parallel.COLUMN),
    "o_proj": ("self_attn", Parallel.ROW),
    "gate_proj": ("mlp", Parallel.COLUMN),
    "up_proj": ("mlp", Parallel.COLUMN),
    "down_proj": ("mlp", Parallel.ROW),
}
MODULE_ORDER: tuple[str, ...] = tuple(MODULES)


SHAPE_LIMITS = {  # bounds on a shape's sizes: validation walks every layer, slots are sized from the rest
    "num_layers": 1024, "hidden_size": 1 << 18, "intermediate_size": 1 << 20, "num_heads": 1 << 14,
    "num_kv_heads": 1 << 14, "head_dim": 1 << 14}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide LoRA tensor shapes."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field, most in SHAPE_LIMITS.items():
            value = getattr(self, field)
            if type(value) is not int or not 0 < value <= most:
                raise ConfigError(f"model shape {str(self.name)[:80]!r}: {field} must be a positive integer (at most "
                                  f"{most}), got {repr(value)[:80]}; is this a decoder-only transformer's config?")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model shape {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module's base linear layer."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        table = {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in table:
            raise ConfigError(f"model {self.name!r} has no LoRA target module {module!r}; known: {MODULE_ORDER}")
        return table[module]


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128),
        ModelShape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128),
        ModelShape("qwen2.5-7b", 28, 3584, 18944, 28, 4, 128),
        ModelShape("tiny", 2, 64, 128, 4, 2, 16),
    )
}

DEFAULT_MODEL = "tiny"
"""What ``make-adapters`` makes and ``demo`` runs when ``--model`` is left out. ``serve`` and ``inspect`` have
no default of their own: they take the adapters' ``base_model_name_or_path`` (``base_model.py``)."""


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (or a directory holding one) into a ModelShape."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        if path.stat().st_size > MAX_MODEL_CONFIG_BYTES:
            raise ConfigError(f"model config {path} is over {MAX_MODEL_CONFIG_BYTES} bytes; is it a config.json?")
        cfg = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"model config {path} does not exist; pass a named shape {sorted(SHAPES)} "
                          "or the base model's config.json") from e
    except (ValueError, RecursionError, OSError) as e:  # bad JSON or UTF-8, nesting too deep, unreadable
        raise ConfigError(f"model config {path} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); pass "
                          "the base model's config.json") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {path} holds a JSON {type(cfg).__name__}, not an object; pass the base "
                          "model's config.json")
    missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
               if k not in cfg]
    if missing:
        raise ConfigError(f"model config {path} lacks {missing}; is it a decoder-only transformer's config.json?")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or (hidden // heads if type(hidden) is int and type(heads) is int and heads > 0
                                       else 0)
    return ModelShape(
        name=str(cfg.get("_name_or_path") or path.parent.name or "hf-model")[:256],
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
    )


MAX_MODEL_CONFIG_BYTES = 1 << 20


def is_model_path(spec: str) -> bool:
    """Whether a model option names a file or directory (a config.json) rather than a named shape."""
    return bool(spec) and spec.lower() not in SHAPES and (spec.endswith(".json") or Path(spec).expanduser().is_dir())


def resolve_model(spec: str | ModelShape) -> ModelShape:
    """A named shape (``llama-3.1-8b``) or a path to a Hugging Face config.json / model directory."""
    if isinstance(spec, ModelShape):
        return spec
    if not spec:
        raise ConfigError(f"no base model given: pass --model with one of {sorted(SHAPES)} or the path of the base "
                          "model's config.json")
    if spec.lower() in SHAPES:
        return SHAPES[spec.lower()]
    if spec.endswith(".json") or Path(spec).is_dir():
        return from_hf_config(spec)
    raise ConfigError(f"unknown model {spec!r}: use one of {sorted(SHAPES)} or a path to the base model's config.json")
