"""The store client's pace (issue 44 item 6): AIMD on requests in flight, backed-off retries of throttled requests
within the call's deadline. The plain core, on CPU; ``tests/test_store.py`` runs it against a real throttling
proxy in front of the real S3-compatible server."""

from __future__ import annotations

import threading
import time

import pytest
from botocore.exceptions import ClientError

from lora_cache.adapters import store_pace
from lora_cache.adapters.store_pace import StorePace, StoreThrottled, throttled


def slow_down(code: str = "SlowDown", status: int = 503) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def test_what_counts_as_a_throttle() -> None:
    assert throttled(slow_down()) and throttled(slow_down("Throttling", 400)) and throttled(slow_down("X", 429))
    assert not throttled(slow_down("NoSuchKey", 404)) and not throttled(OSError("reset"))


def test_a_throttle_halves_the_window_once_per_signal_and_answers_widen_it_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_pace, "BACKOFF_BASE_S", 0.0)
    pace = StorePace(16)
    answers = iter([slow_down(), slow_down(), "ok"])

    def request() -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert pace.paced(request, 5) == "ok"
    assert pace.throttles == 2 and pace.cuts == 1, "two throttles in one moment are one signal"
    assert 8.0 < pace.window < 8.2 and pace.in_flight == 0
    for _ in range(200):
        pace.paced(lambda: None, 5)
    assert pace.window == 16.0, "the window grows back to the pool, never past it"
    time.sleep(store_pace.CUT_S)
    for _ in range(10):
        with pytest.raises(StoreThrottled):
            pace.paced(lambda: (_ for _ in ()).throw(slow_down()), 0)  # no time for a retry
        time.sleep(store_pace.CUT_S)
    assert pace.window == 1.0, "never below one request in flight"


def test_a_request_throttled_past_the_deadline_fails_naming_the_throttle_and_other_errors_pass_at_once() -> None:
    pace = StorePace(4)
    tries = 0

    def always() -> None:
        nonlocal tries
        tries += 1
        raise slow_down()

    start = time.monotonic()
    with pytest.raises(StoreThrottled) as info:
        pace.paced(always, 0.5)
    assert time.monotonic() - start < 0.6 and tries >= 2 and info.value.tries == tries
    assert throttled(info.value.cause)
    with pytest.raises(ClientError, match="NoSuchKey"):
        pace.paced(lambda: (_ for _ in ()).throw(slow_down("NoSuchKey", 404)), 5)
    assert pace.in_flight == 0


def test_no_more_requests_in_flight_than_the_window_and_a_turn_is_not_the_store_s_time() -> None:
    """A request waits for a turn while the window is full, however long (this client's own queue, moving as
    answers come): only the store's own time counts against the call's timeout."""
    pace = StorePace(2)
    entered, release = threading.Barrier(3), threading.Event()

    def held() -> None:
        entered.wait(5)
        release.wait(5)

    threads = [threading.Thread(target=pace.paced, args=(held, 10)) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait(5)  # both in flight: the window is full
    third: list[str] = []
    waiting = threading.Thread(target=lambda: third.append(pace.paced(lambda: "ok", 0.001)))
    waiting.start()
    waiting.join(0.3)  # longer than its timeout: still waiting for its turn, not failed
    assert waiting.is_alive() and pace.in_flight == 2 and not third
    release.set()
    for t in [*threads, waiting]:
        t.join(5)
    assert third == ["ok"] and pace.in_flight == 0
