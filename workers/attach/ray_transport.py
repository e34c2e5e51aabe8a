"""``RayTransport``: an attached rank's link when its engine process joins the Ray cluster
(``workers/attach/attachment.py``). It owns the rank's ``Endpoint`` (``lora_cache/link/endpoint.py``), polls it for the
controller's calls, and calls the controller actor directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.errors import ResolveTimeoutError
from lora_cache.link.endpoint import controller_handle, create_endpoint
from lora_cache.runtime.cluster import connect
from lora_cache.vocab import NAMESPACE, Answer, Call, WorkerId
from workers.attach.transport import DeltaRow, Hello, RankTransport
from workers.control.node_copies import fetch_payload
from workers.control.outbox import ControllerReport


def ray_up(who: str) -> None:
    """Refuse a Ray call from a process whose Ray was shut down: a Ray API would otherwise start a new local
    cluster (or join the last one started on the machine) on its own, and a rank's thread would keep it up."""
    if not ray.is_initialized():
        raise ConnectionError(f"{who}: Ray is no longer initialized in this process (ray.shutdown() ran); the "
                              "link is gone: attach again after ray.init()")


def resolve_at(controller: Any, name: str, timeout_s: float) -> str:
    """The controller's ``resolve_adapter`` over Ray: the current version of ``name``, registered on demand if it
    lies under an adapter root. A refusal (NotFoundError, CapacityError, ...) arrives as a RayTaskError that is also
    an instance of it; no answer within ``timeout_s`` is a ``ResolveTimeoutError``."""
    try:
        return str(ray.get(controller.resolve_adapter.remote(name), timeout=timeout_s))
    except ray.exceptions.GetTimeoutError as e:
        raise ResolveTimeoutError(f"resolving adapter {name!r}: no answer from the controller within "
                                  f"{timeout_s:g} s; try again, or register it") from e


class RayTransport(RankTransport):
    """The rank's link when its process is in the Ray cluster (or joins it at ``address``): it owns its
    endpoint, polls it, and calls the controller actor directly."""

    def __init__(self, address: str, name: str, service: str = NAMESPACE) -> None:
        if not ray.is_initialized():
            connect(address, service)
        self.service = service  # the controller's and the endpoint's namespace, whatever this process's is
        self.name = name
        self.node = ray.get_runtime_context().get_node_id()
        self.endpoint: Any = None
        self._controller: Any = None
        self._report = ControllerReport()

    def controller(self) -> Any:
        if self._controller is None:
            self._controller = controller_handle(self.service)
        return self._controller

    def catalog(self) -> CatalogConfig:
        ray_up(self.name)
        return ray.get(self.controller().catalog_config.remote(), timeout=60)

    def open(self, hello: Hello) -> CatalogConfig:
        catalog = self.catalog()  # NotFoundError first, before anything is made
        wid = WorkerId(hello.replica, hello.rank)
        self.endpoint = create_endpoint(self.name, wid, hello.liveness_s, hello.start_s, hello.name_wait_s,
                                        self.service)
        return catalog

    def adopted(self, hello: Hello) -> None:
        # a refusal (ConfigError, ConflictError) arrives as a RayTaskError that is also an instance of it
        ray.get(self.controller().worker_started.remote(self.name, hello.incarnation, True), timeout=120)
        if hello.max_adapters or hello.max_running:  # the engine's admission limits, for routing advice
            ray.get(self.controller().declare_limits.remote(hello.replica, hello.max_adapters, hello.max_running),
                    timeout=120)

    def take(self, timeout_s: float) -> list[Call]:
        endpoint = self._open_endpoint()
        try:
            return ray.get(endpoint.take.remote(timeout_s), timeout=timeout_s + 60)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            raise ConnectionError(f"{self.name}: endpoint lost ({e})") from e

    def _open_endpoint(self) -> Any:
        """The endpoint, or ConnectionError once ``close`` killed it (a call that finished during the detach)."""
        ray_up(self.name)
        endpoint = self.endpoint  # read once: close() clears it from the detaching thread
        if endpoint is None:
            raise ConnectionError(f"{self.name}: detached; the endpoint is closed")
        return endpoint

    def answer(self, results: list[Answer]) -> None:
        self._open_endpoint().answer.remote(results)

    def alive(self) -> None:
        self._open_endpoint().answer.remote([])  # an empty answer: only a sign of life

    def send_deltas(self, name: str, incarnation: int, batch: list[DeltaRow]) -> None:
        self._report(name, incarnation, batch)

    def send_queue(self, replica: str, entries: list[tuple[str, float]]) -> None:
        ray_up(self.name)
        ray.get(self.controller().report_queue.remote(replica, entries), timeout=30)

    def resolve(self, name: str, timeout_s: float) -> str:
        return resolve_at(self.controller(), name, timeout_s)

    def fetch_pushed(self, name: str, tag: str) -> tuple[bytes, np.ndarray]:
        return fetch_payload(self.controller(), name, tag)

    def close(self, hello: Hello) -> None:
        """Tell the controller (it drops what the rank held at once), then kill the endpoint."""
        if self.endpoint is None or not ray.is_initialized():
            self.endpoint = None
            return
        try:
            ray.get(self.controller().worker_detached.remote(self.name, hello.incarnation), timeout=30)
        finally:  # no controller: its health check drops the rank once the endpoint is gone
            ray.kill(self.endpoint, no_restart=True)
            self.endpoint = None
