"""The attached rank's Ray side (``workers/attach.py``): the ``Endpoint`` actor the controller calls under
the rank's worker name, and ``RayTransport``, the engine process's link when it joins the Ray cluster.

The gateway hosts the same ``Endpoint`` (``create_endpoint``) for a rank attached from outside the cluster
(``lora_cache/api/rank_host.py``). The endpoint is *not* detached: Ray kills it with its owner (the
engine process, or the gateway), so a dead owner is a dead worker to the controller's health check.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from lora_cache.catalog import CatalogConfig
from lora_cache.cluster import connect
from lora_cache.control import WorkerId
from lora_cache.errors import ConflictError, NotFoundError
from lora_cache.names import CONTROLLER_NAME, NAMESPACE
from workers.outbox import ControllerReport
from workers.relay import Call, Relay
from workers.transport import Answer, DeltaRow, Hello, RankTransport


def controller_handle() -> Any:
    """The service's controller on this Ray cluster, found by its name."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError as e:
        raise NotFoundError(f"no lora-cache controller ({CONTROLLER_NAME!r} in namespace {NAMESPACE!r}) on this Ray "
                            "cluster; start one first (`lora-cache serve --replicas 0` for a fleet of attached "
                            "engines)") from e


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class Endpoint:
    """The controller's handle on an attached rank, under the rank's worker name: the calls the controller
    makes on a worker actor, relayed to the process (``Relay``), which takes them with ``take`` and
    answers with ``answer``. ``ping`` is answered here, while the process keeps polling."""

    def __init__(self, name: str, liveness_s: float, start_s: float | None = None) -> None:
        # The relayed values are unpickled here: the commands (lora_cache.planner) and the answers
        # (workers.commands.ApplyResult, whose module imports torch). Imported now, not on the event loop by
        # the first answer: that import (about a second) stalled every call and poll behind it, and the
        # controller's second command reached the process 1.2-1.4 s late (bench.run --quick --attach: GPU hit
        # 0.625 against 1.0 hosted, 2026-11-25).
        import lora_cache.planner  # noqa: F401
        import workers.commands  # noqa: F401

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

    async def take(self, timeout_s: float, alive: bool = True) -> list[Call]:
        return await self.relay.take(timeout_s, alive)

    async def answer(self, results: list[tuple[int, bool, Any]]) -> int:
        return self.relay.answer(results)


def create_endpoint(name: str, wid: WorkerId, liveness_s: float, start_s: float, name_wait_s: float) -> Any:
    """The rank's endpoint actor, owned by the caller; waits ``name_wait_s`` for a dead predecessor's name,
    then ``ConflictError``."""
    deadline = time.monotonic() + name_wait_s
    while True:
        try:
            return Endpoint.options(name=name, namespace=NAMESPACE, max_concurrency=1000).remote(
                name, liveness_s, start_s)
        except ValueError as e:  # the name is taken: a live rank, or a dead one Ray has not released yet
            if time.monotonic() > deadline:
                raise ConflictError(f"rank {wid.rank} of replica {wid.replica!r} is already attached ({name} exists: "
                                    "a live engine process or a `lora-cache serve` worker holds it); detach it, or "
                                    "attach as another replica or rank") from e
            time.sleep(0.2)


class RayTransport(RankTransport):
    """The rank's link when its process is in the Ray cluster (or joins it at ``address``): it owns its
    endpoint, polls it, and calls the controller actor directly."""

    def __init__(self, address: str, name: str) -> None:
        if not ray.is_initialized():
            connect(address, NAMESPACE)
        self.name = name
        self.node = ray.get_runtime_context().get_node_id()
        self.endpoint: Any = None
        self._controller: Any = None
        self._report = ControllerReport()

    def controller(self) -> Any:
        if self._controller is None:
            self._controller = controller_handle()
        return self._controller

    def catalog(self) -> CatalogConfig:
        return ray.get(self.controller().catalog_config.remote(), timeout=60)

    def open(self, hello: Hello) -> CatalogConfig:
        catalog = self.catalog()  # NotFoundError first, before anything is made
        wid = WorkerId(hello.replica, hello.rank)
        self.endpoint = create_endpoint(self.name, wid, hello.liveness_s, hello.start_s, hello.name_wait_s)
        return catalog

    def adopted(self, hello: Hello) -> None:
        # a refusal (ConfigError, ConflictError) arrives as a RayTaskError that is also an instance of it
        ray.get(self.controller().worker_started.remote(self.name, hello.incarnation, True), timeout=120)

    def take(self, timeout_s: float) -> list[Call]:
        try:
            return ray.get(self.endpoint.take.remote(timeout_s), timeout=timeout_s + 60)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise ConnectionError(f"{self.name}: endpoint lost ({e})") from e

    def answer(self, results: list[Answer]) -> None:
        self.endpoint.answer.remote(results)

    def alive(self) -> None:
        self.endpoint.answer.remote([])  # an empty answer: only a sign of life

    def send_deltas(self, name: str, incarnation: int, batch: list[DeltaRow]) -> None:
        self._report(name, incarnation, batch)

    def send_queue(self, replica: str, entries: list[tuple[str, float]]) -> None:
        ray.get(self.controller().report_queue.remote(replica, entries), timeout=30)

    def close(self, hello: Hello) -> None:
        """Tell the controller (it drops what the rank held at once), then kill the endpoint."""
        if self.endpoint is None:
            return
        try:
            ray.get(self.controller().worker_detached.remote(self.name, hello.incarnation), timeout=30)
        finally:  # no controller: its health check drops the rank once the endpoint is gone
            ray.kill(self.endpoint, no_restart=True)
            self.endpoint = None
