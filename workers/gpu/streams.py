"""Named streams and events behind one small interface, so the worker runs the same code on CPU.

``CudaStreams``: a dedicated ``copy_stream`` for slot loads beside the engine's ``compute_stream``;
loads wait for a slot's ``last_use`` event on the GPU (lifecycle step 6), never on the host.
``CpuStreams``: the same calls on the CPU. By default copies are synchronous and every event is complete
when recorded; ``deferred=True`` models the copy stream: copies queue in issue order and run only when
the compute side waits on one of their events (``compute_wait``) or a test drains them (``run_copies``),
so a read that skipped its wait sees the slot's old bytes, as on a GPU. ``trace`` (off unless set)
logs copy-stream waits, chunk copies, compute events and compute waits in issue order, for tests of the
ordering invariants (chunk events, last-use events: invariant 2).

A load is issued as layer-ordered chunks (``lora_cache.adapters.chunks``): ``copy_chunk`` once per chunk, the
first one after the slot's ``last_use`` event, each recording its own event on ``copy_stream``. With exclusive tiers
an evicted slot's shard is copied out first (``copy_back``, on ``back_stream``: PCIe runs both directions at once), in
pieces with an event each, and each chunk of the load into that slot waits only for the pieces of the range it
overwrites (``SlotLoad.place``'s ``vacate``). A shard taken from a pushed image on the device (``workers.reads.device``)
is one ``copy_chunk`` whose source is a function that fills the slot on the copy stream (its gather), not a tensor.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from lora_cache.errors import ConfigError


def fill_or_copy(dst: torch.Tensor, src: torch.Tensor | Callable[[torch.Tensor], None]) -> None:
    """``src(dst)`` if ``src`` is a function that fills ``dst`` (a pushed image's read), else ``dst.copy_(src)``
    (non-blocking: a chunk from pinned memory)."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    else:
        src(dst)


class HostEvent:
    """An 'event' of the CPU backend: done once its copy ran; ``t`` is when (or when recorded, if no copy)."""

    __slots__ = ("done", "label", "t")

    def __init__(self, label: object = None, done: bool = True) -> None:
        self.t, self.label, self.done = time.perf_counter(), label, done


TRACE_LEN = 4096  # ops a trace keeps (the oldest drop first)


class CpuStreams:
    """CPU stand-in with the same calls as CudaStreams; see the module docstring for ``deferred``."""

    device: torch.device

    def __init__(self, device: torch.device, deferred: bool = False) -> None:
        self.device, self.deferred = device, deferred
        self._lock = threading.Lock()  # protects _queue (copies issued from reader threads, run by waiters)
        self._queue: deque[tuple[Callable[[], None], HostEvent]] = deque()  # deferred copies, issue order
        self.trace: deque[tuple[Any, ...]] | None = None  # set to a deque to log ops (tests)

    def copy_chunk(self, dst: torch.Tensor, src: torch.Tensor | Callable[[torch.Tensor], None], after: Any = None,
                   then: Callable[[Any], None] | None = None, label: object = None,
                   timed: bool = True) -> tuple[Any, Any]:
        """On the copy stream: wait for ``after`` (a slot's last use; or a tuple of events: also the write-back of the
        range it overwrites), copy ``src`` into ``dst`` (or call ``src(dst)``: a function that fills it, issuing its
        work on the current stream, the copy stream), then
        ``then(copy_stream)`` (e.g. the slot's kernel metadata: its host work overlaps the copy); returns
        (start, done) events (``timed`` False: no start event, None; a load times its copies from its first
        chunk's start)."""
        start, end = HostEvent(), HostEvent(label, done=not self.deferred)

        def run() -> None:
            fill_or_copy(dst, src)
            if then is not None:
                then(None)
            end.t, end.done = time.perf_counter(), True

        with self._lock:
            self._log("copy", label, after, end)
            if self.deferred:
                self._queue.append((run, end))
                return start, end
        run()
        return start, end

    def copy_back(self, dst: torch.Tensor, src: torch.Tensor, label: object = None) -> Any:
        """On the write-back stream (here: the one deferred queue, in issue order): copy ``src`` (a slot) into ``dst``
        (the host); returns its event (exclusive tiers: ``LoadPath.vacate``)."""
        return self.copy_chunk(dst, src, label=label, timed=False)[1]

    def run_copies(self, until: Any = None) -> None:
        """Deferred mode: run queued copies in order, up to ``until`` (all of them if None)."""
        while True:
            with self._lock:
                if not self._queue or (until is not None and until.done):
                    return
                run, _ = self._queue.popleft()
            run()

    def record_compute(self, label: object = None) -> Any:
        event = HostEvent(label)
        with self._lock:
            self._log("compute", label, event)
        return event

    def compute_wait(self, event: Any) -> None:
        with self._lock:
            self._log("compute_wait", event)
        if self.deferred:
            self.run_copies(until=event)

    def done(self, event: Any) -> bool:
        return bool(event.done)

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` completed: only off the hot path (a failed load's cleanup)."""
        self.run_copies(until=event)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end.t - start.t) * 1e3

    def upload(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        dev.copy_(host)

    def _log(self, *op: Any) -> None:
        if self.trace is not None:
            self.trace.append(op)


class CudaStreams(CpuStreams):
    """A named copy stream beside the engine's compute stream; all ordering is done on the GPU."""

    def __init__(self, device: torch.device, compute_stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(device, deferred=False)
        self.copy_stream = torch.cuda.Stream(device)
        self.back_stream = torch.cuda.Stream(device)  # write-backs: device-to-host, beside the loads' copies in
        self.compute_stream = compute_stream or torch.cuda.current_stream(device)

    def copy_chunk(self, dst: torch.Tensor, src: torch.Tensor | Callable[[torch.Tensor], None], after: Any = None,
                   then: Callable[[Any], None] | None = None, label: object = None,
                   timed: bool = True) -> tuple[Any, Any]:
        ready = torch.cuda.Event(enable_timing=True)
        start = torch.cuda.Event(enable_timing=True) if timed else None
        with torch.cuda.stream(self.copy_stream):
            for event in after if isinstance(after, tuple) else (after,):
                if event is not None:  # the previous adapter's last batch, or its write-back, done with this range
                    self.copy_stream.wait_event(event)
            if start is not None:
                start.record(self.copy_stream)
            fill_or_copy(dst, src)  # one H2D copy of a chunk of the packed shard, from pinned memory (or a gather)
            if then is not None:  # e.g. the slot's kernel metadata (its host side overlaps the copy just issued):
                then(self.copy_stream)  # valid once the first chunk's event is, as it is queued before that event
            ready.record(self.copy_stream)
        return start, ready

    def copy_back(self, dst: torch.Tensor, src: torch.Tensor, label: object = None) -> Any:
        """On ``back_stream``: PCIe carries it beside the copies in, and a load into the slot waits only for the part
        it overwrites (``SlotLoad.place``'s ``vacate``)."""
        done = torch.cuda.Event()
        with torch.cuda.stream(self.back_stream):
            dst.copy_(src, non_blocking=True)  # into the pinned arena
            done.record(self.back_stream)
        return done

    def record_compute(self, label: object = None) -> Any:
        event = torch.cuda.Event()
        event.record(self.compute_stream)
        return event

    def compute_wait(self, event: Any) -> None:
        self.compute_stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def host_wait(self, event: Any) -> None:
        event.synchronize()

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
