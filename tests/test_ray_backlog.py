"""``serve --adapters s3://... --register background`` on a real local Ray against moto's S3 server (a process of its
own; issue 44 item 6): the service serves once the prefix is listed, an adapter the background registration has not
reached registers on demand at the version a registration gives, every other adapter is read once (one config
request each: no second registration of one registered on demand), and an adapter an operator unregistered is not
registered again by the backlog, nor after a restart; a controller killed mid-way goes on with what was left. Bad
settings are refused before Ray starts."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from lora_cache.adapters.catalog import AdapterCatalog, CatalogConfig  # noqa: E402
from lora_cache.adapters.peft import CONFIG_FILE  # noqa: E402
from lora_cache.adapters.synth import SynthConfig, make_adapters  # noqa: E402
from lora_cache.app.serve import ServeConfig, start  # noqa: E402
from lora_cache.errors import ConfigError, NotFoundError  # noqa: E402
from lora_cache.planner import PlannerConfig  # noqa: E402
from tests.ray_local import init_local  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from workers.cache import WorkerConfig  # noqa: E402
from workers.staging.host_config import HostTierConfig  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
BUCKET = "backlog-bkt"
COUNT = 40


@contextlib.contextmanager
def store_catalog(tmp_path: Path, count: int, record: bool = False) -> Iterator[tuple[S3Server, str, list[str]]]:
    """``count`` tiny adapters in moto's S3 server under ``s3://BUCKET/tenants``, AWS_* set as an operator sets them
    for serve: (the server, the prefix, the adapters' names in listing order)."""
    make_adapters(tmp_path, SynthConfig(model="tiny", count=count, rank="8"))
    with S3Server(record=record) as server:
        server.upload_adapters(BUCKET, "tenants", tmp_path)
        saved = dict(os.environ)
        os.environ.update(server.env)
        try:
            yield server, f"s3://{BUCKET}/tenants", sorted(d.name for d in tmp_path.iterdir())
        finally:
            os.environ.clear()
            os.environ.update(saved)


@contextlib.contextmanager
def background_service(server: S3Server, url: str) -> Iterator[Any]:
    """A local Ray and ``serve --adapters URL --register background``, one read at a time (``store_reads`` 2, a
    quarter kept for requests: the backlog takes seconds); the service's controller. Stopped on the way out."""
    init_local(num_cpus=2, namespace="lora-cache", include_dashboard=False, log_to_driver=False,
               runtime_env={"env_vars": server.env})
    try:
        service = start(ServeConfig(adapters=url, replicas=1, tp=1, register="background"),
                        CatalogConfig(model="tiny", max_rank=16, store_reads=2), PlannerConfig(),
                        WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        try:
            yield service.controller
        finally:
            service.stop()
    finally:
        ray.shutdown()


def test_a_listed_store_catalog_serves_at_once_and_registers_each_adapter_once(tmp_path: Path) -> None:
    with store_catalog(tmp_path, COUNT, record=True) as (server, url, names):
        last = names[-1]  # the version a registration of the last listed adapter gives
        reference = AdapterCatalog(CatalogConfig(adapter_roots=(url,), model="tiny", max_rank=16))
        expected = reference.read(last, f"{url}/{last}").version
        server.forget_requests()
        with background_service(server, url) as controller:
            # the last listed adapter, asked for at once: registered (on demand, unless the backlog came first)
            # at the version a registration of it gives
            assert ray.get(controller.resolve_adapter.remote(last), timeout=60) == expected
            gone = names[3]  # an operator unregisters one: the backlog never brings it back
            ray.get(controller.resolve_adapter.remote(gone), timeout=60)
            ray.get(controller.unregister_adapter.remote(gone), timeout=60)
            wait_for(lambda: ray.get(controller.status.remote())["backlog"]["waiting"] == 0,
                     "the background registration done", 120)
            status = ray.get(controller.status.remote())
            assert status["adapters"] == COUNT - 1, status
            assert ray.get(controller.lookup_adapter.remote(names[0]), timeout=30)["version"]
            with pytest.raises(NotFoundError):
                ray.get(controller.lookup_adapter.remote(gone), timeout=30)
            backlog = status["backlog"]
            assert backlog["failed"] == 0 and backlog["registered"] + backlog["skipped"] == COUNT, backlog
        configs = [path for method, path in server.requests() if method == "GET" and path.endswith(CONFIG_FILE)]
        # one config request per adapter the backlog registered; one asked for while its batch was being read is
        # read by both (the request does not wait for the batch)
        for name in names:
            asked = sum(f"/{name}/" in path for path in configs)
            assert asked == 1 or (name in (last, gone) and asked <= 2), (name, asked)


def _status_or_none(controller: Any) -> dict[str, Any] | None:
    try:
        return ray.get(controller.status.remote(), timeout=5)
    except Exception:  # restarting
        return None


def test_a_restarted_controller_goes_on_with_the_backlog_and_keeps_an_unregistration(tmp_path: Path) -> None:
    """The controller is killed while its background registration waits on a stopped store (SIGSTOP: the batch
    being read cannot end); the restarted one restores the catalog and goes on with what was left, so every listed
    adapter is registered in the end, except one an operator unregistered before the kill."""
    count = 300
    with store_catalog(tmp_path, count) as (server, url, names), background_service(server, url) as controller:
        gone = names[-1]  # queued behind the rest: registered on demand, then unregistered by an operator
        ray.get(controller.resolve_adapter.remote(gone), timeout=60)
        ray.get(controller.unregister_adapter.remote(gone), timeout=60)
        server.pause()  # the batch being read waits on the store
        try:
            before = ray.get(controller.status.remote(), timeout=30)
            assert before["backlog"]["waiting"] > 0, before["backlog"]  # killed mid-way, as meant
            ray.kill(controller, no_restart=False)
        finally:
            server.resume()
        seen: list[dict[str, Any]] = []  # ray.kill is asynchronous: the old process may answer first
        wait_for(lambda: seen.append(_status_or_none(controller) or {}) or
                 seen[-1].get("epoch", before["epoch"]) > before["epoch"], "the controller restarted", 60)
        assert seen[-1]["backlog"]["restored"] > 0, seen[-1]["backlog"]
        wait_for(lambda: (_status_or_none(controller) or {}).get("adapters") == count - 1,
                 "every listed adapter registered but the unregistered one", 120)
        with pytest.raises(NotFoundError):
            ray.get(controller.lookup_adapter.remote(gone), timeout=30)


def test_background_registration_refuses_bad_settings_before_ray_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not one of"):
        ServeConfig(adapters=str(tmp_path), register="later")
    with pytest.raises(ConfigError, match="give --adapters"):
        ServeConfig(register="background")
    worker = WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False))
    with pytest.raises(ConfigError, match="--resolve-s is 0"):
        start(ServeConfig(adapters=str(tmp_path), register="background"),
              CatalogConfig(model="tiny", resolve_s=0), PlannerConfig(), worker)
    with pytest.raises(ConfigError, match="lies under none of"):
        start(ServeConfig(adapters=str(tmp_path), register="background"),
              CatalogConfig(model="tiny", adapter_roots=(str(tmp_path / "elsewhere"),)), PlannerConfig(), worker)
    assert not ray.is_initialized()
