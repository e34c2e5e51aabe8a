"""Named streams and events behind one small interface, so the worker runs the same code on CPU.

``CudaStreams``: a dedicated ``copy_stream`` for slot loads beside the engine's ``compute_stream``;
loads wait for a slot's ``last_use`` event on the GPU (lifecycle step 6), never on the host.
``CpuStreams``: copies are synchronous and every event is complete when recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from lora_cache.errors import ConfigError


class HostEvent:
    """A completed 'event' for the CPU backend: it only remembers when it was recorded."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.perf_counter()


class CpuStreams:
    """Synchronous stand-in: same calls as CudaStreams, no streams."""

    device: torch.device

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy_into_slot(self, dst: torch.Tensor, src: torch.Tensor, after: Any,
                       then: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
        """Copy ``src`` into the slot ``dst``; ``then(copy_stream)`` runs next, before the ready event."""
        start = HostEvent()
        dst.copy_(src)
        if then is not None:
            then(None)
        return start, HostEvent()

    def record_compute(self) -> Any:
        return HostEvent()

    def compute_wait(self, event: Any) -> None:
        return None

    def done(self, event: Any) -> bool:
        return True

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end.t - start.t) * 1e3

    def upload(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        dev.copy_(host)


class CudaStreams(CpuStreams):
    """A named copy stream beside the engine's compute stream; all ordering is done on the GPU."""

    def __init__(self, device: torch.device, compute_stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.compute_stream = compute_stream or torch.cuda.current_stream(device)

    def copy_into_slot(self, dst: torch.Tensor, src: torch.Tensor, after: Any,
                       then: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            if after is not None:  # the previous adapter's last batch must be done with this slot
                self.copy_stream.wait_event(after)
            start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)  # one H2D copy of the packed shard, from pinned memory
            if then is not None:  # e.g. the slot's kernel metadata: valid exactly when the slot is
                then(self.copy_stream)
            ready.record(self.copy_stream)
        return start, ready

    def record_compute(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.compute_stream)
        return event

    def compute_wait(self, event: Any) -> None:
        self.compute_stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def upload(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        with torch.cuda.stream(self.compute_stream):
            dev.copy_(host, non_blocking=True)


BACKENDS: dict[str, Callable[..., CpuStreams]] = {"cpu": CpuStreams, "cuda": CudaStreams}


def make_streams(device: torch.device, compute_stream: Any = None) -> CpuStreams:
    if device.type == "cuda":
        return CudaStreams(device, compute_stream)
    return BACKENDS[device.type](device)


def resolve_device(name: str) -> torch.device:
    """``auto`` is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:  # torch's own parse error: not a LoraCacheError, so the CLI would die on it
        raise ConfigError(f"device {name!r} is not a device name; use cpu, cuda, cuda:N or auto") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but this machine has no CUDA GPU; use --device cpu or auto")
    if device.type not in BACKENDS:
        raise ConfigError(f"device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return device
