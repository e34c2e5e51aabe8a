"""``bench.run`` with the controller's reported host copies left out of routing: what routing by them is worth.

The same command line as ``python -m bench.run`` (any engine, router, store); only ``ControllerCore.route`` passes
``hosted=False`` to the advice, so a replica counts as STAGED for an adapter only where a stage for a known request
was sent, never for a shard its ranks reported in their host tiers (issue 42 item 4; bench/reports/issue-42.md,
"host tiers reported").

    python -m bench.probes.host_copies --engine sim --store device --router lora-cache --policies global --out DIR
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import lora_cache.controller.core as core
from bench.run import main as bench_main


def main(argv: Sequence[str] | None = None) -> int:
    advise = core.advise

    def without_host_copies(*args: Any, **kwargs: Any) -> Any:
        return advise(*args, **{**kwargs, "hosted": False})

    core.advise = without_host_copies  # type: ignore[assignment]
    try:
        return bench_main(argv)
    finally:
        core.advise = advise  # type: ignore[assignment]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
