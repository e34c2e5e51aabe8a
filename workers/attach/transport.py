"""How an attached rank talks to the control plane (``workers/attach/attachment.py``): one small interface, two ways.

``RankTransport`` is everything ``Attachment`` needs beyond its own process: announce the rank (and get
the controller's catalog config), take the controller's relayed calls and answer them, say it is alive
while a long call runs, push residency deltas and queue reports, fetch a pushed version's bytes, and leave.
``RayTransport`` (``workers/attach/ray_transport.py``) joins the Ray cluster and creates the rank's endpoint
actor itself; ``GrpcTransport`` (``workers/attach/grpc_transport.py``) reaches the gateway over one ``AttachRank``
stream and the gateway hosts the endpoint (docs/integrating.md, "Outside the Ray cluster").

Threads: ``take``/``answer``/``alive`` are called from the serve and heartbeat threads, ``send_deltas``
from the outbox's, ``send_queue`` from the queue sender's; implementations are thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.vocab import Answer, Call, DeltaRow


class Hello(NamedTuple):
    """Who the rank is, as its transport announces it."""

    replica: str
    rank: int
    tp: int
    num_slots: int
    model: str  # "" when the engine takes the controller's catalog config
    incarnation: int  # the rank's start time (ns); its Outbox numbers deltas under it
    liveness_s: float
    start_s: float
    name_wait_s: float
    max_adapters: int = 0  # the engine's distinct adapters per batch (0: not declared; routing.limits)
    max_running: int = 0  # the engine's requests at once (0: not declared)


class RankTransport(ABC):
    """The attached rank's link to the controller (see the module docstring)."""

    node: str = ""  # where the rank runs, for its describe report
    service: str = ""  # the service's name as the control plane gave it ("": AttachConfig.service's)

    @abstractmethod
    def open(self, hello: Hello) -> CatalogConfig:
        """Make the rank's endpoint (``ConflictError`` if the rank is attached already); the controller's
        catalog config."""

    @abstractmethod
    def adopted(self, hello: Hello) -> None:
        """Block until the controller has adopted the rank (its calls are served meanwhile); raises its
        refusal (``ConfigError``: the replica exists with another TP size, slot count or model)."""

    @abstractmethod
    def take(self, timeout_s: float) -> list[Call]:
        """The controller's calls, oldest first (a sign of life); [] after ``timeout_s`` without one.
        Raises ``ConnectionError`` once the link is gone for good."""

    @abstractmethod
    def answer(self, results: list[Answer]) -> None:
        """Answers of calls taken; does not wait for delivery."""

    @abstractmethod
    def alive(self) -> None:
        """A sign of life while a long call runs (no call taken)."""

    @abstractmethod
    def send_deltas(self, name: str, incarnation: int, batch: list[DeltaRow]) -> None:
        """Push one batch of residency deltas; raises if it did not go out (the Outbox sends it again)."""

    @abstractmethod
    def send_queue(self, replica: str, entries: list[tuple[str, float]]) -> None:
        """The replica's waiting queue, (adapter, arrival time.time()) in order."""

    @abstractmethod
    def resolve(self, name: str, timeout_s: float) -> str:
        """The current version of ``name``, registered on demand by the controller if it lies under an adapter root
        (the controller's ``Resolver``); its typed refusal raised: ``NotFoundError``, ``CapacityError``,
        ``ResolveTimeoutError``, or the adapter's own error."""

    @abstractmethod
    def fetch_pushed(self, name: str, tag: str) -> tuple[bytes, np.ndarray]:
        """The bytes of pushed version ``NAME/TAG`` (its config's, its weights' as uint8) from the controller's node
        memory, for a rank whose own node lacks them (``workers.control.node_copies``); the controller's
        ``NotFoundError`` if it keeps no such version."""

    @abstractmethod
    def close(self, hello: Hello) -> None:
        """Leave: the controller drops what the rank held, the endpoint goes. Idempotent."""
