"""The engine seam: an engine's own worker process attaches one TP rank of a replica to lora-cache.

    from lora_cache import attach
    rank = attach(AttachConfig(replica="replica-0"), WorkerConfig(tp=2, tp_rank=k, num_slots=8),
                  CatalogConfig(model="llama-3.1-8b", max_rank=64))
    batch = rank.acquire(adapters_of_the_batch)   # slots; the compute stream waits on loads in flight
    ... LoRA kernels over rank.pool / rank.meta, indexed by batch.slot_index ...
    rank.release(batch)                           # after the step's kernels are enqueued
    rank.report_queue([(adapter, arrival), ...])  # rank 0, when its waiting queue changes (never blocks)
    rank.detach()

The process keeps its own CUDA context: the rank's ``WorkerCache`` (slot pool, host tier, loader) is
built in it, so the engine's kernels read the slots directly. The controller reaches the rank through a
small *endpoint* actor that the process creates under the rank's worker name (``lora-cache-worker:R:k``),
the name by which the controller finds and adopts ``lora-cache serve``'s worker actors. A Ray driver or
actor cannot receive calls, so the endpoint relays them: each controller call (apply, describe, ...) is
queued there, the process's serve thread long-polls the queue (``take``), runs the calls in order on
``WorkerControl`` (the same code the worker actor forwards to) and answers them. Residency deltas and
queue reports go straight from the process to the controller (``Outbox``, ``QueueSender``).

The endpoint is *not* detached: Ray kills it when the process that created it (its owner) dies, so a
killed engine process is a dead worker to the controller's health check, and what the rank held is
dropped from the replica's readiness, as for any worker. ``detach`` kills it on purpose. A process that
attaches again under the same name is a new incarnation: the controller takes the new endpoint and its
(empty) report, replays the adapter registrations and plans again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from lora_cache.catalog import AdapterCatalog, CatalogConfig
from lora_cache.cluster import connect
from lora_cache.control import WorkerId
from lora_cache.controller import CONTROLLER_NAME, NAMESPACE, worker_name
from lora_cache.errors import ConfigError, ConflictError, LoraCacheError, NotFoundError
from workers.cache import Batch, WorkerCache, WorkerConfig
from workers.control import WorkerControl
from workers.loader import ReadinessRecord
from workers.outbox import Outbox, QueueSender

log = logging.getLogger(__name__)

RELAYED = ("apply", "describe", "register_adapter", "unregister_adapter", "stats")  # what the controller calls


@dataclass(frozen=True)
class AttachConfig:
    """Which replica an engine process's rank joins (its rank and TP size are in ``WorkerConfig``), where
    the Ray cluster is, and how the rank talks to the controller."""

    replica: str = field(default="", metadata={"help": "the replica this rank belongs to (e.g. replica-0)"})
    address: str = field(default="auto", metadata={"help": "Ray cluster to join when this process is not in one "
                                                           "yet ('auto' or host:port)"})
    flush_s: float = field(default=0.005, metadata={"help": "gather residency deltas this long per push"})
    poll_s: float = field(default=1.0, metadata={"help": "the serve thread's long poll for controller calls"})
    liveness_s: float = field(default=5.0, metadata={"help": "the endpoint fails the controller's ping when the "
                                                             "process has not polled for this long"})
    name_wait_s: float = field(default=30.0, metadata={"help": "wait this long for a dead predecessor's name"})
    start_s: float = field(default=60.0, metadata={"help": "the endpoint waits this long for the process's first "
                                                       "poll (a loaded host can be slow to start its serve thread)"})
    max_call_s: float = field(default=300.0, metadata={"help": "a controller call still running after this long "
                                                             "no longer keeps the process alive (a wedged call)"})

    def __post_init__(self) -> None:
        if not self.replica or ":" in self.replica or "/" in self.replica:
            raise ConfigError(f"replica {self.replica!r} must be a non-empty name without ':' or '/', e.g. replica-0")
        if not self.address:
            raise ConfigError("address is empty: an attached rank joins the cluster where the controller runs "
                              "('auto', or the head's host:port); it never starts a Ray of its own")
        if not 0 < self.poll_s < self.liveness_s:
            raise ConfigError(f"poll_s ({self.poll_s}) must be > 0 and below liveness_s ({self.liveness_s}): "
                              "the endpoint counts a process that has not polled for liveness_s as dead")
        if self.start_s < self.liveness_s:
            raise ConfigError(f"start_s ({self.start_s}) must be >= liveness_s ({self.liveness_s}): the first poll "
                              "gets at least the time any later one does")
        if self.max_call_s < self.liveness_s:
            raise ConfigError(f"max_call_s ({self.max_call_s}) must be >= liveness_s ({self.liveness_s}): a call may "
                              "run at least as long as an idle process may go without polling")
        if self.flush_s <= 0 or self.name_wait_s < 0:
            raise ConfigError(f"flush_s ({self.flush_s}) must be > 0 and name_wait_s ({self.name_wait_s}) >= 0")


def controller_handle() -> Any:
    """The service's controller on this Ray cluster, found by its name."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError as e:
        raise NotFoundError(f"no lora-cache controller ({CONTROLLER_NAME!r} in namespace {NAMESPACE!r}) on this Ray "
                            "cluster; start one first (`lora-cache serve --replicas 0` for a fleet of attached "
                            "engines)") from e


class EndpointStaleError(LoraCacheError, ConnectionError):
    """The attached process behind an endpoint stopped polling for calls."""


Call = tuple[int, str, tuple[Any, ...]]  # (call id, method, arguments)


class Relay:
    """Calls queued for a process that polls for them, and their answers: the endpoint's core, plain asyncio
    (one event loop, so the queue and the waiting calls need no lock). ``clock``: monotonic seconds."""

    def __init__(self, name: str, liveness_s: float, clock: Callable[[], float] = time.monotonic,
                 start_s: float | None = None) -> None:
        self.name, self.liveness_s, self.clock = name, liveness_s, clock
        self._calls: asyncio.Queue[Call] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # call id -> its caller's answer
        self._ids = itertools.count()
        self.start_s = liveness_s if start_s is None else start_s  # the grace before the process's first poll
        self._created = clock()
        self._polled: float | None = None  # the process's last sign of life (take or answer); None: none yet

    async def call(self, method: str, *args: Any) -> Any:
        """Queue the call for the process and wait for its answer; fail it (``EndpointStaleError``) once the
        process has not polled for ``liveness_s``, so that no caller (the controller's health loop
        resyncs through here) waits forever on a wedged process."""
        ident = next(self._ids)
        answer = self._waiting[ident] = asyncio.get_running_loop().create_future()
        self._calls.put_nowait((ident, method, args))
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(answer), self.liveness_s)
                except asyncio.TimeoutError:
                    self.check_live()
        finally:
            self._waiting.pop(ident, None)

    def check_live(self) -> None:
        if self._polled is None:
            idle = self.clock() - self._created
            if idle > self.start_s:
                raise EndpointStaleError(f"{self.name}: its engine process has not polled for calls for {idle:.1f} s "
                                         "since the endpoint was made (it never started serving)")
            return
        idle = self.clock() - self._polled
        if idle > self.liveness_s:
            raise EndpointStaleError(f"{self.name}: its engine process has not polled for calls for {idle:.1f} s")

    async def take(self, timeout_s: float) -> list[Call]:
        """The calls queued for the process, oldest first; waits up to ``timeout_s`` for the first."""
        self._polled = self.clock()
        try:
            first = await asyncio.wait_for(self._calls.get(), timeout_s)
        except asyncio.TimeoutError:
            return []
        calls = [first]
        while not self._calls.empty():
            calls.append(self._calls.get_nowait())
        self._polled = self.clock()
        return calls

    def answer(self, results: list[tuple[int, bool, Any]]) -> int:
        """(call id, ok, value or exception) for calls taken earlier; how many still had a caller."""
        self._polled = self.clock()  # it is alive: it answers
        delivered = 0
        for ident, ok, value in results:
            waiter = self._waiting.get(ident)
            if waiter is None or waiter.done():
                continue  # its caller gave up (stale, or cancelled by a timeout of its own)
            if ok:
                waiter.set_result(value)
            else:
                waiter.set_exception(value)
            delivered += 1
        return delivered


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class Endpoint:
    """The controller's handle on an attached rank, under the rank's worker name: the calls the controller
    makes on a worker actor, relayed to the process (``Relay``), which takes them with ``take`` and
    answers with ``answer``. ``ping`` is answered here, while the process keeps polling."""

    def __init__(self, name: str, liveness_s: float, start_s: float | None = None) -> None:
        self.relay = Relay(name, liveness_s, start_s=start_s)

    async def apply(self, commands: list[Any]) -> Any:
        return await self.relay.call("apply", commands)

    async def describe(self) -> Any:
        return await self.relay.call("describe")

    async def register_adapter(self, name: str, path: str) -> Any:
        return await self.relay.call("register_adapter", name, path)

    async def unregister_adapter(self, name: str) -> Any:
        return await self.relay.call("unregister_adapter", name)

    async def stats(self) -> Any:
        return await self.relay.call("stats")

    async def ping(self) -> bool:
        self.relay.check_live()
        return True

    async def take(self, timeout_s: float) -> list[Call]:
        return await self.relay.take(timeout_s)

    async def answer(self, results: list[tuple[int, bool, Any]]) -> int:
        return self.relay.answer(results)


class Attachment:
    """One attached rank: its cache (``acquire`` / ``release`` / slot tensors for the engine's kernels),
    the endpoint the controller calls, and the thread that serves those calls. Build it with ``attach``."""

    def __init__(self, config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig,
                 compute_stream: Any = None, on_ready: Callable[[ReadinessRecord], None] | None = None) -> None:
        self.config, self.worker = config, worker
        self.wid = WorkerId(config.replica, worker.tp_rank)
        self.name = worker_name(self.wid)
        self.catalog = AdapterCatalog(catalog)
        self.outbox = Outbox(self.name, config.flush_s)
        self.cache = WorkerCache(worker, self.catalog, on_ready=on_ready, compute_stream=compute_stream,
                                 on_change=self.outbox.push)
        self.control = WorkerControl(config.replica, self.catalog, self.cache, self.outbox)
        self.node = ray.get_runtime_context().get_node_id()
        self.calls = self.errors = 0  # controller calls served, and those that raised
        self.lost: BaseException | None = None  # why the serve thread stopped before detach, if it did
        self._detached = threading.Event()
        self._controller: Any = None
        self.endpoint: Any = None
        self._queue = QueueSender(self._send_queue)
        self._serving = threading.Thread(target=self._serve, name=f"lora-attach-{self.wid}", daemon=True)
        self._running_since: float | None = None  # monotonic start of the controller call being run, if any
        self._beating = threading.Thread(target=self._heartbeat, name=f"lora-attach-beat-{self.wid}", daemon=True)

    # -- the engine's calls (lifecycle step 9) ------------------------------------------------------
    @property
    def pool(self) -> torch.Tensor:
        """``[num_slots, slot_numel]``: every slot's packed shard (layout: ``cache.layout_of``)."""
        return self.cache.pool

    @property
    def meta(self) -> Any:
        """``SlotMeta``: per-slot offsets, ranks and scalings, written on the copy stream with each load."""
        return self.cache.meta

    def acquire(self, adapters: Sequence[str]) -> Batch:
        """Slots for the batch's adapters (a miss loads on demand); no host sync. Release it after the step."""
        return self.cache.acquire(adapters)

    def acquire_ready(self, adapters: Sequence[str]) -> Batch | None:
        """Pin those of ``adapters`` READY here (no load started): what a scheduler admits against."""
        return self.cache.acquire_ready(adapters)

    def release(self, batch: Batch) -> None:
        self.cache.release(batch)

    def ready_names(self) -> set[str]:
        return self.cache.ready_names()

    def report_queue(self, entries: list[tuple[str, float]]) -> None:
        """The replica's waiting queue, (adapter, arrival time.time()) in queue order (lifecycle step 1):
        handed to a sender thread, the latest replacing one not yet sent; never blocks."""
        self._queue.push(entries)

    # -- serving the controller (step 4) ------------------------------------------------------------
    def _start(self) -> None:
        self.endpoint = self._create_endpoint()
        self._serving.start()
        self._beating.start()
        # a refusal (ConfigError, ConflictError) arrives as a RayTaskError that is also an instance of it
        ray.get(self._controller_handle().worker_started.remote(self.name, self.outbox.incarnation, True),
                timeout=120)

    def _create_endpoint(self) -> Any:
        deadline = time.monotonic() + self.config.name_wait_s
        while True:
            try:
                return Endpoint.options(name=self.name, namespace=NAMESPACE, max_concurrency=1000).remote(
                    self.name, self.config.liveness_s, self.config.start_s)
            except ValueError as e:  # the name is taken: a live rank, or a dead one Ray has not released yet
                if time.monotonic() > deadline:
                    raise ConflictError(f"rank {self.wid.rank} of replica {self.wid.replica!r} is already attached "
                                        f"({self.name} exists: a live engine process or a `lora-cache serve` worker "
                                        "holds it); detach it, or attach as another replica or rank") from e
                time.sleep(0.2)

    def _controller_handle(self) -> Any:
        if self._controller is None:
            self._controller = controller_handle()
        return self._controller

    def _serve(self) -> None:
        """Long-poll the endpoint, run its calls in order, answer; until detach or the endpoint is gone."""
        handlers: dict[str, Callable[..., Any]] = {
            "apply": self.control.apply, "describe": lambda: self.control.describe(self.node),
            "register_adapter": self.control.register_adapter,
            "unregister_adapter": self.control.unregister_adapter, "stats": self.control.stats}
        assert set(handlers) == set(RELAYED)
        while not self._detached.is_set():
            try:
                calls = ray.get(self.endpoint.take.remote(self.config.poll_s), timeout=self.config.poll_s + 60)
            except Exception as e:  # the endpoint was killed (detach) or died: the controller sees a dead worker
                if not self._detached.is_set():
                    log.warning("%s: endpoint lost (%s); this rank no longer receives commands", self.name, e)
                    self.lost = e
                return
            for call in calls:  # each answered as it finishes: a batch of slow calls (registering many
                self.endpoint.answer.remote([self._run(handlers, call)])  # adapters) is not a silent process

    def _heartbeat(self) -> None:
        """While a controller call runs (a registration hashing a large adapter, a describe of thousands of
        slots), tell the endpoint the process is alive every ``poll_s``; not when idle (then not polling is
        the sign of a dead serve thread) and not past ``max_call_s`` into one call (a wedged call)."""
        while not self._detached.wait(self.config.poll_s):
            since = self._running_since
            if since is not None and time.monotonic() - since < self.config.max_call_s:
                try:
                    self.endpoint.answer.remote([])  # an empty answer: only a sign of life
                except Exception:  # the endpoint is gone: the serve thread notices and stops
                    return

    def _run(self, handlers: dict[str, Callable[..., Any]], call: Call) -> tuple[int, bool, Any]:
        ident, method, args = call
        self.calls += 1
        self._running_since = time.monotonic()
        try:
            return ident, True, handlers[method](*args)
        except Exception as e:  # the controller's call fails with it, as a worker actor's would
            self.errors += 1
            return ident, False, e
        finally:
            self._running_since = None

    def _send_queue(self, entries: list[tuple[str, float]]) -> None:
        ray.get(self._controller_handle().report_queue.remote(self.config.replica, entries), timeout=30)

    # -- leaving --------------------------------------------------------------------------------------
    def detach(self) -> None:
        """Leave the replica: the controller drops what this rank held (the replica is ready for nothing
        until a process attaches as this rank again); then the cache is closed. Idempotent."""
        if self._detached.is_set():
            return
        self._detached.set()
        self._queue.close()
        self.outbox.close()  # no delta after the controller has dropped the rank
        if self.endpoint is not None:
            try:
                ray.get(self._controller_handle().worker_detached.remote(self.name, self.outbox.incarnation),
                        timeout=30)
            except Exception as e:  # no controller: its health check drops the rank once the endpoint is gone
                log.info("%s: the controller did not hear of the detach (%s)", self.name, e)
            ray.kill(self.endpoint, no_restart=True)
        if self._serving.is_alive():
            self._serving.join(timeout=self.config.poll_s + 60)
        if self._beating.is_alive():
            self._beating.join(timeout=self.config.poll_s + 5)
        self.cache.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def attach(config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig | None = None,
           compute_stream: Any = None, on_ready: Callable[[ReadinessRecord], None] | None = None) -> Attachment:
    """Attach this process as rank ``worker.tp_rank`` (of ``worker.tp``) of replica ``config.replica``.

    Call it in the engine's worker process, after the process has its device (``worker.device``: the
    engine's, e.g. ``cuda:0``; ``compute_stream``: the stream its LoRA kernels run on, default the
    current one; ``on_ready``: called with each load's timings). ``catalog``: by default the
    controller's (model shape, largest rank, adapter roots), which the rank must share. Joins the Ray cluster at
    ``config.address`` unless the process is in one already (an engine's own Ray executor); the
    controller must be running there. Returns once the controller has adopted the rank (its registered
    adapters replayed here); raises ``NotFoundError`` without a controller, ``ConflictError`` if the
    rank is attached already, ``ConfigError`` if the replica exists with another TP size or slot
    count, or the model differs from the controller's."""
    if not ray.is_initialized():
        connect(config.address, NAMESPACE)
    if catalog is None:
        catalog = ray.get(controller_handle().catalog_config.remote(), timeout=60)
    attachment = Attachment(config, worker, catalog, compute_stream, on_ready)
    try:
        attachment._start()
    except BaseException:
        attachment.detach()
        raise
    return attachment
