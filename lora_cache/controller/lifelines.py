"""Each linked worker's death watch (lifecycle step 7; invariant 6): a TCP connection its process keeps open.

The kernel closes a process's connections the moment it dies (SIGKILL included: 2-3 ms on one node), where
Ray fails a call on a restarting actor only once it restarted (about 1.5 s). So each linked worker is asked
to open a lifeline to the controller (its ``lifeline`` call, which returns when the connection closes) and
its end loses the rank at once. A hung (SIGSTOP) or unreachable worker keeps its lifeline open: the health
loop's pings find those (``WorkerLinks.ping_all``).

A split of ``WorkerLinks`` along its seam: what a loss does stays there (``lose``, ``forget``); this module
only notices deaths. One way: ``links.py`` imports this module, never the reverse (``Linked`` is what this one
needs of the links).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, NamedTuple, Protocol

import ray

from lora_cache.controller.core import ControllerCore
from lora_cache.vocab import WorkerId

log = logging.getLogger(__name__)

LIFELINE_HELLO_S = 5.0  # a lifeline connection names its call within this, or is closed
LIFELINE_RETRY_S = 0.2  # after a lifeline failed: how soon to call the (restarting) worker again
LIFELINE_RETRY_MAX_S = 5.0  # ... at most, after calls that never connected


class Linked(Protocol):
    """What the lifelines need of ``WorkerLinks``: who is linked (the handle a death counts for), who is down
    already, which ranks an engine attached, and what a loss does."""

    core: ControllerCore
    handles: dict[WorkerId, Any]
    links: dict[WorkerId, Any]  # each worker's ``Link``: its ``incarnation`` names the process linked now
    attached: set[WorkerId]

    def lose(self, wid: WorkerId, cause: str = "") -> None: ...

    def forget(self, wid: WorkerId) -> None: ...


class Call(NamedTuple):
    """One lifeline call: to whom, through which handle, and the incarnation linked when it was sent."""

    wid: WorkerId
    handle: Any
    incarnation: int | None


class Lifelines:
    """One lifeline task per watched worker, and the server their connections reach."""

    def __init__(self, links: Linked) -> None:
        self.links = links
        self.tasks: dict[WorkerId, asyncio.Task[None]] = {}  # each watched worker's lifeline call, kept open
        self._expected: dict[str, Call] = {}  # lifeline nonce -> the call that sent it, while it runs
        self._ended: dict[str, tuple[Call, float]] = {}  # ... calls that ended unconnected, and when (late hellos)
        self._connected: set[str] = set()  # nonces of lifeline calls whose connection is open now
        self._heard: set[str] = set()  # nonces of running calls whose connection's hello was read
        self._server: asyncio.Server | None = None  # where workers open their lifelines
        self._open: set[asyncio.StreamWriter] = set()  # the lifeline connections open now (closed by ``close``)
        self.closed = False  # the service is being stopped: nothing is watched any more

    def watch(self, wid: WorkerId, handle: Any) -> None:
        """Keep a lifeline to the worker (a newer handle replaces an older one's). No ``lifeline`` method
        (fakes), or closed: nothing is watched."""
        if not hasattr(handle, "lifeline") or self.closed:
            return
        self.drop(wid)
        self.tasks[wid] = asyncio.get_running_loop().create_task(self._keep(wid, handle))

    def drop(self, wid: WorkerId) -> None:
        """Stop watching ``wid`` (unless this is its own lifeline task, which ends by returning)."""
        if (task := self.tasks.pop(wid, None)) is not None and task is not asyncio.current_task():
            task.cancel()

    def close(self) -> None:
        """Watch nothing any more: every lifeline task ended, no new ones, no connection taken."""
        self.closed = True
        for wid in list(self.tasks):
            self.drop(wid)
        if self._server is not None:
            self._server.close()  # takes no new connection; the open ones are closed here: their handlers end by
        for writer in list(self._open):  # themselves, even where a cancellation at the loop's end is lost (the
            writer.close()  # CI's hang of 2026-11-30 in test_control.py, in asyncio.run's task cancellation)

    async def _keep(self, wid: WorkerId, handle: Any) -> None:
        links = self.links
        host, port = await self._address()
        lifeline = handle.lifeline
        retry_s = LIFELINE_RETRY_S
        while links.handles.get(wid) is handle:
            nonce = secrets.token_hex(16)
            link = links.links.get(wid)
            self._expected[nonce] = call = Call(wid, handle, link.incarnation if link is not None else None)
            try:
                await lifeline.remote(host, port, nonce)  # returns when the connection closes
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayTaskError as e:  # alive, but it cannot reach the controller: pings only
                log.warning("worker %s cannot open a lifeline to %s:%d (%s); its death is found by pings",
                            wid, host, port, e.cause if e.cause is not None else e)
                return
            except Exception as e:  # dead or restarting
                if links.handles.get(wid) is not handle or self.closed:
                    return
                if wid in links.attached and isinstance(e, ray.exceptions.ActorDiedError):
                    log.warning("attached rank %s is gone (%s)", wid, type(e).__name__)
                    links.forget(wid)  # its endpoint is dead for good: a new process attaches anew
                    return
                if wid not in links.core.lost.down and self._death(nonce):
                    log.warning("worker %s is lost (%s): dropping its residency", wid, type(e).__name__)
                    links.lose(wid, f"lifeline call failed ({type(e).__name__})")
            finally:
                # calls that never connect (a worker dead for good, or not up yet) are retried ever less often
                retry_s = LIFELINE_RETRY_S if nonce in self._heard else min(LIFELINE_RETRY_MAX_S, 2 * retry_s)
                self._expected.pop(nonce, None)
                if nonce not in self._heard:
                    self._ended_unheard(nonce, call)
                self._heard.discard(nonce)
                self._connected.discard(nonce)
            await asyncio.sleep(retry_s)

    def _death(self, nonce: str) -> bool:
        """Whether a failed lifeline call says the worker died: only if its connection was opened and has not been
        seen to end (the end of a connection is counted when it is seen, ``_opened``). Ray fails a call to an actor
        that restarts only once the new process is up (``ActorUnavailableError`` 0.3-0.8 s after the new process
        started, in every one of 5 SIGKILLs on this machine, for the call in flight and for one sent just after the
        kill alike), and the new process may have reported by then: taking that failure for a death lost the
        healthy rank again, and its replica left the routes until the next resync (the CI's stop 47,
        tests/test_ray_hardening.py). A call that never connected says nothing of the process under the name
        either; pings find a worker that is really gone."""
        return nonce in self._connected

    async def _address(self) -> tuple[str, int]:
        if self._server is None:
            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            self._server = await asyncio.start_server(self._opened, host, 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    def _ended_unheard(self, nonce: str, call: Call) -> None:
        """A call ended before its connection's hello was read. Its hello may still be waiting in the server's
        queue (a process killed just after it connected, on a loaded loop): kept for ``LIFELINE_HELLO_S`` so that
        connection's end still counts."""
        now = asyncio.get_running_loop().time()
        for old, (_, ended) in list(self._ended.items()):
            if now - ended > LIFELINE_HELLO_S:
                del self._ended[old]
        self._ended[nonce] = (call, now)

    def _current(self, call: Call, late: bool) -> bool:
        """Whether a lifeline's end is the death of the rank linked now. A late hello's (its call ended first)
        only if the incarnation linked is still the one its call was sent to: a restarted process that has
        reported meanwhile is not lost again for its predecessor's connection."""
        links = self.links
        if links.handles.get(call.wid) is not call.handle or call.wid in links.core.lost.down or self.closed:
            return False
        link = links.links.get(call.wid)
        return not late or (link is not None and link.incarnation == call.incarnation)

    async def _opened(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One worker's lifeline: its first line is the nonce of the call that opened it; its end (closed or
        reset) is the worker's death if that call is still the worker's current one."""
        self._open.add(writer)
        try:
            if self.closed:
                return
            try:
                line = await asyncio.wait_for(reader.readline(), LIFELINE_HELLO_S)
            except (TimeoutError, ConnectionError, OSError):
                return
            nonce = line.decode(errors="replace").strip()
            call, late = self._expected.get(nonce), False
            if call is None and (ended := self._ended.pop(nonce, None)) is not None:
                call, late = ended[0], True
            if call is None:
                return  # a stranger, or a call given up long ago
            self._connected.add(nonce)
            if not late:
                self._heard.add(nonce)
            try:
                while await reader.read(64):
                    pass  # nothing is sent on it: only its end matters
            except (ConnectionError, OSError):
                pass  # a reset is an end as well
            self._connected.discard(nonce)  # its end is counted here: the call's own failure, later, is not again
            if self._current(call, late):
                log.warning("worker %s closed its lifeline (its process died): dropping its residency", call.wid)
                # an attached one is forgotten when its call fails (ActorDiedError)
                self.links.lose(call.wid, "lifeline closed")
        finally:
            self._open.discard(writer)
            writer.close()
