"""When Ray fails a call to an actor that is restarting (the lifelines' race, CI stop 47).

A restartable actor (``max_restarts=-1``, a concurrency group as the worker's ``lifeline``) holds one long call; the
probe SIGKILLs its process, sends calls at once and every 50 ms until one succeeds, and prints per call when it was
sent and answered (seconds after the kill) and how, beside when the restarted process started. On this 2-core
machine (2026-11-28, Ray 2.60, 5 kills): the call in flight and the first call sent after the kill both failed with
``ActorUnavailableError`` 0.3-0.8 s after the new process had started; so a controller that took such a failure for
a death lost a rank that had restarted and reported meanwhile (``lora_cache/controller/lifelines.py``, ``_death``).

    python -m bench.probes.restart_race [--kills 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import ray


@ray.remote(max_restarts=-1, concurrency_groups={"lifeline": 4})
class _Restartable:
    def __init__(self) -> None:
        self.started = time.time()

    def started_at(self) -> float:
        return self.started

    @ray.method(concurrency_group="lifeline")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="lifeline")
    def hold(self, seconds: float) -> str:
        time.sleep(seconds)
        return "held"


def _one_kill() -> tuple[float, list[tuple[float, float, str]], str]:
    """(the new process's start, the calls' (sent, answered, outcome), the call in flight's outcome), in seconds
    after the kill."""
    actor = _Restartable.remote()  # type: ignore[attr-defined]
    try:
        pid = ray.get(actor.pid.remote())
        in_flight = actor.hold.remote(30.0)
        time.sleep(0.3)
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        calls: list[tuple[float, float, str]] = []
        for _ in range(40):
            sent = time.time() - t_kill
            try:
                ray.get(actor.hold.remote(0.0), timeout=10)
                calls.append((sent, time.time() - t_kill, "ok"))
                break
            except Exception as e:  # the outcome is what the probe reports
                calls.append((sent, time.time() - t_kill, type(e).__name__))
            time.sleep(0.05)
        try:
            ray.get(in_flight, timeout=10)
            flight = "ok"
        except Exception as e:
            flight = type(e).__name__
        return ray.get(actor.started_at.remote()) - t_kill, calls, flight
    finally:
        ray.kill(actor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5, help="how many times to kill and restart the actor")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error(f"--kills is {args.kills}; give 1 or more")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for k in range(args.kills):
            up, calls, flight = _one_kill()
            late = [c for c in calls if c[2] != "ok" and c[1] > up]
            shown = ", ".join(f"sent {s:.3f} answered {a:.3f} {o}" for s, a, o in calls)
            print(f"kill {k}: new process up {up:.3f} s after the kill; in flight: {flight}; {shown}; "
                  f"failures answered after the new process was up: {len(late)}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
