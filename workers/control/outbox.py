"""What a worker sends the controller on its own (lifecycle steps 1 and 7), shared by the worker actor
and an attached engine process (``workers/attach/attachment.py``).

``Outbox``: numbered residency deltas, pushed in batches by a thread, resent until the controller takes
them (``send``: to the controller actor over Ray by default, ``ControllerReport``; an attached rank's
transport otherwise, ``workers/attach/transport.py``).
``QueueSender``: the latest waiting queue of an engine, sent from a thread that never blocks a step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from lora_cache.errors import ConfigError
from lora_cache.vocab import Delta, DeltaRow, delta_row

log = logging.getLogger(__name__)

LINGER_ENV = "LORA_CACHE_OUTBOX_LINGER_S"
# How long a first delta waits before its batch goes (2 ms; the environment variable may set another, 0 for none).
# A load's deltas come in pairs ("loading", then READY ~1-3 ms later for a device push): sent at once, each is a Ray
# call whose host work takes the GIL from the thread still loading or answering. Measured on one H100 (a device push's
# rank, bench/reports/issue-44.md, "the rank's own part"): 1 voluntary context switch in its launches with the linger,
# 5-8 without, and 0.15-0.25 ms more from its slot to its fill. After the linger both go as one batch, behind the
# push's answer.
LINGER_S = 0.002


class Outbox:
    """Deltas waiting to be pushed to the controller, numbered; a thread sends them in batches.

    Every delta carries this worker's incarnation (its start time) and a sequence number, so the
    controller can tell a restarted worker from its predecessor and notice lost deltas (a gap), which
    it repairs from a full ``describe()``. One batch is in flight at a time: while the controller
    answers, the next batch gathers. A batch the controller did not take is sent again.
    """

    def __init__(self, name: str, flush_s: float, max_pending: int = 100_000,
                 send: Callable[[str, int, list[DeltaRow]], None] | None = None,
                 incarnation: int | None = None, linger_s: float | None = None) -> None:
        self.name, self.flush_s, self.max_pending = name, flush_s, max_pending
        self.linger_s = linger_env() if linger_s is None else linger_s
        self.incarnation = time.time_ns() if incarnation is None else incarnation
        self._deliver = ControllerReport() if send is None else send  # raises when a batch did not go out
        self._cond = threading.Condition()  # protects _pending, seq and _closed
        self._pending: list[DeltaRow] = []
        self.seq = 0  # the last number given to a delta
        self._closed = False
        threading.Thread(target=self._run, name="lora-outbox", daemon=True).start()

    def push(self, delta: Delta) -> None:
        with self._cond:
            self.seq += 1
            if len(self._pending) < self.max_pending:  # bounded: past it, the controller sees a gap
                self._pending.append(delta_row(self.seq, delta))
            self._cond.notify()

    def _run(self) -> None:
        backoff = self.flush_s
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
            if self.linger_s > 0:  # the deltas that follow join this batch (``LINGER_S``), woken by none of them
                time.sleep(self.linger_s)
            with self._cond:
                if self._closed:
                    return
                batch, self._pending = self._pending, []
            sent = self._send(batch)
            with self._cond:
                if not sent:  # keep it, ahead of what came meanwhile, within the bound
                    self._pending = (batch + self._pending)[-self.max_pending:]
                backoff = self.flush_s if sent else min(1.0, max(0.05, 2 * backoff))
                self._cond.wait(backoff)  # gather the next batch (or wait before retrying)

    def _send(self, batch: list[DeltaRow]) -> bool:
        try:
            self._deliver(self.name, self.incarnation, batch)
            return True
        except Exception as e:  # no controller (yet, or restarting), or no link: keep the batch and retry
            log.info("readiness for %d adapters not pushed yet (%s)", len(batch), e)
            return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


def linger_env() -> float:
    """``LINGER_S``, or the seconds ``LORA_CACHE_OUTBOX_LINGER_S`` gives (refused, naming it, if not 0 to 1)."""
    text = os.environ.get(LINGER_ENV, "")
    if not text:
        return LINGER_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise ConfigError(f"{LINGER_ENV}={text!r}: give the seconds a worker's first residency delta waits for the "
                          f"ones after it, 0 to 1 (default {LINGER_S}; 0: none)")
    return value


class ControllerReport:
    """Sends a batch of deltas to the controller actor over Ray (``report``); the handle is found by name
    and found again after a failure (the controller restarting)."""

    def __init__(self) -> None:
        self._controller: Any = None

    def __call__(self, name: str, incarnation: int, batch: list[DeltaRow]) -> None:
        import ray  # here: an engine attached through the gateway never imports Ray

        from lora_cache.vocab import CONTROLLER_NAME

        if not ray.is_initialized():  # shut down in this process: never let a Ray call start a new cluster
            raise ConnectionError("Ray is no longer initialized in this process (ray.shutdown() ran)")
        try:
            if self._controller is None:
                self._controller = ray.get_actor(CONTROLLER_NAME)  # in the service's namespace, the job's
            ray.get(self._controller.report.remote(name, incarnation, batch), timeout=30)
        except Exception:
            self._controller = None
            raise


class QueueSender:
    """Sends the latest waiting queue with ``send(entries)`` on its own thread; stale ones are skipped."""

    def __init__(self, send: Callable[[list[tuple[str, float]]], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._latest: list[tuple[str, float]] | None = None
        self._closed = False
        self.sent = self.errors = 0
        self._thread = threading.Thread(target=self._run, name="lora-queue-report", daemon=True)
        self._thread.start()

    def push(self, entries: list[tuple[str, float]]) -> None:
        with self._cond:
            self._latest = entries
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._latest is not None or self._closed)
                if self._latest is None:
                    return
                entries, self._latest = self._latest, None
            try:
                self._send(entries)
                self.sent += 1
            except Exception:  # the controller restarting: the next report carries the whole queue again
                self.errors += 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
