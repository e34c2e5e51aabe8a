"""Adoption: the workers that exist when the controller (re)starts, taken from their own reports (invariant 6).

After a controller restart, ``rebuild`` asks every worker actor it finds by name for its full report, all at
once, each for ``call_timeout_s`` at most, and has the links adopt each one: what a rank holds of the versions
the durable catalog restored is believed, once (its loads were commanded by the controller's predecessor, or
acquired); nothing a rank reports registers an adapter (a report names paths, and an attached endpoint's is the
engine's own word: issue 46). A worker that does not answer in time (its node was lost with the
controller's) is a lost rank until it answers: ``adopt_late`` asks it again from the health loop, one call
each, and adopts it then (every registration replayed, a plan sent). A split of ``WorkerLinks`` along its
seam: what adopting one report does (``adopt``) and everything after stays there; this module finds the
workers and waits for the silent ones. One way: ``links.py`` imports this module, never the reverse
(``Adopter`` is what this one needs of the links).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import ray

from lora_cache.controller.core import ControllerCore
from lora_cache.vocab import WorkerId, parse_worker_name, worker_name

log = logging.getLogger(__name__)

T = TypeVar("T")
WORKER_ATTEMPTS = 30  # a second apart: a restarted worker may still be in its constructor


async def while_restarting(call: Callable[[], Awaitable[T]]) -> T:
    """``await call()``, called again while the worker is restarting (``ActorUnavailableError``: Ray
    refuses calls until its constructor returns), a second apart, ``WORKER_ATTEMPTS`` times at most.
    A worker that is gone (``RayActorError``) fails at once."""
    for _ in range(WORKER_ATTEMPTS - 1):
        try:
            return await call()
        except ray.exceptions.ActorUnavailableError:
            await asyncio.sleep(1.0)
    return await call()



class Adopter(Protocol):
    """What adoption needs of ``WorkerLinks``: the core, the workers by name, the handles linked, and what
    adopting a report, a loss, a replay and a plan do."""

    core: ControllerCore
    handles: dict[WorkerId, Any]
    call_timeout_s: float
    find: Callable[[str], Any]
    named: Callable[[], list[str]]
    replan: Callable[[], Awaitable[None]]

    def adopt(self, handle: Any, info: dict[str, Any], restart: bool = False) -> WorkerId: ...

    def lose(self, wid: WorkerId, cause: str = "") -> None: ...

    async def replay(self, handles: list[Any]) -> None: ...


class Adoption:
    """The workers found at a (re)start: adopted from their reports, or noted and asked again until they answer."""

    def __init__(self, links: Adopter) -> None:
        self.links = links
        self.unadopted: dict[WorkerId, Any] = {}  # workers that exist but did not answer the rebuild: their handles
        self.adopting: dict[WorkerId, asyncio.Task[bool]] = {}  # those being asked again (one call each)

    async def rebuild(self) -> None:
        """Adopt the workers that already exist (after a controller restart) from their reports, asked all at
        once, each for ``call_timeout_s`` at most. One that does not answer in time (its node was lost with the
        controller's: Ray holds a call to it until it is placed again, which may be never) is adopted later,
        when it answers (``adopt_late``, from the health loop) or says it restarted (``worker_started``): the
        controller serves meanwhile, and that rank counts as lost (its replica is ready for nothing)."""
        names = self.links.named()
        answers = await asyncio.gather(*(self._report(name) for name in names))
        for handle, info in (a for a in answers if a is not None):
            self.links.adopt(handle, info, restart=True)
        for wid in self.unadopted:  # a rank of a replica that its other ranks brought back: lost until it answers
            view = self.links.core.planner.view
            if wid.replica in view.replicas() and str(wid) in view.workers(wid.replica):
                self.links.lose(wid, "not adopted at a restart: its replica's other ranks were")

    async def _report(self, name: str) -> tuple[Any, dict[str, Any]] | None:
        """A worker's handle and full report, or None: gone (not adopted), or not answering within
        ``call_timeout_s`` (noted in ``unadopted``: adopted when it answers)."""
        try:
            handle = self.links.find(name)
        except Exception as e:  # gone meanwhile
            log.warning("could not adopt %s: %s", name, e)
            return None
        try:
            return handle, await asyncio.wait_for(while_restarting(handle.describe.remote), self.links.call_timeout_s)
        except (TimeoutError, ray.exceptions.ActorUnavailableError) as e:
            log.warning("%s does not answer (%s; its node may be lost): adopted when it does", name,
                        type(e).__name__)
            self.unadopted[parse_worker_name(name)] = handle
            return None
        except Exception as e:  # a worker that died for good is simply not adopted
            log.warning("could not adopt %s: %s", name, e)
            return None

    def adopt_late(self) -> None:
        """Ask the workers that did not answer the rebuild again, in the background: one call each, awaited until
        it answers (Ray holds it until the worker is placed again; a new call each round would pile up there)."""
        for wid in list(self.unadopted):
            if wid not in self.adopting:
                task = self.adopting[wid] = asyncio.get_running_loop().create_task(self._adopt_late(wid))
                task.add_done_callback(functools.partial(self._adopted_late, wid))

    def _adopted_late(self, wid: WorkerId, _: asyncio.Task[bool]) -> None:
        self.adopting.pop(wid, None)

    async def _adopt_late(self, wid: WorkerId) -> bool:
        """Adopt ``wid`` from its report now if it answers (and give it every registration: it may have restarted
        empty); True if it was adopted."""
        handle = self.unadopted.get(wid)
        if handle is None:
            return False
        try:
            info = await handle.describe.remote()
        except Exception as e:
            if not isinstance(e, ray.exceptions.ActorUnavailableError):
                log.warning("could not adopt %s: %s", worker_name(wid), e)
                self.unadopted.pop(wid, None)  # dead for good
            return False
        if self.unadopted.pop(wid, None) is not handle or wid in self.links.handles:
            return False
        self.links.adopt(handle, info, restart=True)  # its loads predate the restart, as the rebuild's
        log.info("adopted %s, which did not answer the rebuild", worker_name(wid))
        await self.links.replay([handle])
        await self.links.replan()
        return True
