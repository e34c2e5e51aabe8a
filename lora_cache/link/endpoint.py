"""The controller's handle on a TP rank hosted in an engine's own process (``workers/attach/attachment.py``): the
``Endpoint`` actor, under the rank's worker name, that relays the controller's worker calls to the process.

The engine process owns it when it joins the Ray cluster (``workers/attach/ray_transport.py``); the gateway owns it for
a rank attached from outside the cluster (``lora_cache/api/rank_host.py``). It is *not* detached: Ray kills
it with its owner, so a dead owner is a dead worker to the controller's health check. No torch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from lora_cache.errors import ConflictError, NotFoundError
from lora_cache.link.relay import Relay
from lora_cache.vocab import CONTROLLER_NAME, Call, WorkerId


def controller_handle(namespace: str = "") -> Any:
    """The service's controller on this Ray cluster, found by its name in ``namespace`` (the service's name), by
    default this process's namespace (the service's: ``vocab.NAMESPACE`` unless ``serve --service`` named
    another)."""
    namespace = namespace or ray.get_runtime_context().namespace
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError as e:
        raise NotFoundError(f"no lora-cache controller ({CONTROLLER_NAME!r} in namespace {namespace!r}) on this Ray "
                            "cluster; start one first (`lora-cache serve --replicas 0` for a fleet of attached "
                            "engines)") from e


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class Endpoint:
    """The controller's handle on an attached rank, under the rank's worker name: the calls the controller
    makes on a worker actor, relayed to the process (``Relay``), which takes them with ``take`` and
    answers with ``answer``. ``ping`` is answered here, while the process keeps polling."""

    def __init__(self, name: str, liveness_s: float, start_s: float | None = None) -> None:
        # The relayed values are unpickled here: the commands and the answers (``lora_cache.vocab``).
        # Imported now, not on the event loop by the first answer: an import there stalled every call and
        # poll behind it (when ApplyResult's module imported torch, the controller's second command reached
        # the process 1.2-1.4 s late: bench.run --quick --attach, GPU hit 0.625 against 1.0 hosted, 2026-11-25).
        import lora_cache.vocab  # noqa: F401

        self.relay = Relay(name, liveness_s, start_s=start_s)

    async def apply(self, commands: list[Any]) -> Any:
        return await self.relay.call("apply", commands)

    async def describe(self) -> Any:
        return await self.relay.call("describe")

    async def register_adapter(self, name: str, path: str, known: Any = None) -> Any:
        return await self.relay.call("register_adapter", name, path, known)

    async def register_adapters(self, entries: list[Any]) -> Any:
        return await self.relay.call("register_adapters", entries)

    async def unregister_adapter(self, name: str) -> Any:
        return await self.relay.call("unregister_adapter", name)

    async def stats(self) -> Any:
        return await self.relay.call("stats")

    async def drop_pushed(self, name: str, tags: list[str], node: str, area: str) -> Any:
        return await self.relay.call("drop_pushed", name, tags, node, area)

    async def ping(self) -> bool:
        self.relay.check_live()
        return True

    async def lifeline(self, host: str, port: int, nonce: str) -> None:
        """The controller's death watch: a TCP connection to it, held open by this call; the kernel closes it
        the moment this actor's process dies (Ray kills it with its owner)."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        try:
            writer.write(f"{nonce}\n".encode())
            await writer.drain()
            while await reader.read(64):
                pass
        finally:
            writer.close()

    async def take(self, timeout_s: float, alive: bool = True) -> list[Call]:
        return await self.relay.take(timeout_s, alive)

    async def answer(self, results: list[tuple[int, bool, Any]]) -> int:
        return self.relay.answer(results)


def create_endpoint(name: str, wid: WorkerId, liveness_s: float, start_s: float, name_wait_s: float,
                    namespace: str = "") -> Any:
    """The rank's endpoint actor, owned by the caller, named in ``namespace`` (the service's; default this
    process's); waits ``name_wait_s`` for a dead predecessor's name, then ``ConflictError``."""
    deadline = time.monotonic() + name_wait_s
    while True:
        try:
            return Endpoint.options(name=name, namespace=namespace or None, max_concurrency=1000).remote(
                name, liveness_s, start_s)
        except ValueError as e:  # the name is taken: a live rank, or a dead one Ray has not released yet
            if time.monotonic() > deadline:
                raise ConflictError(f"rank {wid.rank} of replica {wid.replica!r} is already attached ({name} exists: "
                                    "a live engine process or a `lora-cache serve` worker holds it); detach it, or "
                                    "attach as another replica or rank") from e
            time.sleep(0.2)
