"""The Ray Serve integration's plain parts, without a cluster: settings that name the value and the fix, and the
one mapping of Serve replica ids to lora-cache replica names that the router and the replicas share.
(The integration on a real Serve app: tests/test_ray_serve.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentID
from ray.serve.request_router import ReplicaID

from lora_cache.errors import ConfigError
from lora_cache.integrations.ray_serve import (
    LoraCacheRouter,
    ReplicaCacheConfig,
    RouterSettings,
    replica_name,
    router_config,
)
from workers.attach import AttachConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"server": "nowhere"}, "is not host:port"),
        ({"hint_timeout_s": 0}, r"hint_timeout_s is 0; give a short positive deadline"),
        ({"hint_timeout_s": 30}, r"hint_timeout_s is 30; give a short positive deadline \(<= 10 s\)"),
        ({"retry_s": -1}, r"retry_s \(-1\) and loading_s \(5.0\) must be >= 0"),
        ({"epsilon": -1}, r"epsilon is -1; give a number >= 0"),
    ],
)
def test_router_settings_name_the_value_and_the_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterSettings(**kwargs)  # type: ignore[arg-type]


def test_replica_config_refuses_what_cannot_attach() -> None:
    with pytest.raises(ConfigError, match=r"tp \(0\) and num_slots \(8\) must be >= 1"):
        ReplicaCacheConfig(tp=0)
    assert ReplicaCacheConfig(tp=2).worker_config(1).tp_rank == 1


@pytest.mark.parametrize("deployment", ["LoraEngine", "my app:v2/llm", "a b"])
def test_a_serve_replica_maps_to_one_valid_lora_cache_replica_name(deployment: str) -> None:
    rid = ReplicaID("abc123xy", DeploymentID(name=deployment, app_name="app"))
    name = replica_name(rid)
    assert name == replica_name(ReplicaID("abc123xy", DeploymentID(name=deployment, app_name="app")))
    assert name.endswith("-abc123xy") and name.startswith("serve-")
    AttachConfig(replica=name)  # a name the attach seam takes (no ':' or '/')
    assert replica_name(ReplicaID("zzz", DeploymentID(name=deployment, app_name="app"))) != name


def test_router_config_names_the_router_class() -> None:
    config = router_config(server="10.0.0.5:50051", hint_timeout_s=0.1)
    assert config.get_request_router_class() is LoraCacheRouter
    assert config.request_router_kwargs["server"] == "10.0.0.5:50051"
