"""``lora-cache serve``: embedded local Ray (or ``--address``), the controller, and the replicas.

Each replica is a placement group of TP bundles (STRICT_PACK by default; a group that cannot be
placed is an error after ``placement_timeout_s``, not a hang) holding one worker actor per rank.

A service is named (``--service``): its Ray namespace is its name, so several services (one per base
model, say) share one cluster, each with its own controller, workers and placement groups. Everything a
service is made of is owned by the ``serve`` process that started it (no detached actors or groups):
``stop`` removes exactly that, and if the process dies (even SIGKILL) Ray removes it too. The controller
and the workers still restart in place while their owner lives (``max_restarts``); the controller's
registrations and hints survive that, and a new ``serve`` on the same cluster, in Ray's key-value store.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.objects import StoreUrl, is_store_url
from lora_cache.adapters.store import list_adapters
from lora_cache.controller.actor import ControllerActor
from lora_cache.controller.catalog_copy import check_location
from lora_cache.controller.core import ControllerConfig
from lora_cache.controller.registrations import Registered
from lora_cache.controller.snapshots import DurableConfig
from lora_cache.errors import ConfigError
from lora_cache.planner import PlannerConfig
from lora_cache.routing.ranking import RouterConfig
from lora_cache.runtime import heap
from lora_cache.runtime.cliargs import shell_path
from lora_cache.runtime.cluster import ObserveConfig, connect
from lora_cache.vocab import CONTROLLER_NAME, NAMESPACE, WorkerId, check_service_name, placement_group_name, worker_name
from workers.actor import WorkerActor
from workers.cache import WorkerConfig

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
REGISTER_BATCH = 1000  # adapters per register_adapters call of serve --adapters
REGISTER_MODES = ("wait", "background")  # serve once every adapter is registered, or once they are listed


class ServiceTakenError(ConfigError):
    """A service of this name already runs on the cluster."""


@dataclass(frozen=True)
class ServeConfig:
    """Where the service runs and how many replicas of what TP size it starts."""

    service: str = field(default=NAMESPACE, metadata={
        "help": "the service's name: its Ray namespace; services of other names share the cluster"})
    address: str = field(default="", metadata={"help": "Ray cluster to join ('auto' or host:port); empty: a new "
                                                       "local cluster of this process's own, on 127.0.0.1"})
    adapters: str = field(default="", metadata={
        "path": True, "help": "register every adapter directory under this one, or every adapter prefix under "
                              "s3://BUCKET/PREFIX (the object store: the normal way on a cluster)"})
    replicas: int = field(default=1, metadata={"help": "replicas to start (0: only the controller; engines attach "
                                                       "their own ranks, workers/attach/attachment.py)"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel size of each replica (workers per replica)"})
    placement: str = field(default="STRICT_PACK", metadata={"help": f"placement strategy: {'|'.join(STRATEGIES)}"})
    placement_timeout_s: float = field(default=60.0, metadata={"help": "give up placing a replica after this"})
    worker_cpus: float = field(default=0.25, metadata={"help": "CPUs reserved per worker"})
    gpus: bool = field(default=False, metadata={"help": "one GPU per worker (default: CPU workers)"})
    gpu_share: float = field(default=1.0, metadata={
        "help": "with --gpus, the share of one GPU each worker asks Ray for: below 1, replicas of TP 1 share GPUs "
                "(0.5: two on each), their engines' memory and compute together on it"})
    max_adapters: int = field(default=0, metadata={"help": "the replicas' engines' most distinct adapters per batch, "
                                                           "declared to routing advice (0: not declared)"})
    max_running: int = field(default=0, metadata={"help": "the replicas' engines' most requests running at once, "
                                                          "declared to routing advice (0: not declared)"})
    register: str = field(default="wait", metadata={
        "help": "wait: serve once every adapter under --adapters is registered; background: serve once they are "
                "listed, and register them in the background (a request for one not reached yet registers it on "
                "demand: --adapters must lie under --adapter-roots, and --resolve-s be > 0)"})
    catalog_copy: str = field(default="", metadata={
        "help": "keep a copy of the catalog here, off the Ray cluster (an absolute directory on storage that outlives "
                "the head node, or s3://BUCKET/PREFIX): a service started on a new cluster restores its registrations "
                "from it (the head lost)"})

    def __post_init__(self) -> None:
        check_service_name(self.service)
        if self.replicas < 0 or self.tp < 1:
            raise ConfigError(f"replicas ({self.replicas}) must be >= 0 and tp ({self.tp}) >= 1")
        if self.max_adapters < 0 or self.max_running < 0:
            raise ConfigError(f"max_adapters ({self.max_adapters}) and max_running ({self.max_running}) must be >= 0 "
                              "(the engines' admission limits; 0: not declared)")
        if self.register not in REGISTER_MODES:
            raise ConfigError(f"register {self.register!r} is not one of {REGISTER_MODES} (wait: serve once every "
                              "adapter is registered; background: once they are listed)")
        if self.register == "background" and not self.adapters:
            raise ConfigError("register 'background' registers the adapters under --adapters: give --adapters DIR "
                              "or s3://BUCKET/PREFIX, or leave --register at 'wait'")
        if self.placement not in STRATEGIES:
            raise ConfigError(f"placement {self.placement!r} is not one of {STRATEGIES}")
        self._check_gpu_share()
        if self.catalog_copy:
            check_location(self.catalog_copy)  # before Ray starts

    def _check_gpu_share(self) -> None:
        if not 0 < self.gpu_share <= 1:
            raise ConfigError(f"gpu_share {self.gpu_share!r}: give the share of one GPU each worker asks for, in "
                              "(0, 1] (e.g. 0.5: two replicas of TP 1 on each GPU)")
        if self.gpu_share < 1 and not self.gpus:
            raise ConfigError(f"gpu_share {self.gpu_share!r} is the share of a GPU each worker asks for: it needs "
                              "--gpus (CPU workers ask for none); add --gpus or leave --gpu-share at 1")
        if self.gpu_share < 1 and self.tp > 1:
            raise ConfigError(f"gpu_share {self.gpu_share!r} with tp {self.tp}: the ranks of a replica could land on "
                              "one GPU, where NCCL refuses two ranks of one communicator; share GPUs between "
                              "replicas of --tp 1, or leave --gpu-share at 1")


@dataclass
class Service:
    """What this process started: only this is stopped (another service's actors are never touched)."""

    name: str
    controller: Any
    workers: dict[WorkerId, Any]
    groups: list[Any]
    owns_ray: bool
    # this service's pushed versions (node memory), removed by an orderly stop when nothing could restore the catalog
    # that names them: a local Ray of this process's own (its GCS snapshot goes with it) and no catalog copy.
    # None: kept (a cluster joined outlives this process, and a service started on it again restores the catalog)
    push_area: Path | None = None

    def stop(self) -> None:
        # The controller stops watching first, then dies first: otherwise it sees each worker die and logs
        # "worker ... is lost (ActorDiedError): dropping its residency" for every rank of an orderly shutdown.
        # Killing it first is not enough alone: Ray fails calls on a killed actor before its process is gone.
        try:
            ray.get(self.controller.stop_watching.remote(), timeout=10.0)
        except Exception as e:  # dead, hung, or its call failed: it is killed below all the same
            print(f"lora-cache: the controller did not stop watching its workers ({type(e).__name__}: {e}); "
                  "stopping it anyway", file=sys.stderr, flush=True)
        ray.kill(self.controller, no_restart=True)
        _await_death(self.controller, timeout_s=5.0)
        for handle in self.workers.values():
            ray.kill(handle, no_restart=True)
        for pg in self.groups:
            remove_placement_group(pg)
        if self.owns_ray:
            ray.shutdown()
        if self.push_area is not None:  # after the controller and the ranks: nothing writes or reads them now
            shutil.rmtree(self.push_area, ignore_errors=True)


def _await_death(actor: Any, timeout_s: float) -> None:
    """Return once ``actor`` (just killed) answers no call, or after ``timeout_s``: ``ray.kill`` is asynchronous."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)


def check_service_free(service: str) -> None:
    """Refuse a service name whose controller is alive on this cluster, before anything is created."""
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=service)
    except ValueError:
        return
    raise ServiceTakenError(f"--service {service!r} is already running on this Ray cluster (its controller "
                            f"{CONTROLLER_NAME!r} is alive in namespace {service!r}); nothing was started and it was "
                            "left as it is: give this service another --service name, or stop that one first")


def _bundle(serve: ServeConfig) -> dict[str, float]:
    return {"CPU": serve.worker_cpus, **({"GPU": serve.gpu_share} if serve.gpus else {})}


def start(serve: ServeConfig, catalog: CatalogConfig, planner: PlannerConfig, worker: WorkerConfig,
          router: RouterConfig | None = None, observe: ObserveConfig | None = None) -> Service:
    if serve.register == "background":
        check_background(serve, catalog)  # before Ray starts
    owns = not ray.is_initialized()
    if owns:  # embedded, or join --address; unreachable or token-refused clusters fail fast (cluster.py)
        connect(serve.address, serve.service, observe)
    elif ray.get_runtime_context().namespace != serve.service:
        raise ConfigError(f"this process joined Ray in namespace {ray.get_runtime_context().namespace!r}, but the "
                          f"service is {serve.service!r}: its actors find each other in their job's namespace; "
                          f"ray.init(namespace={serve.service!r})")
    try:
        check_service_free(serve.service)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    adapters = shell_path(serve.adapters) if serve.adapters else None  # the actors run elsewhere (s3://: as given)
    if adapters and not catalog.adapter_roots:
        catalog = dataclasses.replace(catalog, adapter_roots=(adapters,))
    try:
        listing = Listing(adapters, catalog.store_timeout_s) if adapters else None  # a store: while actors start
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    try:  # owned by this process (no lifetime="detached"): it goes when this process goes
        controller = ControllerActor.options(name=CONTROLLER_NAME, namespace=serve.service).remote(
            ControllerConfig(catalog, planner, router or RouterConfig()),
            durable=DurableConfig(catalog_copy=serve.catalog_copy))
    except ValueError as e:  # another serve took the name between the check and here
        if owns:
            ray.shutdown()
        raise ServiceTakenError(f"--service {serve.service!r} was started by another process just now: {e}") from e
    # pushed versions outlive the service only where a restored catalog could name them again
    embedded = owns and not serve.address
    push_area = catalog.push_root() / serve.service if embedded and not serve.catalog_copy else None
    service = Service(serve.service, controller, {}, [], owns, push_area)
    try:
        for i in range(serve.replicas):
            _start_replica(service, f"replica-{i}", serve, catalog, worker)
        if listing is not None:
            items = listing.items()
            if serve.register == "background":
                waiting = ray.get(controller.register_later.remote(items))
                print(f"lora-cache serve: {len(items)} adapters listed under {adapters}; {waiting} registering in "
                      "the background (each registered on demand if asked for first)", flush=True)
            else:
                register_items(controller, items)
    except BaseException:
        service.stop()
        raise
    return service


def check_background(serve: ServeConfig, catalog: CatalogConfig) -> None:
    """``--register background`` serves adapters not registered yet through request-time resolution: it must be on
    (``resolve_s`` > 0) and reach ``--adapters`` (under one of ``--adapter-roots``, if given); ConfigError if not."""
    if catalog.resolve_s <= 0:
        raise ConfigError("--register background serves an adapter not registered yet by registering it on demand, "
                          f"but --resolve-s is {catalog.resolve_s}: give --resolve-s > 0, or --register wait")
    if not catalog.adapter_roots:
        return  # --adapters becomes the root
    if is_store_url(serve.adapters):  # as the catalog takes a path under a root (``AdapterCatalog.store_url``)
        url = StoreUrl.parse(serve.adapters)
        under = any(url.under(StoreUrl.parse(r)) for r in catalog.adapter_roots if is_store_url(r))
    else:  # ... and ``AdapterRoots.resolve``: the real path under a root's real path (a root need not exist yet)
        real = Path(shell_path(serve.adapters)).resolve()
        under = any(real.is_relative_to(Path(shell_path(r)).resolve()) for r in catalog.adapter_roots
                    if not is_store_url(r))
    if not under:
        raise ConfigError(f"--register background registers on demand from --adapter-roots, and --adapters "
                          f"{serve.adapters} lies under none of {', '.join(catalog.adapter_roots)}: add it to "
                          "--adapter-roots, or --register wait")


class Listing:
    """The adapters under ``--adapters``: a directory listed at once (a bad one refused before any actor starts), an
    object-store prefix on a thread while the actors start (its pages are round trips)."""

    def __init__(self, root: str, timeout_s: float) -> None:
        self._pool: ThreadPoolExecutor | None = None
        if is_store_url(root):
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-cache-listing")
            self._future = self._pool.submit(adapter_items, root, timeout_s)
        else:
            self._items = adapter_items(root, timeout_s)

    def items(self) -> list[tuple[str, str]]:
        if self._pool is None:
            return self._items
        try:
            return self._future.result()
        finally:
            self._pool.shutdown(wait=False)


def register_directory(controller: Any, root: str | Path, timeout_s: float = 20.0,
                       batch: int = REGISTER_BATCH) -> list[Registered]:
    """Register every adapter directory under ``root`` (by its directory name; or every adapter prefix under an
    ``s3://bucket/prefix``) in ``register_adapters`` batches: the controller reads each batch on a thread, tells
    the workers, and plans once per batch. An adapter that cannot be registered is printed with its error (the
    fix in it) and left out; the others serve."""
    return register_items(controller, adapter_items(root, timeout_s), batch)


def register_items(controller: Any, items: list[tuple[str, str]], batch: int = REGISTER_BATCH) -> list[Registered]:
    """``register_directory`` of the (name, path) items listed already."""
    done: list[Registered] = []
    for start in range(0, len(items), batch):
        done += ray.get(controller.register_adapters.remote(items[start:start + batch]))
    for d in done:
        if d.error is not None:
            print(f"lora-cache serve: adapter {d.name} was not registered: {d.error}", file=sys.stderr, flush=True)
        for error in d.rank_errors:
            print(f"lora-cache serve: adapter {d.name}@{d.version}: {error}", file=sys.stderr, flush=True)
        for pending in d.rank_pending:  # registered: the rank is given it when it is back
            print(f"lora-cache serve: adapter {d.name}@{d.version}: {pending}", file=sys.stderr, flush=True)
    return done


def adapter_items(root: str | Path, timeout_s: float) -> list[tuple[str, str]]:
    """(name, path) of every adapter under ``root``: a local directory's adapter directories, or an object-store
    prefix's adapter prefixes (listed here, with this process's AWS credentials)."""
    if is_store_url(str(root)):
        return [(name, str(url)) for name, url in list_adapters(StoreUrl.parse(str(root)), timeout_s)]
    local = Path(root)
    return [(d.name, str(d)) for d in sorted(local.iterdir()) if (d / "adapter_config.json").is_file()]


def _start_replica(service: Service, replica: str, serve: ServeConfig, catalog: CatalogConfig,
                   worker: WorkerConfig) -> None:
    # Not detached: a restartable detached actor in a placement group outlives the group's owner, which Ray
    # warns about; these go with this process, and restart in their bundle while it lives.
    pg = placement_group([_bundle(serve)] * serve.tp, strategy=serve.placement,
                         name=placement_group_name(serve.service, replica))
    service.groups.append(pg)
    ready, _ = ray.wait([pg.ready()], timeout=serve.placement_timeout_s)
    if not ready:
        raise ConfigError(f"replica {replica}: {serve.tp} bundles of {_bundle(serve)} could not be placed with "
                          f"{serve.placement} within {serve.placement_timeout_s:.0f} s; the cluster has "
                          f"{ray.available_resources()} free: add nodes, lower --tp or --worker-cpus, or change "
                          "--placement")
    for rank in range(serve.tp):
        wid = WorkerId(replica, rank)
        config = dataclasses.replace(worker, tp=serve.tp, tp_rank=rank, device="auto" if serve.gpus else "cpu")
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        service.workers[wid] = WorkerActor.options(
            name=worker_name(wid), namespace=serve.service, num_cpus=serve.worker_cpus,
            num_gpus=serve.gpu_share if serve.gpus else 0, scheduling_strategy=strategy,
        ).remote(worker_name(wid), replica, config, catalog)
    ray.get([h.ping.remote() for h in service.workers.values()])
    ray.get(service.controller.add_replica.remote(replica, serve.tp, worker.num_slots))
    if serve.max_adapters or serve.max_running:  # the engines' admission limits, for routing advice
        ray.get(service.controller.declare_limits.remote(replica, serve.max_adapters, serve.max_running))


def serve_forever(service: Service, duration_s: float = 0.0, before_stop: Callable[[], None] = lambda: None) -> None:
    """Serve until SIGINT/SIGTERM (or for ``duration_s`` seconds, if set), then shut down cleanly
    (``before_stop`` first: the gateway drains its calls before the controller goes)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    status = ray.get(service.controller.status.remote())
    print(f"lora-cache serving: {len(service.workers)} workers in {status['replicas']}, {status['adapters']} "
          f"adapters, epoch {status['epoch']} (service {service.name}); Ctrl-C to stop", flush=True)
    deadline = time.monotonic() + duration_s if duration_s > 0 else float("inf")
    heap.freeze()  # the gateway's calls (hints, lookups) are not stalled by full collections of this process
    while not stop.wait(min(1.0, max(0.0, deadline - time.monotonic()))) and time.monotonic() < deadline:
        pass
    print("lora-cache: shutting down", flush=True)
    try:
        before_stop()
    finally:
        service.stop()


def wait_ready(controller: Any, adapter: str, replica: str, timeout_s: float = 60.0) -> float:
    """Block until ``replica`` is ready for ``adapter``; returns seconds waited."""
    t0, cursor = time.monotonic(), 0
    while time.monotonic() - t0 < timeout_s:
        if replica in ray.get(controller.lookup.remote(adapter))["ready"]:
            return time.monotonic() - t0
        batch = ray.get(controller.poll_events.remote(cursor, replica, adapter, 1.0))
        cursor = batch.resync.resume_after if batch.resync else max([cursor, *(e.seq for e in batch.events)])
    raise TimeoutError(f"replica {replica} not ready for {adapter} within {timeout_s} s")
