"""The worked example of issue 44 (item 7), run whole: ``bench.probes.push_loop`` on a real local Ray cluster (its
own, in a subprocess), a replica of two CPU ranks, a trainer pushing a version twice a second over gRPC and by Ray
reference while the reference engine serves; the probe checks every step of both ranks against the bytes pushed
(``bench/version_check.py``) and exits non-zero on any failure. Once with each request admitted on the version current
then (requests given up front), once with each submitted as it arrives naming the version one push behind the
newest (``--staleness``: item 3's lagging reader, as an RL trainer's rollouts name the policy step that made them).
Once more so, with every other version pushed from the trainer's buffer (``--via device,ray``: item 5's device push,
READY on both ranks from the image by their doorbells, landed after), requests pinned to versions that may not have
landed yet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("staleness", "via"), [(-1, "grpc,ray"), (1, "grpc,ray"), (1, "device,ray")])
def test_the_push_loop_serves_every_request_on_the_version_it_names_on_both_ranks(tmp_path: Path, staleness: int,
                                                                                   via: str) -> None:
    out, summary = tmp_path / "requests.jsonl", tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "bench.probes.push_loop", "--seconds", "4", "--rate", "10", "--tp",
                           "2", "--push-every", "0.5", "--keep-versions", "2", "--staleness", str(staleness),
                           "--via", via, "--out", str(out), "--summary", str(summary)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "slot digests checked: every step of every rank ran the version its request was admitted with" in \
        proc.stdout, proc.stdout[-3000:]
    doc = json.loads(summary.read_text())
    assert (doc["requests"], doc["failed"], doc["refused"], doc["staleness"]) == (40, 0, 0, staleness)
    pushed = {row["version"]: row["step"] for row in doc["pushes"]}
    assert {row["how"] for row in doc["pushes"][1:]} == set(via.split(",")) and doc["via"] == via.split(",")
    assert len(pushed) >= 3 and doc["served_versions"] >= 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40 and all(r["ok"] for r in rows)
    for r in rows:
        if r["adapter"].startswith("trained"):
            assert r["version"] in pushed, r  # a version the trainer pushed, and under its own step
            assert r["pushed_step"] == pushed[r["version"]]
            if staleness >= 0:  # pinned at the submit: the record names the version it ran on
                assert r["adapter"] == f"trained@{r['version']}", r
