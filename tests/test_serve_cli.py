"""`lora-cache serve` as a user runs it: embedded Ray, starts, serves, shuts down cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_cache.runtime.ports import free_port
from tests.serving import CLI, make_adapters, serve_argv

pytestmark = pytest.mark.ray


def test_serve_starts_and_stops_cleanly(tmp_path: Path) -> None:
    """As a shell user runs it: adapters made with make-adapters' defaults under a relative path, served
    from the directory that holds it, without --model (the adapters name their base model). A stale
    ``RAY_ADDRESS`` in the shell does not matter: embedded means a cluster of its own (issue 34: it used to
    hang over 150 s in Ray's retries); ``--address auto`` is what follows RAY_ADDRESS."""
    make_adapters("rt/ad", 3, cwd=tmp_path)
    cmd = serve_argv("rt/ad", "--tp", "2", "--duration", "2")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180, env={**os.environ, "RAY_ADDRESS": dead}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "serving base model tiny (from the adapters' base_model_name_or_path" in done.stdout
    assert "lora-cache serving: 2 workers in ['replica-0'], 3 adapters" in done.stdout
    assert "lora-cache gRPC gateway on 127.0.0.1:" in done.stdout
    assert "shutting down" in done.stdout


def test_serve_from_a_store_prefix_takes_the_model_from_the_adapters_configs(tmp_path: Path) -> None:
    """Issue 45 item 3: ``serve --adapters s3://BUCKET/PREFIX`` without ``--model`` serves the base model the
    adapters' configs name, as it does for a directory (it used to stop with "which base model to serve?")."""
    from tests.s3_server import S3Server

    make_adapters(tmp_path / "ad", 3)
    with S3Server() as server:
        server.upload_adapters("serve-bkt", "team", tmp_path / "ad")
        done = subprocess.run(serve_argv("s3://serve-bkt/team", "--duration", "2"), cwd=tmp_path, capture_output=True,
                              text=True, timeout=180, env={**os.environ, **server.env})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "serving base model tiny (from the adapters' base_model_name_or_path" in done.stdout
    assert "lora-cache serving: 1 workers in ['replica-0'], 3 adapters" in done.stdout, done.stdout[-2000:]


def test_serve_demo_is_the_main_job_a_router_over_grpc_until_ready(tmp_path: Path) -> None:
    """The README's main job: demo adapters, the service, and a router's hints/queues/watch over gRPC."""
    cmd = [*CLI, "serve", "--demo", "6", "--replicas", "2", "--tp", "2", "--grpc-port", "0", "--duration", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "made 6 demo adapters (tiny)" in done.stdout
    assert "every hinted (replica, adapter) became ready" in done.stdout
    assert done.stdout.count("  READY adapter-") >= 2 and "shutting down" in done.stdout
    # an orderly shutdown is not a failure: the controller goes first, so it never reports its ranks as lost
    assert "is lost" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]


def test_serve_with_a_bad_option_fails_fast_with_the_fix(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lora_cache.app.cli", "serve", "--adapters", str(tmp_path), "--placement", "DIAGONAL"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "placement 'DIAGONAL' is not one of" in done.stderr
