"""What an engine reads of one TP rank's cache (``EngineCache``): a worker actor's own ``WorkerCache`` (the hosted
reference engine) or an engine process's ``Attachment`` (``attachment.py``, the public seam) both satisfy it,
so the reference engine runs on the public calls alone, and what it gets an integrator's engine gets too."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from lora_cache.adapters.catalog import AdapterCatalog
from lora_cache.errors import LoraCacheError, ResolveTimeoutError
from lora_cache.vocab import AdapterKey, ReadinessRecord
from workers.cache import WorkerConfig
from workers.gpu.acquire import AdapterRef, Batch

RESOLVE_WAIT_S = 30.0  # ``resolve_here``'s default: the whole wait for a name registered on demand to reach a rank


class EngineCache(Protocol):
    """The calls (lifecycle step 9) and the slot tensors an engine's kernels read."""

    @property
    def catalog(self) -> AdapterCatalog: ...
    @property
    def worker(self) -> WorkerConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def streams(self) -> Any: ...
    @property
    def pool(self) -> torch.Tensor: ...
    @property
    def meta(self) -> Any: ...

    def shard(self, slot: int) -> torch.Tensor: ...
    def acquire(self, adapters: Sequence[AdapterRef], *, partial: bool = False, pipelined: bool = False,
                slot_wait_s: float = 0.0) -> Batch: ...
    def acquire_ready(self, adapters: Sequence[AdapterRef]) -> Batch | None: ...
    def release(self, batch: Batch) -> None: ...
    def prefetch(self, name: str, version: str | None = None) -> Future[ReadinessRecord]: ...
    def ready_keys(self, fence: bool = False) -> set[AdapterKey]: ...
    def unfence(self) -> None: ...
    def issued_keys(self) -> set[AdapterKey]: ...
    def issued_copies(self) -> dict[AdapterKey, tuple[int, float, int]]: ...
    def stats(self) -> dict[str, object]: ...
    def residency(self) -> list[dict[str, object]]: ...
    def check_integrity(self) -> None: ...


def resolve_here(catalog: AdapterCatalog, name: str, ask: Callable[[str, float], str], timeout_s: float,
                 where: str) -> str:
    """The version of ``name`` in this rank's ``catalog``; if it lacks the name, ``ask`` the controller to register
    it on demand (``ask(name, timeout_s)``: request-time resolution, its typed refusals raised as they come:
    ``NotFoundError``, ``CapacityError``, ``ResolveTimeoutError``, or the adapter's own error), then wait until the
    controller's registration call has reached this rank. Within ``timeout_s`` in all; ``where`` names the rank."""
    if name in catalog:
        return catalog.get(name).version
    deadline = time.monotonic() + timeout_s
    version = ask(name, timeout_s)
    while not (name in catalog and version in catalog.versions(name)):
        if time.monotonic() > deadline:
            raise ResolveTimeoutError(f"adapter {name!r} was registered on demand as version {version}, but it did "
                                      f"not reach {where} within {timeout_s:g} s; check `lora-cache status` (a rank "
                                      "restarting)")
        time.sleep(0.01)  # the controller's registration call to this rank is on its way
    return version


def refusal(error: LoraCacheError, context: str) -> LoraCacheError:
    """``error`` (a resolution's refusal, maybe a Ray task error that is also one) as its own lora-cache class, its
    message after ``context``: the caller's typed error survives the wrapping."""
    cause = getattr(error, "cause", None)  # a RayTaskError's: the refusal itself, without the remote traceback
    if isinstance(cause, LoraCacheError):
        error = cause
    ours = LoraCacheError.__module__
    cls = next(c for c in type(error).__mro__ if issubclass(c, LoraCacheError) and c.__module__ == ours)
    return cls(f"{context}: {error}")
