"""A SIGKILLed ``lora-cache serve`` leaves nothing of its embedded Ray cluster running.

Ray's own reaper takes the raylet and the GCS with the driver, but not the agents the raylet started
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``): they outlive a SIGKILLed driver, reparented to init.
``watch_tree`` records every process below this one once the cluster is up (pid and start time, from
/proc) and hands the list to a small watchdog process (``python -m lora_cache.runtime.reaper``) that
waits on a pipe from this one. When the pipe closes (this process exited, however), the watchdog kills
those of them that still run: the same pid with the same start time, so never a process that merely
reused a pid. Linux only (elsewhere it does nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

PROC = Path("/proc")


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if it is gone."""
    try:
        return int((PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (not ``pid`` itself)."""
    children: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def watch_tree() -> subprocess.Popen[bytes] | None:
    """Start the watchdog over this process's descendants; it acts when this process is gone."""
    if not PROC.is_dir():
        return None
    tree = [(p, t) for p in descendants(os.getpid()) if (t := start_time(p)) is not None]
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "lora_cache.runtime.reaper"], stdin=subprocess.PIPE, start_new_session=True
    )  # not in this process's group: a Ctrl-C is for serve
    assert watchdog.stdin is not None
    watchdog.stdin.write(json.dumps(tree).encode() + b"\n")
    watchdog.stdin.flush()  # left open: its end is the signal
    return watchdog


def reap(tree: list[tuple[int, int]]) -> list[int]:
    """SIGKILL those of ``tree`` (pid, start time) that still run as the same process; the pids killed."""
    killed = []
    for pid, started in tree:
        if start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                continue
    return killed


def main(stdin: IO[bytes]) -> None:
    tree = [(int(p), int(t)) for p, t in json.loads(stdin.readline() or b"[]")]
    while stdin.read(4096):  # until the other end is closed
        pass
    reap(tree)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    main(sys.stdin.buffer)
