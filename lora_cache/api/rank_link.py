"""The gateway's side of one ``AttachRank`` stream (docs/integrating.md, "Outside the Ray cluster"): an
engine process outside the Ray cluster attaches one TP rank, and the gateway stands in for it there.

``RankLink.run`` is the whole life of one stream, plain asyncio over a ``RankHost`` (what it needs of the
cluster; ``lora_cache/api/rank_host.py`` is the Ray one):

1. the first message must be an ``AttachHello``; it is checked (``check_hello``), the controller's
   catalog config fetched and the rank's model checked against it, and only then the rank's endpoint
   made under its worker name; ``Attached`` (the catalog config) goes down;
2. the controller adopts the rank (``worker_started(adopt=True)``: it describes the rank through the
   endpoint, so the pump must already run); ``RankAdopted`` goes down;
3. the pump takes the endpoint's calls on the process's behalf (``Relay.take(alive=False)``) and sends
   each down as a ``RelayedCall``; each ``CallAnswer`` goes to ``Relay.answer``; ``RankAlive`` is a sign
   of life (so a process that stops serving is still a dead rank after ``liveness_s``); deltas go to the
   controller's ``report``;
4. the stream's end, however it ends (the engine detached, its process died, bad input, the gateway
   stopping), makes the rank leave: ``worker_detached``, then the endpoint is killed.

Bad input ends this stream only, with a ``RequestError`` naming the thing, the value and the fix (the
servicer answers INVALID_ARGUMENT); other ranks' streams are untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.api import relay_codec as codec
from lora_cache.api import validate
from lora_cache.api.callers import check_speaks_for
from lora_cache.api.v1 import lora_cache_service_pb2 as pb
from lora_cache.api.validate import RequestError
from lora_cache.controller.core import MAX_SLOTS, MAX_TP
from lora_cache.errors import ConfigError, ConflictError
from lora_cache.vocab import WorkerId, worker_name

log = logging.getLogger(__name__)

POLL_S = 1.0  # the pump's long poll of the endpoint
MAX_NAME_WAIT_S = 60.0  # a hello waits at most this long for a dead predecessor's name
MAX_START_S = 600.0  # liveness_s and start_s of a hello at most
_OPENING: set[str] = set()  # worker names a hello is waiting for now: one hello at a time per name
_END = object()  # the engine closed its side of the stream
_LEAVING: set[asyncio.Future[None]] = set()  # ranks leaving (worker_detached, endpoint killed), until done


class RankHost(Protocol):
    """What a link needs of the cluster for one rank (``lora_cache/api/rank_host.py``: Ray)."""

    service: str  # the service's name (its Ray namespace), told to the rank in ``Attached``

    async def catalog(self) -> CatalogConfig: ...
    async def open(self, hello: pb.AttachHello) -> None: ...  # make the endpoint (ConflictError if taken)
    async def adopt(self, hello: pb.AttachHello) -> None: ...  # worker_started(adopt=True)
    async def take(self, timeout_s: float) -> list[codec.Call]: ...  # the endpoint's calls, not a sign of life
    async def answer(self, results: list[tuple[int, bool, Any]]) -> None: ...  # [] is a sign of life
    async def report(self, incarnation: int, batch: list[codec.DeltaRow]) -> None: ...
    async def leave(self, hello: pb.AttachHello) -> None: ...  # worker_detached, kill the endpoint


def check_hello(first: pb.AttachRankRequest) -> pb.AttachHello:
    """The stream's first message, if it is a well-formed hello."""
    kind = first.WhichOneof("message")
    if kind != "hello":
        raise RequestError(f"the first message of an AttachRank stream must be an AttachHello, not {kind!r}; send "
                           "AttachRankRequest(hello=AttachHello(replica, rank, tp, num_slots, ...)) first")
    h = first.hello
    validate.name("replica", h.replica, " in the AttachHello")
    if not 1 <= h.tp <= MAX_TP:
        raise RequestError(f"tp is {h.tp} in the AttachHello of replica {h.replica!r}; give 1 to {MAX_TP} "
                           "(WorkerConfig(tp=...))")
    if h.rank >= h.tp:
        raise RequestError(f"rank {h.rank} of replica {h.replica!r} is not below tp {h.tp}; a TP rank is 0..tp-1 "
                           "(WorkerConfig(tp=..., tp_rank=...))")
    if not 1 <= h.num_slots <= MAX_SLOTS:
        raise RequestError(f"num_slots is {h.num_slots} for rank {h.rank} of {h.replica!r}; give 1 to {MAX_SLOTS}")
    if h.name_wait_s > MAX_NAME_WAIT_S or h.start_s > MAX_START_S:
        raise RequestError(f"name_wait_s ({h.name_wait_s:g}) must be at most {MAX_NAME_WAIT_S:g} s and start_s "
                           f"({h.start_s:g}) at most {MAX_START_S:g} s, for rank {h.rank} of {h.replica!r}")
    if h.incarnation < 1:
        raise RequestError(f"incarnation {h.incarnation} of rank {h.rank} of {h.replica!r} must be the rank's start "
                           "time in ns (time.time_ns())")
    if not 0 < h.liveness_s <= h.start_s or h.name_wait_s < 0:
        raise RequestError(f"liveness_s ({h.liveness_s}) must be > 0 and <= start_s ({h.start_s}), name_wait_s "
                           f"({h.name_wait_s}) >= 0, for rank {h.rank} of {h.replica!r}; AttachConfig sends valid ones")
    return h


def check_report(h: pb.AttachHello, name: str, report: dict[str, Any]) -> None:
    """A rank's full report (its answer to ``describe``) must be the rank its hello declared, within its shape:
    the controller adopts the replica's shape from it."""
    said = {"replica": h.replica, "rank": h.rank, "tp": h.tp, "slots": h.num_slots, "incarnation": h.incarnation}
    for field, value in said.items():
        if report.get(field) != value:
            raise RequestError(f"{name}: its report says {field} {validate.show(report.get(field))}, but its hello "
                               f"said {value!r}; report the rank the hello declared")
    if len(report.get("residency", ())) > h.num_slots:
        raise RequestError(f"{name}: its report holds {len(report['residency'])} adapters in {h.num_slots} slots; "
                           "report at most one adapter per slot")


def check_model(h: pb.AttachHello, model: str) -> None:
    if h.model and h.model != model:
        raise ConfigError(f"rank {h.rank} of replica {h.replica!r} serves model {h.model!r} but the controller plans "
                          f"for {model!r}; attach with the service's model (or no catalog: it takes the controller's)")


class RankLink:
    """One AttachRank stream: ``run(requests)`` yields the messages down (see the module docstring)."""

    def __init__(self, host_for: Callable[[str], RankHost], poll_s: float = POLL_S) -> None:
        self.host_for, self.poll_s = host_for, poll_s
        self.pending: dict[int, str] = {}  # call id -> method, of calls sent down and not answered yet
        self.answered = self.reported = 0
        self._out: asyncio.Queue[Any] = asyncio.Queue()  # messages down, an exception, or _END
        self.hello: pb.AttachHello | None = None  # the rank's hello, once its endpoint is made

    async def run(self, requests: AsyncIterator[pb.AttachRankRequest]) -> AsyncIterator[pb.AttachRankResponse]:
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            raise RequestError("the AttachRank stream ended before its AttachHello; send the hello first") from None
        hello = check_hello(first)
        check_speaks_for(hello.replica, "AttachRank", hello.rank)  # before anything is made for it
        name = worker_name(WorkerId(hello.replica, hello.rank))
        host = self.host_for(name)
        catalog = await host.catalog()  # NotFoundError without a controller; nothing made yet
        model = catalog.shape().name
        check_model(hello, model)
        if name in _OPENING:
            raise ConflictError(f"another AttachHello for {name} is waiting for that name already; one hello at a "
                                "time per rank (detach the rank that holds it, or attach another rank)")
        _OPENING.add(name)
        try:
            await host.open(hello)  # ConflictError: the rank is attached already (after name_wait_s)
        finally:
            _OPENING.discard(name)
        self.hello = hello
        tasks: list[asyncio.Task[None]] = []
        try:
            yield pb.AttachRankResponse(attached=codec.attached(catalog, model, name, host.service))
            tasks = [asyncio.ensure_future(f) for f in (self._read(requests, host, name), self._pump(host),
                                                         self._adopt(host, hello))]
            while (item := await self._out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            leave = asyncio.ensure_future(host.leave(hello))  # shielded: the stream may be ending by cancellation
            _LEAVING.add(leave)  # held until done, even if this stream's task is cancelled meanwhile
            leave.add_done_callback(_LEAVING.discard)
            await asyncio.shield(leave)

    async def _adopt(self, host: RankHost, hello: pb.AttachHello) -> None:
        try:
            await host.adopt(hello)
            self._out.put_nowait(pb.AttachRankResponse(adopted=pb.RankAdopted()))
        except Exception as e:  # the controller's refusal (ConfigError: another TP size, slot count, model)
            self._out.put_nowait(e)

    async def _pump(self, host: RankHost) -> None:
        try:
            while True:
                for c in await host.take(self.poll_s):
                    self.pending[c[0]] = c[1]  # before it goes down: its answer can only come after
                    self._out.put_nowait(pb.AttachRankResponse(call=codec.call(c)))
        except Exception as e:  # the endpoint died (killed, or the cluster lost it)
            self._out.put_nowait(ConnectionError(f"the rank's endpoint in the cluster is gone ({e}); attach again"))

    async def _read(self, requests: AsyncIterator[pb.AttachRankRequest], host: RankHost, name: str) -> None:
        try:
            async for message in requests:
                await self.upstream(message, host, name)
            self._out.put_nowait(_END)  # the engine detached
        except Exception as e:
            self._out.put_nowait(e)

    async def upstream(self, message: pb.AttachRankRequest, host: RankHost, name: str) -> None:
        """One message from the engine after its hello."""
        kind = message.WhichOneof("message")
        if kind == "answer":
            ident = message.answer.call_id
            method = self.pending.pop(ident, None)
            if method is None:
                raise RequestError(f"{name}: an answer for call {ident}, which is not in flight on this stream "
                                   f"({len(self.pending)} are); answer each RelayedCall once, with its call_id")
            answer = codec.from_answer(message.answer, method)
            if method == "describe" and answer[1] and self.hello is not None:
                check_report(self.hello, name, answer[2])
            await host.answer([answer])
            self.answered += 1
        elif kind == "alive":
            await host.answer([])
        elif kind == "deltas":
            incarnation, batch = codec.from_deltas(message.deltas)
            try:
                await host.report(incarnation, batch)
                self.reported += len(batch)
            except Exception as e:  # the controller restarting: lost deltas are a gap, repaired by a resync
                log.info("%s: %d deltas not reported (%s); the controller resyncs the rank", name, len(batch), e)
        elif kind == "hello":
            raise RequestError(f"{name}: a second AttachHello on its stream; send the hello once, first (a new "
                               "incarnation of the rank opens a new stream)")
        else:
            raise RequestError(f"{name}: an AttachRankRequest with no message ({kind!r}); send hello, answer, "
                               "deltas or alive")
