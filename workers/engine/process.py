"""The reference engine in a process of its own, attached to lora-cache through the seam (``workers/attach/``).

This is how an external engine runs with lora-cache: the process is started by whoever runs the engine
(here ``EngineProcess``, a ``spawn``ed child; vLLM or SGLang would start their own), joins the Ray
cluster, attaches as rank k of a replica, and steps the reference engine (``HostedEngine``, the very
code a worker actor hosts) over the attachment's cache. The parent drives it over a pipe: one call at a
time, in order (``build``, ``run``, ``step``, ``stats``, ``load_log``, ``preload``, ``detach``). A
streaming run's requests go over a second pipe, the feed (``submit``, ``end_stream``: a reader thread in
the child hands them to the engine's ``Feed`` while ``run`` is busy); the ids of finished requests come
back on it (``finished``), sent by a relay thread for the run's length.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.errors import LoraCacheError
from lora_cache.runtime import heap
from workers.attach.attachment import AttachConfig, attach
from workers.cache import WorkerConfig
from workers.engine.config import EngineConfig
from workers.engine.engine import EngineResult
from workers.engine.hosted import HostedEngine, Rendezvous
from workers.engine.workload import Request
from workers.gpu.streams import resolve_device

START_TIMEOUT_S = 300.0  # import torch and Ray, join the cluster, attach


class EngineProcessError(LoraCacheError, RuntimeError):
    """The engine process failed a call (its traceback is in the message) or died."""


class _Rank:
    """The child's side: one attached rank and the reference engine over its cache."""

    def __init__(self, attach_config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig | None = None,
                 feed: Connection | None = None) -> None:
        self.feed = feed  # the feed pipe (None: no streaming runs)
        self._feed_send = threading.Lock()  # protects sends on ``feed`` (the reader's errors, the relay's ids)
        self.loads: deque[tuple[float, Any]] = deque(maxlen=4096)
        device = resolve_device(worker.device)
        compute = None
        if device.type == "cuda":  # this process's device, and the stream its steps run on (the engine's)
            torch.cuda.set_device(device)
            compute = torch.cuda.Stream(device)
        self.rank = attach(attach_config, worker, catalog, compute_stream=compute,
                           on_ready=lambda r: self.loads.append((time.time(), r)))  # wall clock: across processes
        self.engine = HostedEngine(self.rank)  # the public seam: what any integrator's engine calls
        heap.freeze()

    def build(self, config: EngineConfig, meet: Rendezvous) -> None:
        self.engine.build(config, meet, self.rank.worker.tp_rank)

    def run(self, requests: list[Request], start_wall: float, inflight: int = 0, report_queue: bool = False,
            streaming: bool = False) -> EngineResult:
        relay = None
        if streaming:  # the finished ids go back over the feed while the engine runs
            relay = threading.Thread(target=self._relay_finished, name="engine-finished", daemon=True)
            relay.start()
        try:
            send = self.rank.report_queue if report_queue else None
            return HostedEngine.strip(self.engine.run(requests, start_wall, inflight, send, streaming))
        finally:
            self.engine.close()
            if relay is not None:
                if self.engine.feed is not None:
                    self.engine.feed.stop()  # the run failed before its loop: end the relay's poll too
                relay.join(timeout=30)
            heap.freeze()

    def read_feed(self) -> None:
        """The feed's reader thread: submitted requests and the end of stream, to the engine's ``Feed``."""
        assert self.feed is not None
        while True:
            try:
                op, arg = self.feed.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            try:
                self.engine.submit(arg) if op == "submit" else self.engine.end_stream()
            except BaseException as e:  # the parent's next ``finished`` raises it
                self._send_feed(("error", f"{type(e).__name__}: {e}"))

    def _relay_finished(self) -> None:
        while True:
            rids = self.engine.finished(1.0)
            if rids:
                self._send_feed(("finished", rids))
            if rids is None:
                self._send_feed(("finished", None))
                return

    def _send_feed(self, message: tuple[str, Any]) -> None:
        assert self.feed is not None
        with self._feed_send, contextlib.suppress(OSError, BrokenPipeError):
            self.feed.send(message)

    def step(self, adapters: list[str]) -> list[int]:
        """An engine step's cache calls alone (acquire, then release): the slots the batch ran on."""
        batch = self.rank.acquire(adapters)
        self.rank.release(batch)
        self.rank.check_integrity()
        return list(batch.slots)

    def preload(self, names: list[str], timeout_s: float = 600.0) -> int:
        for name in names:
            self.rank.prefetch(name).result(timeout=timeout_s)
        return len(names)

    def stats(self) -> dict[str, object]:
        return self.rank.control.stats()

    def seam(self) -> dict[str, object]:
        """The attachment's own figures: controller calls served (and failed), and why it was lost, if it was."""
        served = self.rank.served
        lost = None if served.lost is None else str(served.lost)
        return {"calls": served.calls, "errors": served.errors, "lost": lost}

    def residency(self) -> list[dict[str, object]]:
        return self.rank.residency()

    def load_log(self) -> list[tuple[float, Any]]:
        return list(self.loads)

    def detach(self) -> None:
        self.rank.detach()


def _child(conn: Connection, attach_config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig | None,
           feed: Connection | None = None) -> None:
    try:
        rank = _Rank(attach_config, worker, catalog, feed)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    if feed is not None:
        threading.Thread(target=rank.read_feed, name="engine-feed", daemon=True).start()
    conn.send(("ok", os.getpid()))
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the parent is gone: leave like a detach
            rank.detach()
            return
        try:
            conn.send(("ok", getattr(rank, op)(*args)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        if op == "detach":
            return


class EngineProcess:
    """The parent's handle on one engine rank running in its own process (``spawn``: a fresh interpreter,
    its own device context). ``call`` blocks; ``submit`` runs a call on this process's own thread, so
    the parent can drive every rank at once (a replica's ranks build and run together)."""

    def __init__(self, attach_config: AttachConfig, worker: WorkerConfig, catalog: CatalogConfig | None = None,
                 timeout_s: float = START_TIMEOUT_S) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._feed, child_feed = ctx.Pipe()  # a streaming run's requests in, finished ids out
        self.name = f"{attach_config.replica}/{worker.tp_rank}"
        self.process = ctx.Process(target=_child, args=(child, attach_config, worker, catalog, child_feed),
                                   name=f"lora-engine-{self.name}", daemon=True)
        self.process.start()
        child.close()
        child_feed.close()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.name}")
        self.pid = self._answer(timeout_s)

    def _answer(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise EngineProcessError(f"engine {self.name} did not answer within {timeout_s:.0f} s")
        return self._receive(self._conn, "")

    def _receive(self, conn: Connection, refused: str) -> Any:
        """The next (kind, value) message on ``conn`` (one is waiting): its value, or ``EngineProcessError``
        for an "error" message (``refused`` prefixes its text) or a dead process."""
        try:
            kind, value = conn.recv()
        except EOFError as e:
            raise EngineProcessError(f"engine {self.name} died (exit code {self.process.exitcode})") from e
        if kind == "error":
            raise EngineProcessError(f"engine {self.name}{refused}: {value}")
        return value

    def call(self, op: str, *args: Any, timeout_s: float = 600.0) -> Any:
        self._conn.send((op, args))
        return self._answer(timeout_s)

    def submit(self, op: str, *args: Any, timeout_s: float = 3600.0) -> Future[Any]:
        return self._thread.submit(self.call, op, *args, timeout_s=timeout_s)

    # -- a streaming run's feed: ``submit``/``end_stream`` from one thread, ``finished`` from one other ----
    def submit_requests(self, requests: list[Request]) -> None:
        self._feed.send(("submit", requests))

    def end_stream(self) -> None:
        self._feed.send(("end", None))

    def finished(self, timeout_s: float = 1.0) -> list[int] | None:
        """Request ids done since the last call (waits up to ``timeout_s``; [] if none); None once the run
        is over. A submit the engine refused raises here."""
        if not self._feed.poll(timeout_s):
            return []
        return self._receive(self._feed, " refused submitted requests")  # type: ignore[no-any-return]

    def kill(self) -> None:
        """SIGKILL: the process dies without detaching (what a crash looks like to lora-cache)."""
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=30)
        self._thread.shutdown(wait=False)

    def close(self, timeout_s: float = 60.0) -> None:
        """Detach, then let the process end (killed if it does not)."""
        if self.process.is_alive():
            with contextlib.suppress(EngineProcessError, OSError, BrokenPipeError):
                self.call("detach", timeout_s=timeout_s)
            self.process.join(timeout=timeout_s)
        self.kill()


def start_ranks(attach_config: Callable[[int], AttachConfig], workers: list[WorkerConfig],
                catalog: CatalogConfig | None = None, timeout_s: float = START_TIMEOUT_S) -> list[EngineProcess]:
    """Start one engine process per ``workers`` entry at once (``attach_config(rank)`` for each); all or none."""
    with ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(EngineProcess, attach_config(w.tp_rank), w, catalog, timeout_s) for w in workers]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for proc in started:
            proc.close()
        raise failed[0]  # type: ignore[misc]
    return started
