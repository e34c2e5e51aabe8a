"""The cluster side of a rank attached through the gateway (``rank_link.RankHost`` over Ray): the gateway
owns the rank's ``Endpoint`` actor (``workers/attach/ray_transport.py``, the same actor an engine in the cluster
makes for itself) and calls the controller as an attached process would. Only forwards."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.api.relay_codec import Call, DeltaRow
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.errors import ConflictError
from lora_cache.link.endpoint import create_endpoint
from lora_cache.vocab import parse_worker_name

log = logging.getLogger(__name__)
NAME_RETRY_S = 0.2  # how often a hello tries again for a name a dead predecessor holds


class RayRankHost:
    """One rank's endpoint and its calls to ``controller``, for one AttachRank stream."""

    def __init__(self, controller: Any, name: str) -> None:
        self.controller, self.name = controller, name
        self.endpoint: Any = None
        self.service = ray.get_runtime_context().namespace  # the gateway's: its controller's and endpoints'

    async def catalog(self) -> CatalogConfig:
        config: CatalogConfig = await self.controller.catalog_config.remote()
        return config

    async def open(self, hello: pb.AttachHello) -> None:
        """The endpoint, under the rank's name; while a dead predecessor still holds it, tried again every
        ``NAME_RETRY_S`` for up to ``name_wait_s`` on the event loop (no thread is held while waiting: a
        cancelled stream stops waiting at once), then ``ConflictError``."""
        deadline = time.monotonic() + hello.name_wait_s
        while True:
            try:
                self.endpoint = await asyncio.to_thread(create_endpoint, self.name, parse_worker_name(self.name),
                                                        hello.liveness_s, hello.start_s, 0.0)
                return
            except ConflictError:
                if time.monotonic() + NAME_RETRY_S > deadline:
                    raise
            await asyncio.sleep(NAME_RETRY_S)

    async def adopt(self, hello: pb.AttachHello) -> None:
        await self.controller.worker_started.remote(self.name, hello.incarnation, True)
        if hello.max_adapters or hello.max_running:  # the engine's admission limits, for routing advice
            await self.controller.declare_limits.remote(hello.replica, hello.max_adapters, hello.max_running)

    async def take(self, timeout_s: float) -> list[Call]:
        calls: list[Call] = await self.endpoint.take.remote(timeout_s, False)
        return calls

    async def answer(self, results: list[tuple[int, bool, Any]]) -> None:
        await self.endpoint.answer.remote(results)

    async def report(self, incarnation: int, batch: list[DeltaRow]) -> None:
        await self.controller.report.remote(self.name, incarnation, batch)

    async def leave(self, hello: pb.AttachHello) -> None:
        """Tell the controller (it drops what the rank held), then kill the endpoint."""
        if self.endpoint is None:
            return
        try:
            await self.controller.worker_detached.remote(self.name, hello.incarnation)
        except Exception as e:  # no controller: its health check drops the rank once the endpoint is gone
            log.info("%s: the controller did not hear of the detach (%s)", self.name, e)
        ray.kill(self.endpoint, no_restart=True)
        self.endpoint = None
