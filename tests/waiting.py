"""Waiting on a condition, the one way every test does it: poll, and on a timeout say what was awaited.

Races are pinned with barriers and events where the code offers them; this is for what only shows from
outside (a Ray actor's state, a gRPC answer, a background thread's counter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str = "condition", timeout: float = 30.0, *, poll_s: float = 0.02,
             detail: Callable[[], str] | None = None) -> T:
    """Poll ``condition`` until it returns a truthy value, and return that value; after ``timeout`` seconds
    fail, naming ``what`` (and ``detail()``, what the system looked like then)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached in {timeout} s" + (f"; {detail()}" if detail else ""))
        time.sleep(poll_s)
    return value
