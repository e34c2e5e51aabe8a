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
queued there, the process's serve thread (``workers.attach.calls``) long-polls the queue (``take``), runs the
calls in order on ``WorkerControl`` (the same code the worker actor forwards to) and answers them. Residency deltas and
queue reports go straight from the process to the controller (``Outbox``, ``QueueSender``).

Outside the Ray cluster (``AttachConfig(gateway="host:port")``) the process never imports Ray: it opens one
``AttachRank`` gRPC stream to the gateway, which hosts the endpoint on its behalf and relays the calls,
deltas and queue reports over it (``workers/attach/grpc_transport.py``). Either way the rank's link is a
``RankTransport`` (``workers/attach/transport.py``); everything else here is the same.

The endpoint is *not* detached: Ray kills it when the process that created it (its owner) dies, so a
killed engine process is a dead worker to the controller's health check, and what the rank held is
dropped from the replica's readiness, as for any worker. ``detach`` kills it on purpose. A process that
attaches again under the same name is a new incarnation: the controller takes the new endpoint and its
(empty) report, replays the adapter registrations and plans again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig
from lora_cache.adapters.pushed import PushArea
from lora_cache.adapters.refs import split_ref, version_of
from lora_cache.errors import ConfigError
from lora_cache.link.relay import RELAYED, EndpointStaleError, Relay
from lora_cache.runtime.tls import check_tls_pair
from lora_cache.vocab import (
    NAMESPACE,
    AdapterKey,
    ReadinessRecord,
    WorkerId,
    check_service_name,
    worker_name,
)
from workers.attach.calls import CallLoop
from workers.attach.seam import RESOLVE_WAIT_S, resolve_here
from workers.attach.transport import Hello, RankTransport
from workers.attach.versions import VersionExchange
from workers.cache import WorkerCache, WorkerConfig
from workers.control.node_copies import NodeCopies
from workers.control.outbox import Outbox, QueueSender
from workers.control.rank import WorkerControl
from workers.gpu.acquire import AdapterRef, Batch
from workers.gpu.lend import PoolLender

__all__ = ["RELAYED", "AttachConfig", "Attachment", "EndpointStaleError", "Relay", "attach"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttachConfig:
    """Which replica an engine process's rank joins (its rank and TP size are in ``WorkerConfig``), how it
    reaches the controller (joining the Ray cluster at ``address``, or through the gateway at ``gateway``),
    and how the rank talks to it."""

    replica: str = field(default="", metadata={"help": "the replica this rank belongs to (e.g. replica-0)"})
    address: str = field(default="auto", metadata={"help": "Ray cluster to join when this process is not in one "
                                                           "yet ('auto' or host:port)"})
    service: str = field(default=NAMESPACE, metadata={"help": "the lora-cache service to join on the Ray cluster "
                                                              "(`serve --service`; the gateway's is its own)"})
    gateway: str = field(default="", metadata={"help": "attach through the gRPC gateway at host:port instead of "
                                                       "joining the Ray cluster (for a process outside it)"})
    token: str = field(default="", metadata={"help": "the gateway's bearer token (prefer token_file)"})
    token_file: str = field(default="", metadata={"path": True, "help": "file holding the gateway's bearer token"})
    tls_ca: str = field(default="", metadata={"path": True, "help": "PEM file of the CA that signed the "
                                                                    "gateway's certificate (the stream uses TLS)"})
    tls_client_cert: str = field(default="", metadata={"path": True, "help": "PEM certificate this rank presents "
                                                       "to a gateway with --tls-client-ca (mutual TLS; with tls_ca)"})
    tls_client_key: str = field(default="", metadata={"path": True, "help": "PEM private key of tls_client_cert"})
    flush_s: float = field(default=0.005, metadata={"help": "gather residency deltas this long per push"})
    poll_s: float = field(default=1.0, metadata={"help": "the serve thread's long poll for controller calls"})
    liveness_s: float = field(default=5.0, metadata={"help": "the endpoint fails the controller's ping when the "
                                                             "process has not polled for this long"})
    name_wait_s: float = field(default=30.0, metadata={"help": "wait this long for a dead predecessor's name"})
    start_s: float = field(default=60.0, metadata={"help": "the endpoint waits this long for the process's first "
                                                       "poll (a loaded host can be slow to start its serve thread)"})
    max_adapters: int = field(default=0, metadata={"help": "the engine's most distinct adapters per batch, declared "
                                                           "to routing advice (0: not declared)"})
    max_running: int = field(default=0, metadata={"help": "the engine's most requests running at once, declared to "
                                                          "routing advice (0: not declared)"})
    max_call_s: float = field(default=300.0, metadata={"help": "a controller call still running after this long "
                                                             "no longer keeps the process alive (a wedged call)"})

    def __post_init__(self) -> None:
        if not self.replica or ":" in self.replica or "/" in self.replica:
            raise ConfigError(f"replica {self.replica!r} must be a non-empty name without ':' or '/', e.g. replica-0")
        if not self.address:
            raise ConfigError("address is empty: an attached rank joins the cluster where the controller runs "
                              "('auto', or the head's host:port); it never starts a Ray of its own")
        check_service_name(self.service, "service")
        self._check_gateway()
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

    def _check_gateway(self) -> None:
        if not self.gateway:
            if self.token or self.token_file or self.tls_ca or self.tls_client_cert or self.tls_client_key:
                raise ConfigError("token, token_file, tls_ca and tls_client_cert/key are the gateway's: set "
                                  "gateway='host:port' to attach through it, or leave them empty to join the Ray "
                                  "cluster")
            return
        host, _, port = self.gateway.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"gateway {self.gateway!r} is not host:port; give the gateway's address, e.g. "
                              "10.0.0.5:50051 (`lora-cache serve --grpc-host 0.0.0.0 --token-file F` listens beyond "
                              "its machine)")
        if self.address != "auto":
            raise ConfigError(f"address ({self.address!r}) and gateway ({self.gateway!r}) are both set: a rank joins "
                              "the Ray cluster at address, or attaches from outside it through the gateway; give one")
        if self.token and self.token_file:
            raise ConfigError("both token and token_file are set; give one (token_file keeps it off the command line)")
        what = {"token_file": "the gateway's bearer token", "tls_ca": "the gateway's CA certificate (PEM)",
                "tls_client_cert": "this rank's client certificate (PEM)", "tls_client_key": "its private key (PEM)"}
        for name, thing in what.items():
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ConfigError(f"{name} {getattr(self, name)!r} is not a file; give the path of {thing}")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ConfigError(f"tls_client_cert ({self.tls_client_cert!r}) and tls_client_key "
                              f"({self.tls_client_key!r}) go together; give both to present a client certificate")
        if self.tls_client_cert and not self.tls_ca:
            raise ConfigError(f"tls_client_cert ({self.tls_client_cert!r}) is presented in a TLS handshake; give "
                              "tls_ca too, the CA that signed the gateway's certificate")
        if self.tls_client_cert:
            check_tls_pair(self.tls_client_cert, self.tls_client_key, "tls_client_cert", "tls_client_key")

    def bearer_token(self) -> str | None:
        """The gateway's token, or None when it has no auth."""
        if self.token_file:
            token = Path(self.token_file).read_text().strip()
            if not token:
                raise ConfigError(f"token_file {self.token_file!r} is empty; write the gateway's token into it")
            return token
        return self.token or None

    def hello(self, worker: WorkerConfig, model: str, incarnation: int) -> Hello:
        return Hello(self.replica, worker.tp_rank, worker.tp, worker.num_slots, model, incarnation, self.liveness_s,
                     self.start_s, self.name_wait_s, self.max_adapters, self.max_running)


class Attachment:
    """One attached rank: its cache (``acquire`` / ``release`` / slot tensors for the engine's kernels),
    its link to the controller (``transport``), the thread that serves the controller's calls (``served``) and
    its side of the version exchange (``versions``). Build it with ``attach``."""

    def __init__(self, config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig, transport: RankTransport,
                 hello: Hello, compute_stream: Any = None,
                 on_ready: Callable[[ReadinessRecord], None] | None = None) -> None:
        self.config, self.worker, self.transport, self.hello = config, worker, transport, hello
        self.wid = WorkerId(config.replica, worker.tp_rank)
        self.name = worker_name(self.wid)
        self.catalog = AdapterCatalog(catalog)
        self.outbox = Outbox(self.name, config.flush_s, send=transport.send_deltas, incarnation=hello.incarnation)
        self.cache = WorkerCache(worker, self.catalog, on_ready=on_ready, compute_stream=compute_stream,
                                 on_change=self.outbox.push, service=config.service)
        # a pushed version in memory of a node other than this process's (or under another push area): copied here
        catalog_config = self.catalog.config
        copies = NodeCopies(PushArea(catalog_config.push_root(), transport.service or config.service,
                                     catalog_config.push_bytes), transport.node, transport.fetch_pushed)
        self.control = WorkerControl(config.replica, self.catalog, self.cache, self.outbox, copies)
        self.node = transport.node
        self.served = CallLoop(self.name, self.wid, transport, self.control, self.node, config.poll_s,
                               config.max_call_s)
        self.versions = VersionExchange(self.catalog)
        self._queue = QueueSender(lambda entries: transport.send_queue(config.replica, entries))
        # what the engine's kernels and scheduler read of the cache (the reference engine runs on these alone),
        # fixed for the cache's life:
        # [num_slots, pool elements], each row the whole pool (row stride 0): a slot's offsets (meta) are the pool's
        self.pool: torch.Tensor = self.cache.pool
        self.meta: Any = self.cache.meta  # SlotMeta: per-slot offsets, ranks and scalings, written with each load
        self.device: torch.device = self.cache.device
        self.dtype: torch.dtype = self.cache.dtype
        self.streams: Any = self.cache.streams  # copy_stream, compute_stream (the one given to attach), events

    # -- the engine's calls (lifecycle step 9) ------------------------------------------------------
    @property
    def lender(self) -> PoolLender:
        """The pool that breathes: lends whole pages to this engine and takes them back (``workers.gpu.lend``); the
        evictions and the new capacity reach the controller through this rank's outbox."""
        return self.cache.lender

    def shard(self, slot: int) -> torch.Tensor:
        """The packed shard ``slot`` holds, as a view of the pool's pages."""
        return self.cache.shard(slot)

    def acquire(self, adapters: Sequence[AdapterRef], *, partial: bool = False, pipelined: bool = False,
                slot_wait_s: float = 0.0) -> Batch:
        """Slots for the batch's adapters; no host sync (the compute stream waits for loads in flight).

        Guarantees (invariant 1, docs/integrating.md): an ``AdapterKey`` is held at exactly that version,
        loaded if it is not resident, never another; a name means this rank's current version, which on a
        TP replica may differ between ranks during a re-registration: an engine with more than one rank
        passes the keys ``agree`` chose. ``pipelined``: the host waits only for each load's first chunk and
        the kernels wait per layer through ``batch.waits`` (call ``batch.waits.finish()`` after the step's
        last layer). ``partial``: an adapter that cannot be held gets slot -1 (listed in ``batch.failed``)
        instead of failing the batch. ``slot_wait_s``: a load this call starts that finds every slot held by
        running batches waits that long for one to be let go (a request's lease; an engine's step keeps 0: its
        own batches hold the slots). Release the batch after the step's kernels are enqueued."""
        return self.cache.acquire(adapters, partial=partial, pipelined=pipelined, slot_wait_s=slot_wait_s)

    def acquire_ready(self, adapters: Sequence[AdapterRef]) -> Batch | None:
        """Pin those of ``adapters`` READY here (no load started): what a scheduler admits against."""
        return self.cache.acquire_ready(adapters)

    def release(self, batch: Batch) -> None:
        self.cache.release(batch)

    def prefetch(self, name: str, version: str | None = None) -> Future[ReadinessRecord]:
        """Start loading ``name`` (``version``: exactly that one) unless resident; the future is its readiness."""
        return self.cache.prefetch(name, version)

    def resolve(self, name: str, timeout_s: float = RESOLVE_WAIT_S) -> str:
        """The version of ``name`` in this rank's catalog, registered on demand by the controller if nobody did and
        it lies under an adapter root (request-time resolution: one lookup per name at the controller however many
        requests ask, its deadline and caps). Returns once this rank's catalog holds that version (the controller
        hands a registration to every rank); within ``timeout_s`` in all. Raises the controller's typed refusal:
        ``NotFoundError`` (under no root), ``CapacityError`` (over its caps), ``ResolveTimeoutError``, or the
        adapter's own error (a bad file at that place)."""
        return resolve_here(self.catalog, name, self.transport.resolve, timeout_s,
                            f"rank {self.worker.tp_rank} of {self.config.replica}")

    def key_of(self, adapter: str, timeout_s: float = RESOLVE_WAIT_S) -> AdapterKey:
        """The exact version a request's adapter reference stands for here: ``NAME@VERSION`` or ``NAME@TAG`` (the
        tag a trainer pushed it under: ``lora_cache.adapters.refs``), or a bare name's current version (resolved on
        demand as ``resolve`` does). ``acquire`` it on every rank: each holds exactly that version.
        ``NotFoundError`` for a version no longer kept, naming those that are."""
        name, ref = split_ref(adapter)
        version = self.resolve(name, timeout_s)
        return AdapterKey(name, version if ref is None else version_of(self.catalog, name, ref))

    def ready_names(self) -> set[str]:
        return self.cache.ready_names()

    def ready_keys(self, fence: bool = False) -> set[AdapterKey]:
        """The exact versions READY on this rank; ``fence``: each stays resident until ``unfence`` (an engine's
        report, kept until its step's ``acquire`` holds what it admitted)."""
        return self.cache.ready_keys(fence)

    def unfence(self) -> None:
        """Lift ``ready_keys``' fence: its slots may be evicted again."""
        self.cache.unfence()

    def issued_keys(self) -> set[AdapterKey]:
        """The exact versions LOADING on this rank with every copy issued (READY within a copy's time)."""
        return self.cache.issued_keys()

    def issued_copies(self) -> dict[AdapterKey, tuple[int, float, int]]:
        """``issued_keys`` -> (the bytes of each one's copy, ``perf_counter`` when it was issued, the bytes of the
        write-back it follows): the engine predicts when each lands (``workers.engine.admission.CopyClock``)."""
        return self.cache.issued_copies()

    def version_rows(self, names: Sequence[str], failed_loads: Sequence[str] = (),
                     failed_steps: Sequence[str] = (), fence: bool = False) -> torch.Tensor:
        """This rank's row per adapter of ``names`` for the version exchange (``workers.attach.versions``):
        reduce the ranks' rows with an element-wise MIN (``torch.distributed`` all-reduce, or ``reduce_min``)
        and give the result to rank 0's ``agree``. ``fence``: every version the rows offer as READY stays resident
        until ``unfence`` (call it once the step's ``acquire`` holds what was admitted, or on a round with no step):
        otherwise an older version evicted between the rows and the acquire may retire, and the requests admitted on
        it fail on this rank. Loads that need a fenced slot's room wait for the fence to lift."""
        return self.versions.rows(names, self.cache.ready_keys(fence), failed_loads, failed_steps)

    def agree(self, reduced: torch.Tensor | Sequence[torch.Tensor],
              names: Sequence[str]) -> dict[str, AdapterKey | None]:
        """Rank 0, given every rank's ``version_rows`` (or their all-reduced MIN): the one version per adapter
        every rank then acquires (an ``AdapterKey``): the newest READY on every rank, else the version every
        rank's catalog calls current; None while the ranks disagree and none is READY everywhere (a
        registration on its way: ask again). Rank 0's code table decodes the rows: call it on the rank whose
        ``version_rows`` took part."""
        return self.versions.agree(reduced, names)

    def stats(self) -> dict[str, object]:
        return self.cache.stats()

    def residency(self) -> list[dict[str, object]]:
        return self.cache.residency()

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def report_queue(self, entries: list[tuple[str, float]]) -> None:
        """The replica's waiting queue, (adapter, arrival time.time()) in queue order (lifecycle step 1):
        handed to a sender thread, the latest replacing one not yet sent; never blocks."""
        self._queue.push(entries)

    # -- serving the controller (step 4: ``workers.attach.calls``) and leaving ---------------------------
    def _start(self) -> None:
        self.served.start()
        self.transport.adopted(self.hello)

    def detach(self) -> None:
        """Leave the replica: the controller drops what this rank held (the replica is ready for nothing
        until a process attaches as this rank again); then the cache is closed. Idempotent."""
        if self.served.stopping.is_set():
            return
        self.served.stopping.set()
        self._queue.close()
        self.outbox.close()  # no delta after the controller has dropped the rank
        try:
            self.transport.close(self.hello)
        except Exception as e:  # no controller: its health check drops the rank once the endpoint is gone
            log.info("%s: the controller did not hear of the detach (%s)", self.name, e)
        self.served.join()
        self.control.gate.close()  # the warm stages' driver first: nothing starts a read in a closing tier
        self.cache.close()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def transport_for(config: AttachConfig, name: str) -> RankTransport:
    """The gateway's stream when ``config.gateway`` is set (Ray is never imported then), else Ray."""
    if config.gateway:
        from workers.attach.grpc_transport import GrpcTransport

        return GrpcTransport(config.gateway, name, config.bearer_token(), config.tls_ca or None,
                             (config.tls_client_cert, config.tls_client_key) if config.tls_client_cert else None)
    from workers.attach.ray_transport import RayTransport

    return RayTransport(config.address, name, config.service)


def attach(config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig | None = None,
           compute_stream: Any = None, on_ready: Callable[[ReadinessRecord], None] | None = None) -> Attachment:
    """Attach this process as rank ``worker.tp_rank`` (of ``worker.tp``) of replica ``config.replica``.

    Call it in the engine's worker process, after the process has its device (``worker.device``: the
    engine's, e.g. ``cuda:0``; ``compute_stream``: the stream its LoRA kernels run on, default the
    current one; ``on_ready``: called with each load's timings). ``catalog``: by default the
    controller's (model shape, largest rank, adapter roots), which the rank must share. Joins the Ray
    cluster at ``config.address`` unless the process is in one already (an engine's own Ray executor),
    or, with ``config.gateway``, attaches through the gateway without Ray; the controller must be
    running. Returns once the controller has adopted the rank (its registered adapters replayed here);
    raises ``NotFoundError`` without a controller, ``ConflictError`` if the rank is attached already,
    ``ConfigError`` if the replica exists with another TP size or slot count, or the model differs from
    the controller's."""
    name = worker_name(WorkerId(config.replica, worker.tp_rank))
    transport = transport_for(config, name)
    hello = config.hello(worker, catalog.shape().name if catalog is not None else "", time.time_ns())
    try:
        controller_catalog = transport.open(hello)
    except BaseException:
        transport.close(hello)
        raise
    attachment = Attachment(config, worker, catalog or controller_catalog, transport, hello, compute_stream, on_ready)
    try:
        attachment._start()
    except BaseException:
        attachment.detach()
        raise
    return attachment
