"""Start-up time of the router commands (``lora-cache hint|lookup|watch|status|register|unregister``).

Routers and operators run these in scripts, so their start-up is their cost. Each command runs as a
fresh process, ``--repeat`` times, in two ways: ``--help`` (import and parse alone) and one call to a
gateway address where nothing listens (start-up plus a refused connection: what a script pays before
the server's own time). In the same run, for reference: a bare ``python -c pass`` and ``serve --help``
(which builds every parser, so imports torch and Ray). Prints a markdown table of medians and p90s.

    python -m bench.probes.cli_startup --repeat 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

ROUTER = [["hint", "adapter-000", "--replica", "replica-0"], ["lookup", "adapter-000"], ["watch", "--count", "1"],
          ["status"], ["register", "a", "/nonexistent"], ["unregister", "a"]]
UNREACHABLE = ["--server", "127.0.0.1:9", "--timeout-s", "2"]


def _command() -> list[str]:
    script = shutil.which("lora-cache")
    return [script] if script else [sys.executable, "-m", "lora_cache.app.cli"]


def _times(argv: Sequence[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(list(argv), capture_output=True, timeout=120)
        times.append(time.perf_counter() - t0)
    return times


def _row(label: str, times: list[float]) -> str:
    p90 = statistics.quantiles(times, n=10)[-1] if len(times) >= 2 else times[0]
    return f"| {label} | {statistics.median(times) * 1e3:.0f} | {p90 * 1e3:.0f} |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.cli_startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10, help="runs of each command")
    ns = parser.parse_args(argv)
    cli = _command()
    print(f"command: {' '.join(cli)}; {ns.repeat} runs each\n")
    print("| command | median ms | p90 ms |\n| --- | ---: | ---: |")
    print(_row("python -c pass (floor)", _times([sys.executable, "-c", "pass"], ns.repeat)), flush=True)
    for args in ROUTER:
        print(_row(f"{args[0]} --help", _times([*cli, args[0], "--help"], ns.repeat)), flush=True)
        print(_row(f"{args[0]} (refused connection)", _times([*cli, *args, *UNREACHABLE], ns.repeat)), flush=True)
    print(_row("serve --help (torch + Ray, reference)", _times([*cli, "serve", "--help"], ns.repeat)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
