"""The adapter catalog: names -> validated, versioned adapters under the configured roots."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from lora_cache.errors import AdapterFormatError, ConfigError, NotFoundError
from lora_cache.peft import AdapterSpec, read_adapter
from lora_cache.roots import AdapterRoots
from lora_cache.shapes import ModelShape, resolve_model

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class CatalogConfig:
    """Where adapters may come from and what they must fit."""

    adapter_roots: tuple[str, ...] = field(default=(), metadata={
        "path": True, "help": "directories adapters may be read from"})
    model: str = field(default="", metadata={"path": "name_or_file", "help": (
        "named model shape or path to its config.json (empty: the adapters' base_model_name_or_path)")})
    max_rank: int = field(default=64, metadata={"help": "largest LoRA rank served (sizes the GPU slots)"})

    def __post_init__(self) -> None:
        if not 1 <= self.max_rank <= 1024:
            raise ConfigError(f"max_rank must be in 1..1024, got {self.max_rank}; typical LoRA ranks are 8-128")

    def shape(self) -> ModelShape:
        return resolve_model(self.model)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise AdapterFormatError(f"adapter name {name!r} is invalid: use 1-128 characters of letters, digits, "
                                 "'.', '_' or '-', starting with a letter or digit")
    return name


class AdapterCatalog:
    """Registered adapters by name. Thread-safe; re-registering new content yields a new version."""

    def __init__(self, config: CatalogConfig, shape: ModelShape | None = None) -> None:
        self.config = config
        self.shape = shape or config.shape()
        self.roots = AdapterRoots(tuple(Path(r) for r in config.adapter_roots))
        self._lock = threading.Lock()  # protects _specs
        self._specs: dict[str, AdapterSpec] = {}

    def register(self, name: str, path: str | Path) -> AdapterSpec:
        """Validate the adapter at ``path`` (under a root) and make it the current version of ``name``."""
        directory = self.roots.resolve(path)
        spec = read_adapter(check_name(name), directory, self.shape, self.config.max_rank, self.roots)
        with self._lock:
            self._specs[name] = spec
        return spec

    def unregister(self, name: str) -> AdapterSpec:
        with self._lock:
            if name not in self._specs:
                raise NotFoundError(self._unknown(name))
            return self._specs.pop(name)

    def get(self, name: str, version: str | None = None) -> AdapterSpec:
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            raise NotFoundError(self._unknown(name))
        if version is not None and version != spec.version:
            raise NotFoundError(f"adapter {name!r} is at version {spec.version}, not {version}; "
                                "it was re-registered with new content: plan with the current version")
        return spec

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._specs)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._specs

    def __len__(self) -> int:
        with self._lock:
            return len(self._specs)

    def _unknown(self, name: str) -> str:
        return f"adapter {name!r} is not registered; register it first (lora-cache register NAME PATH)"

    def register_dir(self, parent: str | Path) -> list[AdapterSpec]:
        """Register every adapter directory directly under ``parent`` by its directory name."""
        base = self.roots.resolve(parent)
        return [self.register(d.name, d) for d in sorted(base.iterdir()) if (d / "adapter_config.json").is_file()]
