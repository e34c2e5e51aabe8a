"""Calls that go to every linked worker at once and gather the answers (lifecycle steps 0 and 8).

Registrations sent with one call each (``submit_registrations``, read back by ``registered``); the drain
before an unregistration is answered (who still holds the adapter, evicted until no one does); the workers
told to forget it; the workers' cache counters. Every call is bounded: a stopped (SIGSTOP) worker never
holds a caller past its deadline.

A split of ``WorkerLinks`` along its seam: the links own the handles and the delta streams; this module only
asks all of them one question. A handle is anything whose ``handle.method.remote(...)`` is awaitable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

from lora_cache.adapters.peft import KnownVersion
from lora_cache.controller.links import WorkerLinks
from lora_cache.errors import ConfigError, ConflictError, NotFoundError
from lora_cache.vocab import Evict, WorkerId, worker_name

log = logging.getLogger(__name__)

Registration = tuple[str, str, KnownVersion | None]  # (name, path, the version as the controller hashed it)


class RankAnswers(NamedTuple):
    """How the ranks took one registration: those that refused it, and those that did not answer (dead or
    restarting): not a refusal, the durable catalog has it and such a rank is given every registration when it is
    adopted again or says it restarted (``WorkerLinks.replay``)."""

    refused: list[str]
    pending: list[str]


class Sent(NamedTuple):
    """Registrations submitted to the workers, and each worker's call (``WorkerFanout.registered`` reads them)."""

    entries: list[Registration]
    calls: list[tuple[WorkerId, Any]]


class WorkerFanout:
    """One question to every worker ``links`` holds a handle on, the answers gathered."""

    def __init__(self, links: WorkerLinks) -> None:
        self.links = links

    # -- registrations (step 0) ---------------------------------------------------------------------
    def submit_registrations(self, entries: list[Registration]) -> Sent:
        """Send ``entries`` to every linked worker, one ``register_adapters`` call each. The calls are submitted
        before this returns (Ray keeps each caller's order on a worker), so they reach every worker ahead
        of any command a later plan sends for those versions; ``registered`` collects their answers."""
        return Sent(entries, [(wid, h.register_adapters.remote(entries)) for wid, h in self.links.handles.items()])

    async def registered(self, sent: Sent) -> list[RankAnswers]:
        """The ranks' answers to ``sent``, per entry: the ranks that refused it (with why) and those that did not
        answer (a worker restarting, or dead: it gets every registration when it is adopted again or restarts)."""
        out = [RankAnswers([], []) for _ in sent.entries]
        answers = await asyncio.gather(*(ref for _, ref in sent.calls), return_exceptions=True)
        for (wid, _), answer in zip(sent.calls, answers):
            if isinstance(answer, BaseException):  # lost: a restarted worker gets them again (worker_started)
                log.warning("worker %s did not answer %d registrations (%s: %s); it gets them when it is adopted "
                            "again or restarts", wid, len(sent.entries), type(answer).__name__, answer)
                for ranks in out:
                    ranks.pending.append(f"{worker_name(wid)}: no answer ({type(answer).__name__}); given it when it "
                                         "is adopted again or restarts")
                continue
            for k, (_, error) in enumerate(answer):
                if error:
                    out[k].refused.append(f"{worker_name(wid)}: {error}")
        for entry, ranks in zip(sent.entries, out):
            for error in ranks.refused:
                log.warning("adapter %s@%s was refused by %s", entry[0], entry[2].version if entry[2] else "?", error)
        return out

    async def drain(self, name: str, timeout_s: float) -> list[str]:
        """Evict ``name`` until no worker holds it; the versions evicted. ConflictError if it is registered
        again meanwhile; TimeoutError after ``timeout_s`` (batches still use it)."""
        deadline, evicted = time.monotonic() + timeout_s, set()
        # every call bounded by the deadline: a stopped (SIGSTOP) worker answers nothing and must not hold the
        # caller past it; one that did not answer counts as holding (it may), so the drain times out naming it
        while held := await self.holders(name, max(deadline - time.monotonic(), 0.05)):
            if name in self.links.core.catalog:
                raise ConflictError(f"adapter {name!r} was registered again while it was being unregistered; "
                                  "unregister it again if that was not intended")
            if time.monotonic() > deadline:
                raise TimeoutError(f"adapter {name!r} is unregistered (nothing new uses it), but workers "
                                   f"{sorted(map(str, held))} still hold it (or did not answer) after "
                                   f"{timeout_s:.0f} s, in use by running batches; call UnregisterAdapter again "
                                   "to keep waiting")
            evicted |= {v for versions in held.values() for v in versions if v}
            await asyncio.gather(*(asyncio.wait_for(
                self.links.handles[w].apply.remote([Evict(name, v, self.links.core.epoch) for v in sorted(vs) if v]),
                max(deadline - time.monotonic(), 0.05)) for w, vs in held.items() if any(vs)),
                return_exceptions=True)
            await asyncio.sleep(0.05)
        return sorted(evicted)

    async def holders(self, name: str, timeout_s: float | None = None) -> dict[WorkerId, set[str]]:
        """The versions of ``name`` that each worker holds, from the workers' own full reports; a worker that
        does not answer within ``timeout_s`` holds ``{""}`` (unknown)."""
        wids = list(self.links.handles)
        reports = await asyncio.gather(*(asyncio.wait_for(self.links.handles[w].describe.remote(), timeout_s)
                                         for w in wids), return_exceptions=True)
        held: dict[WorkerId, set[str]] = {}
        for wid, report in zip(wids, reports):
            if isinstance(report, TimeoutError):  # alive but silent (stopped, hung): it may hold it
                held[wid] = {""}
                continue
            if isinstance(report, BaseException):  # lost: it comes back empty (worker_started)
                log.warning("worker %s did not report while draining %s: %s", wid, name, report)
                continue
            versions = {v for a, v, *_ in report["residency"] if a == name}
            if versions:
                held[wid] = versions
        return held

    async def unregister_adapter(self, name: str) -> None:
        """The workers forget it too, or a restarted controller would adopt it again from their reports."""
        for wid, outcome in await self._every("unregister_adapter", name):
            if isinstance(outcome, BaseException):
                log.warning("worker %s did not unregister %s: %s (a restarted controller may adopt it again)",
                            wid, name, outcome)

    async def drop_pushed(self, name: str, tags: list[str], node: str, area: str) -> None:
        """The ranks on other nodes drop their copies of ``name``'s pushed versions ``tags`` (the controller, on
        ``node`` with its push area at ``area``, retired them: ``Pushes._retire``)."""
        for wid, outcome in await self._every("drop_pushed", name, tags, node, area):
            if isinstance(outcome, BaseException):
                log.warning("worker %s did not drop its copies of %s@%s: %s (they go when it forgets the name)",
                            wid, name, ",".join(tags), outcome)

    async def _every(self, method: str, *args: Any) -> list[tuple[WorkerId, object]]:
        """``method(*args)`` on every linked worker at once, each bounded by the links' call timeout: (worker, its
        answer or its exception)."""
        handles = list(self.links.handles.items())
        outcomes = await asyncio.gather(*(asyncio.wait_for(getattr(h, method).remote(*args), self.links.call_timeout_s)
                                          for _, h in handles), return_exceptions=True)
        return [(wid, outcome) for (wid, _), outcome in zip(handles, outcomes)]

    async def resize_pool(self, replica: str, lent_bytes: int, keep: list[str]) -> list[dict[str, object]]:
        """Every rank of ``replica`` lends ``lent_bytes`` of its GPU pool to its engine in all (issue 43 item 3,
        ``WorkerControl.resize_pool``), in rank order; each rank's answer. A rank that refuses (its free and idle
        pages fall short) or does not answer puts every rank that had answered back as it was, and its error is
        raised. An attached engine's rank is refused before any is asked: its engine lends its own pages."""
        self.links.core.check_replica(replica)
        if lent_bytes < 0:
            raise ConfigError(f"lent_bytes is {lent_bytes}; give the bytes each rank lends in all, >= 0")
        wids = [w for w in sorted(self.links.handles) if w.replica == replica]
        attached = [str(w) for w in wids if w in self.links.attached]
        if attached:
            raise ConfigError(f"ranks {attached} are an attached engine's: its engine lends its own pool's pages "
                              "(cache.lender.give_back in its process), not the operator")
        if not wids:
            raise NotFoundError(f"replica {replica!r} has no rank linked now; try again once it has")
        done: list[tuple[WorkerId, dict[str, object]]] = []
        for wid in wids:
            try:
                answer = await asyncio.wait_for(self.links.handles[wid].resize_pool.remote(lent_bytes, keep),
                                                self.links.call_timeout_s)
            except Exception as e:
                for back, was in reversed(done):  # every rank as it was: a replica lends the same on each rank
                    try:
                        await asyncio.wait_for(self.links.handles[back].resize_pool.remote(was["was_lent_bytes"], []),
                                               self.links.call_timeout_s)
                    except Exception as undo:  # its next full report tells the controller what it holds
                        log.warning("worker %s not put back after a refused resize: %s", back, undo)
                raise getattr(e, "cause", None) or e from None
            done.append((wid, answer))
        return [{"rank": wid.rank, **answer} for wid, answer in done]

    # -- queries ------------------------------------------------------------------------------------
    async def stats(self, timeout_s: float) -> list[dict[str, object]]:
        """Each worker's cache counters (``stats`` None if it did not answer in time) and slot count."""
        wids = sorted(self.links.handles)

        async def one(wid: WorkerId) -> dict[str, object] | None:
            try:
                return await asyncio.wait_for(self.links.handles[wid].stats.remote(), timeout_s)
            except Exception as e:  # reported as unreachable
                log.info("worker %s gave no stats: %s", wid, e)
                return None

        stats = await asyncio.gather(*(one(w) for w in wids))
        view = self.links.core.planner.view  # a replica may have left the fleet while its workers were asked
        known = {w for r in view.replicas() for w in view.workers(r)}
        return [{"worker": worker_name(w), "replica": w.replica, "rank": w.rank,
                 "slots": view.capacity(str(w)).slots, "stats": s} for w, s in zip(wids, stats) if str(w) in known]
