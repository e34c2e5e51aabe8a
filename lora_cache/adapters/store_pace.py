"""Polite to a throttling store (lifecycle step 0; issue 44 item 6): fewer requests in flight, and backed-off retries.

An object store that is asked too fast answers ``503 SlowDown`` (S3; others say ``Throttling``, ``429``), and
expects the client to slow down. botocore's own retry tries such a request once more after a short backoff, and a
registrar keeping ``store_reads`` requests in flight then failed a batch's adapters one after another
(``AdapterStoreError ... 503 SlowDown``) while the store was only asking it to wait.

``StorePace`` is one client's window of requests in flight, additive increase and multiplicative decrease (TCP's
rule): every answer that is not a throttle widens it by ``1 / window`` (one more request per window's worth of
answers), a throttle halves it (once per ``CUT_S``: a burst of throttles from one crowded moment is one signal),
never below one. ``paced`` runs one request in a turn of the window and, when the store throttles it, waits a
jittered, doubling backoff ("full jitter") and asks again, for as long as the time the store has taken (its answers
and the backoffs) stays within the call's ``--store-timeout-s``; past it, the throttle is the call's error, saying
the store throttled and what to do. The wait for a turn is not counted: it is this client's own queue (32 reads
behind a window of 2 would otherwise fail for waiting on each other, not on the store), and it moves as answers
come, each within its own timeout.
The window starts at the client's pool size (``store_reads``): a store that never throttles is never slowed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException",
    "ProvisionedThroughputExceededException", "ServiceUnavailable", "503", "429",
})  # botocore's throttling codes (retries/standard.py) and the bare statuses S3-compatible stores send
BACKOFF_BASE_S = 0.05  # the first retry waits up to this; each next one up to twice as long
BACKOFF_MAX_S = 2.0  # ... and never longer
CUT_S = 0.1  # throttles within this of a halving are the same signal: the window halves once


def throttled(e: BaseException) -> bool:
    """Whether ``e`` is the store asking the client to slow down (a throttle code, or HTTP 503 / 429)."""
    from botocore.exceptions import ClientError

    if not isinstance(e, ClientError):
        return False
    code = str(e.response.get("Error", {}).get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code in THROTTLE_CODES or status in (503, 429)


class StoreThrottled(Exception):
    """A request the store kept throttling until the call's deadline: ``store.call`` names it to the caller."""

    def __init__(self, cause: BaseException, tries: int, waited_s: float) -> None:
        super().__init__(f"throttled {tries} times, {waited_s:.1f} s of backoff")
        self.cause, self.tries, self.waited_s = cause, tries, waited_s


class StorePace:
    """One store client's window of requests in flight (AIMD) and its throttle counts; thread-safe."""

    def __init__(self, most: int) -> None:
        self.most = most  # the window never grows past this (the client's connection pool)
        self.window = float(most)
        self.in_flight = 0
        self.throttles = 0  # answers that said slow down
        self.cuts = 0  # times the window halved
        self._last_cut = float("-inf")
        self._cond = threading.Condition()

    def paced(self, request: Callable[[], T], timeout_s: float) -> T:
        """``request()`` in a turn of the window, asked again after a backoff while the store throttles it and the
        time the store has taken (its answers and the backoffs, not the wait for a turn: that is this client's own
        queue, and it moves as answers come) stays within ``timeout_s``; raises ``StoreThrottled`` past it, and the
        request's other errors as they are."""
        tries, waited, spent = 0, 0.0, 0.0
        while True:
            self._take()
            start = time.monotonic()
            try:
                answer = request()
            except Exception as e:
                spent += time.monotonic() - start
                if not throttled(e):
                    self._give(ok=True)  # the store answered: no sign it is crowded
                    raise
                self._give(ok=False)
                tries += 1
                delay = random.uniform(0.0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (tries - 1)))
                if spent + delay >= timeout_s:
                    raise StoreThrottled(e, tries, waited) from e
                time.sleep(delay)
                waited += delay
                spent += delay
                continue
            self._give(ok=True)
            return answer

    def _take(self) -> None:
        with self._cond:
            while self.in_flight >= max(1, int(self.window)):
                self._cond.wait()  # each request in flight ends within its own timeout: a turn comes
            self.in_flight += 1

    def _give(self, ok: bool) -> None:
        with self._cond:
            self.in_flight -= 1
            if ok:
                self.window = min(float(self.most), self.window + 1.0 / self.window)
            else:
                self.throttles += 1
                now = time.monotonic()
                if now - self._last_cut >= CUT_S:
                    self.window, self._last_cut = max(1.0, self.window / 2), now
                    self.cuts += 1
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"window": self.window, "in_flight": self.in_flight, "throttles": self.throttles,
                    "cuts": self.cuts}
