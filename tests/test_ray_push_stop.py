"""Pushed versions live in node memory (``/dev/shm``): an orderly stop of a service on a local Ray of its own, with
no catalog copy, removes them, since nothing could restore the catalog that names them; with a catalog copy (a
service started again restores its registrations) they stay. Each test starts its own cluster through ``start``
(the service owns its Ray), as ``lora-cache serve`` does on one machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from safetensors.torch import load  # noqa: E402

from lora_cache.adapters.catalog import CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import CONFIG_FILE, WEIGHTS_FILE  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.integrations.ray_push import push_in_ray  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
SERVICE = "push-stop"


@pytest.mark.parametrize("copy", [False, True], ids=["no-copy", "catalog-copy"])
def test_an_orderly_stop_removes_pushed_versions_only_where_no_catalog_could_name_them(
        tmp_path: Path, copy: bool) -> None:
    root = tmp_path / "adapters"
    make_adapters(root, SynthConfig(model="tiny", count=2, rank="8"))
    tensors = load((root / "adapter-001" / WEIGHTS_FILE).read_bytes())
    config = json.loads((root / "adapter-001" / CONFIG_FILE).read_text())
    push_dir = tmp_path / "push"
    assert not ray.is_initialized(), "a module before this one left Ray running"
    serve = ServeConfig(adapters=str(root), replicas=1, tp=1, service=SERVICE,
                        catalog_copy=str(tmp_path / "catalog-copy") if copy else "")
    svc = start(serve, CatalogConfig(model="tiny", max_rank=16, push_dir=str(push_dir)), PlannerConfig(),
                WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
    try:
        assert svc.owns_ray
        done = push_in_ray("trained", tensors, config, tag=7)
        pushed = push_dir / SERVICE / "trained" / "7"
        assert (pushed / WEIGHTS_FILE).is_file() and done.tag == "7"
    finally:
        svc.stop()
    assert not ray.is_initialized()
    if copy:  # a service started again restores the catalog from the copy, naming this directory
        assert (pushed / WEIGHTS_FILE).is_file() and (pushed / CONFIG_FILE).is_file()
    else:
        assert not (push_dir / SERVICE).exists(), sorted(p.name for p in (push_dir / SERVICE).rglob("*"))
        assert push_dir.is_dir()  # the root itself may hold other services' pushes: only this service's goes
