"""Replicas sharing a GPU (``ServeConfig.gpu_share``): each worker asks Ray for its share of one GPU, so two TP-1
replicas of share 0.5 are placed on a node with one GPU, and a share that does not fit is refused naming the
resources. The cluster declares one GPU (this machine may have none: the workers' ``auto`` device is then the CPU,
and Ray's scheduling of the GPU resource is the thing under test); the bad shares are refused before Ray starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from lora_cache.adapters.catalog import CatalogConfig
from lora_cache.adapters.synth import SynthConfig, make_adapters
from lora_cache.app.serve import ServeConfig, start, wait_ready
from lora_cache.errors import ConfigError
from lora_cache.planner import PlannerConfig
from tests.ray_local import init_local
from tests.waiting import wait_for
from workers.cache import WorkerConfig
from workers.staging.host_config import HostTierConfig


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"gpus": True, "gpu_share": 0.0}, ["gpu_share 0.0", "(0, 1]"]),
    ({"gpus": True, "gpu_share": 1.5}, ["gpu_share 1.5", "(0, 1]"]),
    ({"gpu_share": 0.5}, ["gpu_share 0.5", "--gpus"]),
    ({"gpus": True, "gpu_share": 0.5, "tp": 2}, ["gpu_share 0.5 with tp 2", "NCCL", "--tp 1"]),
])
def test_a_bad_gpu_share_is_refused_naming_the_value_and_the_fix(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        ServeConfig(**kwargs)  # type: ignore[arg-type]
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.ray
def test_two_replicas_of_half_a_gpu_share_one_and_a_third_is_refused(tmp_path: Path) -> None:
    make_adapters(tmp_path, SynthConfig(model="tiny", count=2, rank="8"))
    init_local(num_cpus=2, num_gpus=1, namespace="lora-cache")
    try:
        serve = ServeConfig(adapters=str(tmp_path), replicas=2, gpus=True, gpu_share=0.5, worker_cpus=0.25)
        service = start(serve, CatalogConfig(model="tiny", max_rank=8), PlannerConfig(policy="queue"),
                        WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        try:
            assert ray.available_resources().get("GPU", 0.0) == 0.0  # both halves of the one GPU are taken
            for replica, adapter in (("replica-0", "adapter-000"), ("replica-1", "adapter-001")):
                ray.get(service.controller.report_queue.remote(replica, [(adapter, time.time())]))
                wait_ready(service.controller, adapter, replica, 60)  # each replica serves on its share
        finally:
            service.stop()
        with pytest.raises(ConfigError, match="could not be placed") as e:  # the whole GPU: one replica, not two
            start(ServeConfig(adapters=str(tmp_path), replicas=2, gpus=True, gpu_share=1.0, worker_cpus=0.25,
                              placement_timeout_s=3.0),
                  CatalogConfig(model="tiny", max_rank=8), PlannerConfig(policy="queue"),
                  WorkerConfig(num_slots=2, host=HostTierConfig(host_bytes=1 << 22, pin=False)))
        assert "'GPU': 1.0" in str(e.value)
        wait_for(lambda: ray.available_resources().get("GPU", 0.0) == 1.0, "the refused start's GPU given back")
    finally:
        ray.shutdown()


@pytest.mark.parametrize("kwargs", [{"engine": "sim"}, {"engine": "real", "attach": True}])
def test_the_benchmark_refuses_a_gpu_share_where_ranks_are_not_the_services_worker_actors(
    kwargs: dict[str, object]
) -> None:
    from bench.config import BenchConfig

    with pytest.raises(ConfigError, match=r"--gpu-share 0.5: GPUs shared by replicas are the service's worker actors'"):
        BenchConfig(gpu_share=0.5, **kwargs)  # type: ignore[arg-type]
    assert BenchConfig(engine="real", gpu_share=0.5).gpu_share == 0.5
    for bad in ({"gpu_share": 0.0}, {"gpu_share": 2.0}, {"gpu_share": 0.5, "gpus": "no"}):
        with pytest.raises(ConfigError, match=r"give the share of one GPU each rank asks for, in \(0, 1\]"):
            BenchConfig(engine="real", **bad)  # type: ignore[arg-type]
