"""``lora-cache serve``'s checks before Ray starts: what a user typed, proven usable in well under a second.

Each failure is a ``UsageError`` naming the option, the value and the fix; ``cli.main`` prints it and
exits 2. Without these, each surfaced seconds later from inside Ray (an actor's constructor, the gateway
after the replicas started) as a traceback. Checked, in order: directories (``--adapters``,
``--adapter-roots``), the base model, the sizes (one slot's shard fits ``--host-bytes``), the gateway's
port and files (``--token-file``, TLS: their own checks run when ``GatewayConfig`` is built).
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import torch

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.passes import pass_nice, pass_threads
from lora_cache.adapters.shapes import resolve_model
from lora_cache.adapters.shards import max_shard_numel
from lora_cache.api.gateway import GatewayConfig
from lora_cache.errors import ConfigError
from workers.cache import WorkerConfig
from workers.control.outbox import linger_env


class UsageError(ConfigError):
    """An option's value cannot work; nothing was started."""


def check_directory(option: str, value: str, what: str) -> None:
    """``value`` is an existing directory; a URL (``s3://...``: an object store) is checked where it is read."""
    if "://" in value:
        return
    path = Path(value)
    if not path.exists():
        raise UsageError(f"{option} {value}: no such directory; give {what} (or create it)")
    if not path.is_dir():
        raise UsageError(f"{option} {value}: not a directory; give {what}")


def check_environment() -> None:
    """The settings ``serve``'s processes read from the environment: ``LORA_CACHE_PUSH_THREADS`` and
    ``LORA_CACHE_PUSH_NICE`` (the pool a push's passes use in the controller, which inherits them), and
    ``LORA_CACHE_OUTBOX_LINGER_S`` (a worker's residency reports, ``workers.control.outbox``), refused here rather than
    at the first push or a worker's start."""
    pass_threads()
    pass_nice()
    linger_env()


def check_adapters(adapters: str, catalog: CatalogConfig) -> None:
    if adapters:
        check_directory(
            "--adapters",
            adapters,
            "the directory whose subdirectories are adapters (each with "
            "adapter_config.json), e.g. one made by `lora-cache make-adapters`",
        )
    for root in catalog.adapter_roots:
        check_directory("--adapter-roots", root, "directories the service may read adapters from")


def slot_bytes(catalog: CatalogConfig, worker: WorkerConfig, tp: int) -> int:
    """One GPU slot's (and so one staged shard's) bytes at most: the largest rank's shard on one TP rank."""
    dtype: torch.dtype = getattr(torch, worker.dtype)
    return max_shard_numel(resolve_model(catalog.model), tp, catalog.max_rank, dtype) * dtype.itemsize


def check_sizes(catalog: CatalogConfig, worker: WorkerConfig, tp: int) -> None:
    need = slot_bytes(catalog, worker, tp)
    host = worker.host.sized(tp)  # --host-bytes 0 (auto): this host's share, as a worker will resolve it
    if host.host_bytes < need:
        given = f"--host-bytes 0 (auto: {host.host_bytes})" if worker.host.auto else f"--host-bytes {host.host_bytes}"
        raise UsageError(
            f"{given} ({host.host_bytes / 2**20:.1f} MiB) cannot "
            f"hold one slot: a rank-{catalog.max_rank} shard of {catalog.model} at TP {tp} takes "
            f"{need} bytes ({need / 2**20:.1f} MiB); raise --host-bytes to at least {need}, or lower "
            "--max-rank, or raise --tp"
        )


def check_port(gateway: GatewayConfig) -> None:
    """The gateway's port is free now (0: any port is; the gateway still reports one taken in between)."""
    if gateway.grpc_port == 0:
        return
    family = socket.AF_INET6 if ":" in gateway.grpc_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a closing socket is no conflict
        try:
            probe.bind((gateway.grpc_host.strip("[]"), gateway.grpc_port))
        except OSError as e:
            why = "it is taken" if e.errno == errno.EADDRINUSE else (e.strerror or str(e)).lower()
            raise UsageError(
                f"--grpc-port {gateway.grpc_port} on --grpc-host {gateway.grpc_host}: {why}; choose "
                "another --grpc-port (0: any free port) or stop what listens there"
            ) from e
