"""The per-step check of invariant 1 under new versions, one way for every engine path and the worked example.

``tests/test_ray_versions.py`` (the hosted engine) and ``tests/test_ray_attach_versions.py`` (the engine on the
public seam) run a TP-2 engine while ``hot`` is re-registered (``tests/test_ray_push.py`` and
``bench/probes/push_loop.py``: while new versions of it are pushed), then hand the run's records and both ranks' step
audits here: every request served, more than one version of ``hot`` served, both ranks ran the same steps with
the same ``adapter@version`` per item, each item computed with the version its request was admitted with, and
each slot held exactly that version's bytes (``expected(directory, name, rank)``: the digest of the rank's shard
read from the directory that version was registered from, ``directory(name, version)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def check_steps(records: Sequence[Any], audits: Sequence[Sequence[Any]], hot: str,
                directory: Callable[[str, str], Path], expected: Callable[[Path, str, int], str]) -> tuple[int, int]:
    """Assert the invariants above; returns (slot digests checked, versions of ``hot`` served)."""
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    served = {r.version for r in records if r.adapter == hot}
    assert len(served) >= 2, f"every request got one version ({served}): no re-registration reached the steps"
    assert len(audits) == 2 and len(audits[0]) == len(audits[1]) > 0, "both ranks ran the same steps"
    version_of = {r.rid: f"{r.adapter}@{r.version}" for r in records if r.adapter is not None}
    checked = 0
    for step0, step1 in zip(*audits):
        assert (step0.kind, step0.rids, step0.keys) == (step1.kind, step1.rids, step1.keys), "ranks mixed versions"
        for rid, key in zip(step0.rids, step0.keys):
            if key:
                assert key == version_of[rid], f"request {rid} computed with {key}, admitted with {version_of[rid]}"
        for rank, step in enumerate((step0, step1)):
            for key, digest in step.digests.items():
                name, version = key.split("@")
                assert digest == expected(directory(name, version), name, rank), (
                    f"rank {rank} computed {key} with other bytes"
                )
                checked += 1
    assert checked > 0
    return checked, len(served)
