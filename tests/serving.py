"""Running `lora-cache` commands as a shell user does, the one way the tests that start `serve` do it.

`serve_argv` spells the command line with the small cache every such test uses (tiny adapters of rank <= 8,
two slots, a 4 MiB host tier, any free gRPC port); `read_until` reads the process's stdout up to a marker line
("lora-cache serving:") and fails with what it printed if the process exits or time runs out.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

CLI = (sys.executable, "-m", "lora_cache.app.cli")
SMALL_CACHE = ("--max-rank", "8", "--slots", "2", "--host-bytes", str(4 << 20), "--grpc-port", "0")


def serve_argv(adapters: str | Path, *more: str) -> list[str]:
    """`lora-cache serve --adapters ADAPTERS` with the small cache, then ``more`` (later options win)."""
    return [*CLI, "serve", "--adapters", str(adapters), *SMALL_CACHE, *more]


def make_adapters(out: str | Path, count: int, rank: int = 8, *, cwd: str | Path | None = None) -> None:
    """`lora-cache make-adapters OUT --count COUNT --rank RANK` in a process of its own (fails with its stderr)."""
    made = subprocess.run(
        [*CLI, "make-adapters", str(out), "--count", str(count), "--rank", str(rank)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr[-2000:]


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float = 60.0) -> list[str]:
    """The process's stdout lines up to the one holding ``marker`` (fails if it exits first)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited {proc.wait()} before {marker!r}: {''.join(lines)}{proc.stderr.read()}")  # type: ignore[union-attr]
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} within {timeout} s: {''.join(lines)}")
