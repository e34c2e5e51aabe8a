"""A test module's own local Ray cluster, started as every Ray fixture starts it.

``ray.init(address="local", ...)`` once more if Ray's own node start timed out: the raylet did not register with
the GCS within Ray's fixed 30 s ("The current node timed out during startup", ray-project/ray#62883). Seen once
on the 2-core machine beside a busy loop (2026-11-27: ``test_ray_service``'s raylet wrote no log at all, every
one of the module's tests errored at setup). Nothing of the project runs before that point, so a second start
tests the same thing; any other failure, and a second timeout, raise.
"""

from __future__ import annotations

from typing import Any

import ray

STARTUP_TIMEOUT = "timed out during startup"  # Ray's message when the node's raylet did not register in time


def init_local(**kwargs: Any) -> None:
    """``ray.init(address="local", **kwargs)``, tried twice only if the node's start timed out."""
    try:
        ray.init(address="local", **kwargs)
    except Exception as e:
        if STARTUP_TIMEOUT not in str(e):
            raise
        ray.shutdown()  # whatever the half-started node left registered in this process
        ray.init(address="local", **kwargs)
