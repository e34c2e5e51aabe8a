"""The Ray fixtures' start (tests/ray_local.py): a second start only after Ray's own node-start timeout."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from tests import ray_local

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


def _recorded(monkeypatch: pytest.MonkeyPatch, failures: list[Exception]) -> list[str]:
    calls: list[str] = []

    def init(**kwargs: Any) -> None:
        calls.append(f"init {kwargs['address']} {kwargs['num_cpus']}")
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    return calls


def test_a_node_start_timeout_is_tried_once_more_after_a_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recorded(monkeypatch, [TIMEOUT])
    ray_local.init_local(num_cpus=2)
    assert calls == ["init local 2", "shutdown", "init local 2"]


def test_a_second_timeout_and_any_other_failure_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recorded(monkeypatch, [TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match="timed out during startup"):
        ray_local.init_local(num_cpus=2)
    assert calls == ["init local 2", "shutdown", "init local 2"]
    calls = _recorded(monkeypatch, [RuntimeError("Maybe you called ray.init twice by accident?")])
    with pytest.raises(RuntimeError, match="twice"):
        ray_local.init_local(num_cpus=2)
    assert calls == ["init local 2"]  # not retried: that is a bug to see, not Ray's start-up
