"""The per-step check of invariant 1 under new versions, one way for every engine path and the worked example.

``tests/test_ray_versions.py`` (the hosted engine) and ``tests/test_ray_attach_versions.py`` (the engine on the
public seam) run a TP-2 engine while ``hot`` is re-registered (``tests/test_ray_push.py`` and
``bench/probes/push_loop.py``: while new versions of it are pushed), then hand the run's records and every rank's step
audits here: every request served, more than one version of ``hot`` served, every rank ran the same steps with
the same ``adapter@version`` per item, each item computed with the version its request was admitted with, and
each slot held exactly that version's bytes (``expected(directory, name, rank)``: the digest of the rank's shard
read from the directory that version was registered from, ``directory(name, version)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lora_cache.adapters.refs import base_name


def check_steps(records: Sequence[Any], audits: Sequence[Sequence[Any]], hot: str,
                directory: Callable[[str, str], Path], expected: Callable[[Path, str, int], str]) -> tuple[int, int]:
    """Assert the invariants above; returns (slot digests checked, versions of ``hot`` served)."""
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    served = {r.version for r in records if r.adapter and base_name(r.adapter) == hot}  # ``A`` or a pinned ``A@V``
    assert len(served) >= 2, f"every request got one version ({served}): no re-registration reached the steps"
    assert audits and all(len(a) == len(audits[0]) > 0 for a in audits), "every rank ran the same steps"
    version_of = {r.rid: f"{base_name(r.adapter)}@{r.version}" for r in records if r.adapter is not None}
    checked = 0
    for steps in zip(*audits):
        step0 = steps[0]
        assert all((s.kind, s.rids, s.keys) == (step0.kind, step0.rids, step0.keys) for s in steps), (
            "ranks mixed versions")
        for rid, key in zip(step0.rids, step0.keys):
            if key:
                assert key == version_of[rid], f"request {rid} computed with {key}, admitted with {version_of[rid]}"
        for rank, step in enumerate(steps):
            for key, digest in step.digests.items():
                name, version = key.split("@")
                assert digest == expected(directory(name, version), name, rank), (
                    f"rank {rank} computed {key} with other bytes"
                )
                checked += 1
    assert checked > 0
    return checked, len(served)
