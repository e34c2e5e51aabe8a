"""A policy's teardown in the benchmark (``bench.real._teardown``): every step runs even after one fails, the
service's stop above all. A controller left alive under the service's name refused every later policy of a
CI run (2026-11-29): one policy's failed gateway stop skipped its service's stop."""

from __future__ import annotations

import pytest

from bench.real import _teardown


def test_every_step_runs_after_one_fails_and_the_first_failure_is_raised(capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def gateway_stop() -> None:
        ran.append("gateway")
        raise TimeoutError("the gateway did not stop")

    def fleet_stop() -> None:
        ran.append("fleet")
        raise RuntimeError("a rank did not shut down")

    with pytest.raises(TimeoutError, match="the gateway did not stop"):
        _teardown(lambda: ran.append("thaw"), gateway_stop, None, fleet_stop, lambda: ran.append("service"))
    assert ran == ["thaw", "gateway", "fleet", "service"]
    err = capsys.readouterr().err
    assert "gateway_stop failed: TimeoutError" in err and "fleet_stop failed: RuntimeError" in err


def test_a_failing_step_does_not_replace_the_runs_own_error() -> None:
    ran: list[str] = []

    def gateway_stop() -> None:
        raise TimeoutError("the gateway did not stop")

    with pytest.raises(ValueError, match="the run's own error"):
        try:
            raise ValueError("the run's own error")
        finally:
            _teardown(gateway_stop, lambda: ran.append("service"))
    assert ran == ["service"]


def test_nothing_failed_nothing_raised() -> None:
    ran: list[str] = []
    _teardown(lambda: ran.append("a"), None, lambda: ran.append("b"))
    assert ran == ["a", "b"]
