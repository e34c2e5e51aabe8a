"""The reference engine inside a worker actor: one TP rank over the worker's own cache.

The benchmark's real path: the controller prefetches into the same ``WorkerCache`` the engine acquires
from, so its plans (queue, hints, popularity) meet the engine's steps. A replica's ranks meet in a
``torch.distributed`` group over TCP (rank 0's address); NCCL on GPUs, gloo on the CPU, control
messages over gloo. Rank 0 reports its waiting queue to the controller (lifecycle step 1) from a
sender thread that always sends the latest queue and never blocks a step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from lora_cache.adapters.refs import base_name, split_ref
from lora_cache.errors import ConfigError, LoraCacheError, NotFoundError
from lora_cache.runtime.ports import free_port
from workers.attach.seam import RESOLVE_WAIT_S, EngineCache, refusal, resolve_here
from workers.control.outbox import QueueSender
from workers.engine.admission import ADMISSION
from workers.engine.config import EngineConfig
from workers.engine.engine import EngineResult, Hooks, pinned_refs, serve_rank
from workers.engine.feed import Feed
from workers.engine.rank import RankEngine
from workers.engine.scheduler import unknown_adapter
from workers.engine.tp import Comm
from workers.engine.workload import Request


class Rendezvous(NamedTuple):
    """Where a replica's ranks meet: rank 0's host and a free TCP port there."""

    host: str
    port: int
    world: int


def rendezvous(world: int) -> Rendezvous:
    """Called on rank 0's worker: its node address and a port free now, below the kernel's ephemeral range
    (``lora_cache.runtime.ports``). A port the kernel chose (``bind(0)``, as before 2026-12-07) is an ephemeral one,
    and an outgoing connection (Ray's gRPC channels) could take it before rank 0's store bound it: the ranks' build
    then failed with EADDRINUSE (seen once in a CI run, ``tests/test_ray_push_loop.py``)."""
    return Rendezvous(_node_ip(), free_port(), world)


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (tests of this module alone)
        return "127.0.0.1"


def _refused(request: Request, error: LoraCacheError) -> LoraCacheError:
    """A submit's refusal of ``request`` for its reference (malformed, or naming no version kept): the error's own
    class (``refusal``: a remote caller catches ``NotFoundError``), saying that nothing of the call went in."""
    return refusal(error, f"request {request.rid} (nothing of this call was submitted)")


class HostedEngine:
    """``build`` (every rank at once: they meet), then ``run`` once per request stream, then ``close``.

    A run is given its requests up front, or (``streaming``) rank 0 takes them as a router submits them
    (``submit``, ``end_stream``) and tells which finished (``finished``): the ``Feed`` made at ``build``."""

    def __init__(self, cache: EngineCache, resolve: Callable[[str, float], str] | None = None,
                 resolve_s: float = RESOLVE_WAIT_S) -> None:
        self.cache = cache
        # how a name this rank's catalog lacks is registered on demand (the controller's ``resolve_adapter``);
        # None: it is refused. ``resolve_s``: a submit's whole wait for its new names
        self.resolve, self.resolve_s = resolve, resolve_s
        self.config: EngineConfig | None = None
        self.comm: Comm | None = None
        self.engine: RankEngine | None = None
        self.feed: Feed | None = None  # rank 0, from build until the next build

    def build(self, config: EngineConfig, meet: Rendezvous, rank: int) -> dict[str, float]:
        """The rank's engine, warmed up; returns the seconds of each phase (rendezvous, model, warm-up)."""
        if config.shape().name != self.cache.catalog.shape.name:
            raise ConfigError(f"engine model {config.model!r} ({config.shape().name}) differs from the workers' "
                              f"{self.cache.catalog.shape.name}; start the engine with the service's --model")
        if meet.world != config.tp:
            raise ConfigError(f"rendezvous for {meet.world} ranks but the engine's tp is {config.tp}")
        if self.cache.device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * config.tp)))
        t0 = time.perf_counter()
        self.comm = Comm()
        if config.tp > 1:
            backend = "nccl" if self.cache.device.type == "cuda" else "gloo"
            if self.cache.device.type == "cuda":
                torch.cuda.set_device(self.cache.device)
            dist.init_process_group(backend, init_method=f"tcp://{meet.host}:{meet.port}", rank=rank,
                                    world_size=meet.world)
            control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
            self.comm = Comm(rank, meet.world, control)
        self.config = config
        t1 = time.perf_counter()
        self.engine = RankEngine(config, self.comm, self.cache)  # model and KV cache built before the clock
        t2 = time.perf_counter()
        self.engine.warm_up()
        if self.feed is not None:  # a build after a run: the last run's feed keeps nothing any more
            self.cache.catalog.unuse(self.feed.named_versions)
        self.feed = Feed() if rank == 0 else None  # before the run starts: a submit may come first
        if self.feed is not None:  # a version a submitted request names stays until the loop takes it
            self.cache.catalog.use(self.feed.named_versions)
        return {"group_s": t1 - t0, "model_s": t2 - t1, "warm_up_s": time.perf_counter() - t2}

    def run(self, requests: Sequence[Request], start_wall: float, inflight: int = 0,
            report: Callable[[list[tuple[str, float]]], None] | None = None, streaming: bool = False,
            ) -> EngineResult:
        """``streaming``: rank 0 also takes the requests submitted while it runs, until ``end_stream``."""
        if self.config is None or self.comm is None or self.engine is None:
            raise ConfigError("the hosted engine is not built (or already ran); call build on every rank first")
        rule = ADMISSION[self.config.admission]()
        sender = QueueSender(report) if report is not None and self.comm.rank == 0 else None
        try:
            hooks = Hooks(start_wall, sender.push if sender is not None else None, inflight,
                          self.feed if streaming else None)
            engine, self.engine = self.engine, None
            result = serve_rank(self.config, rule, tuple(requests), self.comm, engine, hooks)
        finally:
            if sender is not None:
                sender.close()
        return result

    # -- a streaming run's feed (rank 0; any thread) ----------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> None:
        """Hand requests to the running engine. It serves every adapter this rank's catalog has (registered before
        or after ``build``: the loop adds new names to its version exchange, on every rank). A name the catalog
        lacks is resolved first (``resolve``: registered on demand by the controller when it lies under an adapter
        root; one call per name, the whole submit within ``resolve_s``), and the call returns once this rank's
        catalog has it: the request then waits in the engine until every rank has the version. A name that cannot
        be resolved (under no root, over the controller's caps, timed out, a bad file) refuses the whole call with
        nothing of it submitted, naming its requests and the controller's reason; without ``resolve``,
        ``NotFoundError``. A request accepted but whose adapter is unregistered before the loop takes it fails
        alone. Submits run side by side (``Feed.submitting``): one resolving a new name holds up no other, and
        ``end_stream`` waits for the submits begun before it.

        A request may name one version of its adapter, ``A@VERSION`` or ``A@TAG`` (the tag a trainer pushed it
        under: ``lora_cache.adapters.refs``): it runs on exactly that version on every rank, once it is READY on all
        of them (loaded if it is not). A version this rank's catalog does not keep refuses the whole call."""
        requests = list(requests)
        feed = self._feed()
        with feed.submitting([r.rid for r in requests]):
            self._submit(feed, requests)

    def _submit(self, feed: Feed, requests: list[Request]) -> None:
        catalog = self.cache.catalog
        for r in requests:  # malformed references first: refused before any name is resolved for them
            if r.adapter and "@" in r.adapter:
                try:
                    split_ref(r.adapter)
                except LoraCacheError as e:
                    raise _refused(r, e) from e
        names = {base_name(r.adapter) for r in requests if r.adapter is not None}
        if unknown := sorted(n for n in names if n not in catalog):
            rids = [r.rid for r in requests if r.adapter and base_name(r.adapter) in unknown][:8]
            if self.resolve is None:
                raise NotFoundError(f"requests {rids}: {unknown_adapter(unknown[0])}"
                                    + (f" (also {unknown[1:8]})" if len(unknown) > 1 else ""))
            deadline = time.monotonic() + self.resolve_s
            for name in unknown:
                try:
                    resolve_here(catalog, name, self.resolve, max(0.1, deadline - time.monotonic()),
                                 f"rank {self.cache.worker.tp_rank} of this replica")
                except LoraCacheError as e:
                    mine = [r.rid for r in requests if r.adapter and base_name(r.adapter) == name][:8]
                    raise refusal(e, f"requests {mine} (nothing of this call was submitted)") from e
        requests = pinned_refs(requests, catalog, _refused)  # their names resolved above: each to its exact version
        feed.submit(requests)

    def end_stream(self) -> None:
        """The end of the stream, after every submit begun before it (it waits for those still resolving)."""
        self._feed().close()

    def finished(self, timeout_s: float = 1.0) -> list[int] | None:
        """Request ids done since the last call (waits up to ``timeout_s``); None once the run is over."""
        return self._feed().finished(timeout_s)

    def _feed(self) -> Feed:
        if self.feed is None:
            raise ConfigError("this engine rank takes no submitted requests: submit to rank 0 of a replica, after "
                              "build (the other ranks follow rank 0's plans)")
        return self.feed

    def close(self) -> None:
        if self.feed is not None:
            self.cache.catalog.unuse(self.feed.named_versions)
        if self.comm is not None and self.comm.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.comm = self.config = self.engine = None

    @staticmethod
    def strip(result: EngineResult) -> EngineResult:
        """Without recorded outputs (tensors stay in the worker)."""
        return EngineResult([dataclasses.replace(r, outputs=None) for r in result.records], result.ranks)


