"""The worker as a Ray actor: a thin shell around WorkerCache + CommandGate, one per GPU (TP rank).

Every residency change of the cache, whether a command or the hosted engine made it (its on-demand
loads, the LRU evictions they cause), is pushed to the controller in batches by a flusher thread
(step 7); a full residency report is answered on demand (``describe``), which is how a restarted
controller rebuilds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import ray
import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.peft import KnownVersion
from lora_cache.adapters.pushed import PushArea
from lora_cache.errors import NotFoundError
from lora_cache.runtime import heap
from lora_cache.runtime.metrics import WorkerMetrics
from lora_cache.vocab import CONTROLLER_NAME, ApplyResult, Command, ReadinessRecord
from workers import faults
from workers.actor_engine import HostedEngineCalls
from workers.actor_images import ImagePushCalls
from workers.attach.ray_transport import resolve_at
from workers.cache import WorkerCache, WorkerConfig
from workers.control.doorbell import Doorbell
from workers.control.images import TrainerImages
from workers.control.node_copies import NodeCopies, fetch_payload
from workers.control.outbox import Outbox
from workers.control.rank import WorkerControl
from workers.engine.hosted import HostedEngine
from workers.gpu.copies import host_copy_ms
from workers.gpu.streams import resolve_device
from workers.reads.shard import read_shard

log = logging.getLogger(__name__)


def _resolve(name: str, timeout_s: float) -> str:
    """The controller of this worker's service (its namespace) registers ``name`` on demand: request-time resolution
    for the hosted engine's submits."""
    return resolve_at(ray.get_actor(CONTROLLER_NAME), name, timeout_s)


def _fetch_pushed(name: str, tag: str) -> tuple[bytes, np.ndarray]:
    """The bytes of a pushed version, from the controller's node memory (``Pushes.payload``)."""
    return fetch_payload(ray.get_actor(CONTROLLER_NAME), name, tag)


SUBMITS = 8  # a streaming run's submits taken at once: one resolving a new name (up to resolve_s) holds up no other


@ray.remote(max_restarts=-1, concurrency_groups={"engine": 1, "submit": SUBMITS, "feed": 1, "finished": 1,
                                                 "lifeline": 4})
class WorkerActor(HostedEngineCalls, ImagePushCalls):
    """Control calls (apply, describe, ...) run one at a time in the default group, in order; an engine
    hosted here (the benchmark's real path) runs its loop in the ``engine`` group beside them, takes a
    streaming run's requests in the ``submit`` group (up to ``SUBMITS`` at once: a submit that resolves a new name
    on demand does not hold up the others; before 2026-11-30 one at a time, so it did, up to ``resolve_s``), ends
    the stream in ``feed`` (after every submit begun before it: ``Feed.submitting``; a caller ends it once its
    submits returned, as a submit sent before the end may not have begun) and answers the long poll for
    finished ones in ``finished``. ``ping`` and the controller's ``lifeline`` (its death
    watch) run in ``lifeline`` (a lifeline left by a controller that restarted ends within its timeout)."""

    def __init__(self, name: str, replica: str, config: WorkerConfig, catalog: CatalogConfig,
                 flush_s: float = 0.005) -> None:
        self.name, self.replica, self.config = name, replica, config
        self.catalog = AdapterCatalog(catalog)
        device = resolve_device(config.device)
        compute = torch.cuda.Stream(device) if device.type == "cuda" else None  # a hosted engine's steps run here
        self.outbox = Outbox(name, flush_s)
        t0 = time.perf_counter()
        self.cache = WorkerCache(config, self.catalog, on_ready=self._loaded, compute_stream=compute,
                                 on_change=self.outbox.push,  # every change, whoever made it
                                 service=ray.get_runtime_context().namespace)  # the service's, its job's namespace
        self.cache_init_s = time.perf_counter() - t0  # slots, host arena (pinned), reader processes
        self.engine = HostedEngine(self.cache, resolve=_resolve)  # a new name under a root: registered on demand
        self.metrics = WorkerMetrics(replica, config.tp_rank, self.cache.stats)
        self.loads: deque[tuple[float, ReadinessRecord]] = deque(maxlen=4096)
        self.metrics.start()
        context = ray.get_runtime_context()
        copies = NodeCopies(PushArea(catalog.push_root(), context.namespace, catalog.push_bytes), context.get_node_id(),
                            _fetch_pushed)  # a pushed version in another node's memory: copied to this one
        self.control = WorkerControl(replica, self.catalog, self.cache, self.outbox, copies)
        self.images = TrainerImages(self.cache.device)  # trainers' push buffers open here (``load_image``)
        self.image_times: deque[tuple[float, list[tuple[str, float]], float, dict[str, float]]] = deque(maxlen=256)
        self.doorbell: Doorbell | None = None  # a trainer's pushes with no Ray call (``open_doorbell``)
        self._stopping = threading.Event()  # set at shutdown: the controller's lifeline returns
        # A restarted worker holds nothing: say so, so the controller forgets its predecessor. ValueError:
        # no controller yet (it adopts this worker from describe() when it starts).
        with contextlib.suppress(ValueError):
            controller = ray.get_actor(CONTROLLER_NAME)  # held: Ray < 2.48 loses a method call on a dropped handle
            controller.worker_started.remote(name, self.outbox.incarnation)
        heap.freeze()  # loads and reports are not stalled by full collections walking the built actor

    def unregister_adapter(self, name: str) -> bool:
        """Forget ``name`` (the controller drained it first); False if it was not registered here."""
        return self.control.unregister_adapter(name)

    def _loaded(self, record: ReadinessRecord) -> None:
        self.metrics.loaded(record.ready_ms, record.h2d_ms, record.host_hit)
        self.loads.append((time.time(), record))  # wall clock: comparable across a node's processes

    def load_log(self) -> list[tuple[float, ReadinessRecord]]:
        """(wall time READY, record) of this rank's recent loads, oldest first."""
        return list(self.loads)

    def copy_probe(self, nbytes: int, repeats: int = 5) -> float:
        """Median ms of a plain pinned-host -> device copy of ``nbytes`` on this worker's device: the
        reference a shard load is measured against, in the same process and run."""
        return host_copy_ms(self.cache.device, nbytes, repeats)

    def verify(self, name: str, version: str | None = None) -> dict[str, object]:
        """Compare the resident shard of ``name`` (its current version, or ``version``) with this rank's slices
        of that version's file: bytes and max |diff|."""
        layout = self.cache.layout_of(name, version)
        slot = next((r["slot"] for r in self.cache.residency()
                     if (r["adapter"], r["version"]) == (name, layout.version) and r["state"] == "ready"), None)
        if slot is None:
            raise NotFoundError(f"adapter {name}@{layout.version} is not READY on {self.name}; prefetch it first")
        staged = torch.empty(layout.numel, dtype=layout.dtype)
        read_shard(self.catalog.get(name, layout.version), layout, staged)
        resident = self.cache.shard(int(slot)).cpu()  # type: ignore[call-overload]
        worst = max(float((resident[e.offset:e.offset + e.numel].float()
                           - staged[e.offset:e.offset + e.numel].float()).abs().max()) for e in layout.entries)
        return {"adapter": name, "rank": self.config.tp_rank, "slot": slot, "nbytes": layout.nbytes,
                "entries": len(layout.entries), "max_abs_diff": worst}

    def arm_fault(self, point: str, adapter: str, gate: Any) -> None:
        """Stop the next load of ``adapter`` at fault ``point`` (``workers.faults``): it tells ``gate`` (a
        ``Gate`` actor) it arrived, then waits for the gate's release. For tests that kill a worker at an
        exact moment of a load."""

        def hook(key: Any) -> None:
            ray.get(gate.arrive.remote(str(key)))
            ray.get(gate.wait_released.remote())

        faults.arm(point, adapter, hook)

    def register_adapter(self, name: str, path: str, known: KnownVersion | None = None) -> str:
        return self.control.register_adapter(name, path, known)

    def register_adapters(self, entries: list[tuple[str, str, KnownVersion | None]]) -> list[tuple[str, str]]:
        """Many registrations in one call, each by itself: (version, "") or ("", why not) per entry."""
        return self.control.register_adapters(entries)

    def drop_pushed(self, name: str, tags: list[str], node: str, area: str) -> list[str]:
        """The controller retired pushed versions ``tags`` of ``name``: this node's copies of them go."""
        return self.control.drop_pushed(name, tags, node, area)

    def apply(self, commands: list[Command]) -> ApplyResult:
        return self.control.apply(commands)

    def describe(self) -> dict[str, object]:
        """Who this worker is and everything it holds: the controller rebuilds from this."""
        return self.control.describe(ray.get_runtime_context().get_node_id())

    def step(self, adapters: list[str]) -> list[int]:
        """An engine step's cache calls (acquire, then release): the slots the batch ran on."""
        batch = self.cache.acquire(adapters)
        self.cache.release(batch)
        return list(batch.slots)

    def stats(self) -> dict[str, object]:
        return self.control.stats()

    @ray.method(concurrency_group="lifeline")
    def ping(self) -> bool:
        """Answered beside the control calls (its own threads): a long apply or describe is not a death."""
        return True

    @ray.method(concurrency_group="lifeline")
    def pid(self) -> int:
        """This worker's process id (fault-injection tests signal it)."""
        return os.getpid()

    @ray.method(concurrency_group="lifeline")
    def lifeline(self, host: str, port: int, nonce: str) -> None:
        """The controller's death watch: a TCP connection to it, held open by this call; the kernel closes it
        the moment this process dies. Returns when the controller closes it (or at ``shutdown``)."""
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.sendall(f"{nonce}\n".encode())
            conn.settimeout(1.0)
            while not self._stopping.is_set():
                try:
                    if not conn.recv(64):
                        return
                except TimeoutError:
                    continue

    def resize_pool(self, lent_bytes: int, keep: list[str] | None = None) -> dict[str, object]:
        """The operator's or an engine's ask: lend ``lent_bytes`` of the GPU pool to the engine in all (whole pages;
        more than now: idle adapters evicted, ``keep`` last; less: leases taken back, newest first). Issue 43
        item 3; ``WorkerControl.resize_pool``."""
        return self.control.resize_pool(lent_bytes, keep or ())

    def shutdown(self) -> None:
        self._stopping.set()
        if self.doorbell is not None:
            self.doorbell.close()
        self.metrics.stop()
        self.outbox.close()
        self.control.gate.close()  # the warm stages' driver first: nothing starts a read in a closing tier
        self.cache.close()
