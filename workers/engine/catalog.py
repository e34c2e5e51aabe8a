"""The reference engine's catalog (lifecycle step 1): every adapter directory under ``--adapters``, registered by
its directory name, on the driver and then on each TP rank with the driver's versions (``load_catalog``)."""

from __future__ import annotations

from collections.abc import Mapping

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import KnownVersion
from lora_cache.errors import ConfigError
from workers.engine.config import EngineConfig


def load_catalog(config: EngineConfig, known: Mapping[str, KnownVersion] | None = None) -> AdapterCatalog:
    """Every adapter directory under ``config.adapters``, registered by its directory name. ``known``: the versions
    the driver's catalog found (``known_versions``), taken where this open proves the same file: a TP rank
    registering a file a moment after the driver must not version it otherwise (a file written just before is
    hashed by content while racy and versioned by its identity once settled: ranks on either side of that moment
    would agree on no version)."""
    if not config.adapters:
        raise ConfigError("adapters: no directory given; pass --adapters DIR (make some with "
                          f"`lora-cache make-adapters DIR --model {config.model}`)")
    catalog = AdapterCatalog(CatalogConfig(adapter_roots=(config.adapters,), model=config.model,
                                           max_rank=config.max_rank), config.shape())
    if not catalog.register_dir(config.adapters, known or {}):
        raise ConfigError(f"adapters: {config.adapters} holds no adapter directories (with adapter_config.json); "
                          f"make some with `lora-cache make-adapters {config.adapters} --model {config.model}`")
    return catalog


def known_versions(catalog: AdapterCatalog) -> dict[str, KnownVersion]:
    """Each registered name's version as ``catalog`` hashed it, for the ranks' ``load_catalog``."""
    return {name: known for name in catalog.names() if (known := catalog.known(name)) is not None}
