"""deploy/: the cluster configs pass Ray's own checks, the way `ray up` runs them before it touches a machine
(a typo'd key or a wrong type fails with Ray's message); their start commands pass options lora-cache
accepts, after Ray is up; Ray's token goes to every node on purpose; the benchmark's runtime env is valid
and uploads only the sources. And `lora-cache serve` fails fast, with the fix, where it cannot join."""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config  # test-only private Ray: see below

from lora_cache.api.gateway import GatewayConfig
from lora_cache.app.cli import build_parser
from lora_cache.app.serve import ServeConfig
from lora_cache.runtime.cliargs import config_from_args
from lora_cache.runtime.cluster import ClusterAuthError, ClusterUnreachableError, connect
from lora_cache.runtime.ports import free_port

# Private Ray, test-only (issue 45): what `ray up` and `ray job submit` do with deploy/'s files, which the service
# never calls; no public API runs Ray's config checks or its working_dir packaging.
REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
CLUSTER_CONFIGS = sorted(p.name for p in DEPLOY.glob("*.yaml") if "provider" in yaml.safe_load(p.read_text()))
SERVICE = "start-service.sh start"


def load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / name).read_text()))


def ray_up_checks(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` checks before any cloud or SSH call (commands._bootstrap_config): the provider's defaults
    and node types filled in (prepare_config; the local provider's head_ip/worker_ips), then ray-schema.json
    (validate_config). It raises Ray's own errors."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_both_fleets_ship_a_config() -> None:
    assert {"onprem.yaml", "aws-gpu.yaml"} <= set(CLUSTER_CONFIGS)
    assert load("onprem.yaml")["provider"]["type"] == "local" and load("aws-gpu.yaml")["provider"]["type"] == "aws"


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_config_passes_rays_own_validation(name: str) -> None:
    prepared = ray_up_checks(load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_onprem_config_names_head_workers_and_ssh_user() -> None:
    config = load("onprem.yaml")
    assert config["provider"]["head_ip"] and config["provider"]["worker_ips"] and config["auth"]["ssh_user"]
    node_type = ray_up_checks(config)["available_node_types"]["local.cluster.node"]
    assert node_type["max_workers"] == len(config["provider"]["worker_ips"])  # every listed machine joins


def test_aws_config_autoscales_gpu_node_types() -> None:
    types = ray_up_checks(load("aws-gpu.yaml"))["available_node_types"]
    gpu = {k: v for k, v in types.items() if k != "head"}
    assert gpu and all(v["max_workers"] >= max(1, v["min_workers"]) for v in gpu.values())
    assert sum(v["min_workers"] for v in gpu.values()) >= 1  # the service's replicas have somewhere to go


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(config: dict[str, Any]) -> None:
        *parents, key = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[key] = value

    return mutate


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(config: dict[str, Any]) -> None:
        *parents, key = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        del node[key]

    return mutate


BROKEN = [  # (config, change, Ray's message)
    ("onprem.yaml", _set("file_mount", {}), "Additional properties are not allowed ('file_mount' was unexpected)"),
    ("onprem.yaml", _set("auth.ssh_usr", "ubuntu"), "Additional properties are not allowed ('ssh_usr' was unexpected)"),
    ("onprem.yaml", _set("idle_timeout_minutes", "five"), "'five' is not of type 'number'"),
    ("onprem.yaml", _set("provider.worker_ips", "10.0.0.11"), "'10.0.0.11' is not of type 'array'"),
    ("onprem.yaml", _set("worker_start_ray_commands", "ray start"), "'ray start' is not of type 'array'"),
    ("aws-gpu.yaml", _set("max_worker", 4), "Additional properties are not allowed ('max_worker' was unexpected)"),
    ("aws-gpu.yaml", _set("available_node_types.gpu-4x-l40s.min_worker", 1),
     "Additional properties are not allowed ('min_worker' was unexpected)"),
    ("aws-gpu.yaml", _set("available_node_types.gpu-4x-l40s.max_workers", "four"), "'four' is not of type 'integer'"),
    ("aws-gpu.yaml", _drop("available_node_types.head.resources"), "'resources' is a required property"),
    ("aws-gpu.yaml", _set("provider.security_group.IpRules", []),
     "Additional properties are not allowed ('IpRules' was unexpected)"),
]


@pytest.mark.parametrize(("name", "change", "message"), BROKEN, ids=[m for _, _, m in BROKEN])
def test_a_typo_or_a_wrong_type_fails_with_rays_message(name: str, change: Callable[[dict[str, Any]], None],
                                                       message: str) -> None:
    config = load(name)
    change(config)
    with pytest.raises(jsonschema.ValidationError) as raised:
        ray_up_checks(config)
    assert message in str(raised.value)


def test_onprem_without_head_ip_fails_with_rays_message() -> None:
    import click

    config = load("onprem.yaml")
    del config["provider"]["head_ip"]
    with pytest.raises(click.ClickException, match="Please supply a `head_ip` and list of `worker_ips`"):
        ray_up_checks(config)


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_ray_token_auth_is_on_for_every_node_and_the_token_goes_to_each(name: str) -> None:
    config = load(name)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # setup_commands run on every node (head and workers) before its `ray start`; Ray's SSH runner sources
    # ~/.bashrc before each later command, so every Ray process there runs with RAY_AUTH_MODE=token
    assert "echo 'export RAY_AUTH_MODE=token' >> ~/.bashrc" in config["setup_commands"][0]


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_the_head_starts_ray_on_the_operators_redis_only_when_one_is_set(name: str, tmp_path: Path) -> None:
    """Issue 46 item 5: the head's `ray start` runs, in bash as Ray's SSH runner runs it, against a `ray` that
    prints its environment and arguments. With LORA_CACHE_GCS_REDIS (as head_setup_commands exports it) the GCS
    is pointed at that Redis, under the cluster's own namespace, with the password if one is set; without it (the
    configs' default: empty) nothing of Redis reaches Ray."""
    config = load(name)
    (command,) = [c for c in config["head_start_ray_commands"] if "ray start --head" in c]
    setup = " ".join(config["head_setup_commands"])
    assert "echo 'export LORA_CACHE_GCS_REDIS=' >> ~/.bashrc" in setup, "the setting (off) is not where it is said"
    fake = tmp_path / "ray"
    fake.write_text('#!/bin/sh\necho "addr=${RAY_REDIS_ADDRESS-unset} ns=${RAY_external_storage_namespace-unset}"\n'
                    'echo "args=$*"\n')
    fake.chmod(0o755)

    def run(**env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "LORA_CACHE_GCS"))}
        done = subprocess.run(["bash", "-c", command.replace("ulimit -n 65536;", "")], capture_output=True, text=True,
                              env={**clean, "PATH": f"{tmp_path}:{clean['PATH']}", **env}, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    off = run(LORA_CACHE_GCS_REDIS="")
    assert "addr=unset ns=unset" in off and "redis" not in off.split("args=")[1], off
    on = run(LORA_CACHE_GCS_REDIS="10.0.0.5:6379", LORA_CACHE_GCS_REDIS_PASSWORD="s3cret")
    assert f"addr=10.0.0.5:6379 ns={config['cluster_name']}" in on, on
    assert "--head --port=6379" in on and on.rstrip().endswith("--redis-password=s3cret"), on


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_nodes_install_the_ray_version_tested_here(name: str) -> None:
    pins = set(re.findall(r"ray\[default\]==([\w.]+)", " ".join(load(name)["setup_commands"])))
    assert pins == {ray.__version__}, f"{name} installs Ray {pins}; this checkout tests {ray.__version__}"


def _service_args(config: dict[str, Any]) -> list[str]:
    (command,) = [c for c in config["head_start_ray_commands"] if SERVICE in c]
    return shlex.split(command.split(SERVICE, 1)[1])


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_the_service_starts_on_the_head_after_ray_with_options_lora_cache_accepts(name: str) -> None:
    config = load(name)
    commands = config["head_start_ray_commands"]
    order = [next(i for i, c in enumerate(commands) if text in c)
             for text in ("start-service.sh stop", "ray stop", "ray start --head", SERVICE)]
    assert order == sorted(order), commands  # old service stopped first; the new one once Ray is up
    head_port = re.search(r"ray start --head --port=(\d+)", " ".join(commands))
    assert head_port and f"--address=$RAY_HEAD_IP:{head_port[1]}" in " ".join(config["worker_start_ray_commands"])

    ns = build_parser().parse_args(["serve", *_service_args(config)])  # an unknown option exits here
    serve = config_from_args(ServeConfig, ns)
    assert serve.gpus and serve.placement_timeout_s >= 600  # GPU workers; placed as GPU nodes join
    assert ns.grpc_host == "0.0.0.0" and ns.token_file == "~/.lora-cache/grpc_token"  # routers reach it, with a token
    assert config["file_mounts"][ns.token_file] == ns.token_file
    # issue 46: the token never travels in plaintext; the pair is made (or kept) on the head before the service
    assert (ns.tls_cert, ns.tls_key) == ("~/.lora-cache/tls/gateway.crt", "~/.lora-cache/tls/gateway.key")
    made = next(i for i, c in enumerate(commands) if "start-service.sh tls" in c)
    assert made < next(i for i, c in enumerate(commands) if SERVICE in c)
    if config["provider"]["type"] == "aws":  # the gRPC port is open to routers, and only it beyond Ray's defaults
        rules = config["provider"]["security_group"]["IpPermissions"]
        assert [(r["FromPort"], r["ToPort"]) for r in rules] == [(ns.grpc_port, ns.grpc_port)]


def test_start_service_script_is_executable_bash() -> None:
    script = DEPLOY / "start-service.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=10).returncode == 0
    usage = subprocess.run([str(script)], capture_output=True, text=True, timeout=10)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_start_service_tls_makes_a_pair_the_gateway_accepts_once_and_keeps_it(tmp_path: Path) -> None:
    """The cluster configs' TLS (issue 46): a self-signed pair for the head's addresses, made on the first start
    and kept after (an operator's own pair, mounted there, is kept the same way); the key is the owner's alone."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    env = {**os.environ, "LORA_CACHE_HOME": str(tmp_path)}
    tls = ["bash", str(DEPLOY / "start-service.sh"), "tls"]
    first = subprocess.run(tls, env=env, capture_output=True, text=True, check=True, timeout=60)
    assert "made a self-signed" in first.stdout and "IP:127.0.0.1" in first.stdout
    cert, key = tmp_path / "tls" / "gateway.crt", tmp_path / "tls" / "gateway.key"
    assert key.stat().st_mode & 0o077 == 0
    config = GatewayConfig(grpc_host="0.0.0.0", token="t", tls_cert=str(cert), tls_key=str(key))  # checks the pair
    assert config.security() == "bearer tokens, TLS"
    before = cert.read_bytes()
    again = subprocess.run(tls, env=env, capture_output=True, text=True, check=True, timeout=60)
    assert "keeping" in again.stdout and cert.read_bytes() == before


def test_start_service_fails_with_serves_message_when_serve_exits(tmp_path: Path) -> None:
    """`ray up` shows the reason: the service's own error, not a silent background failure."""
    env = {**_no_ray_env(), "LORA_CACHE_HOME": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([str(DEPLOY / "start-service.sh"), "start", "--placement", "DIAGONAL"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "lora-cache serve exited before joining the Ray cluster" in done.stderr
    assert "placement 'DIAGONAL' is not one of" in done.stderr
    assert not (tmp_path / "serve.pid").exists()


def test_runtime_env_is_valid_and_uploads_only_the_sources() -> None:
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert set(env) <= RuntimeEnv.known_fields
    RuntimeEnv(**env)  # Ray's type checks of each field
    for pattern in (".git", ".device", ".ci-venv", ".ci-redis", "__pycache__", "*.egg-info"):  # .ci-*: CI's own
        assert pattern in env["excludes"]
    files: list[Path] = []  # what Ray would zip, by these excludes alone (.gitignore not counted)
    _dir_travel(REPO, [_get_excludes(REPO, env["excludes"])], lambda p: files.append(p) if p.is_file() else None,
                include_gitignore=False)
    parts = {part for f in files for part in f.relative_to(REPO).parts}
    assert not parts & {".git", ".device", ".ci-venv", ".ci-redis", "__pycache__", ".mypy_cache"}, sorted(parts)[:20]
    assert not any(p.endswith(".egg-info") for p in parts)
    assert {"bench", "lora_cache", "workers", "pyproject.toml"} <= parts
    assert sum(f.stat().st_size for f in files) < 32 << 20


def _ray_upload(tmp_path: Path, runtime_env: dict[str, Any], include_gitignore: bool) -> tuple[list[str], int]:
    """What `ray job submit --working-dir .` uploads of this checkout, by Ray's own functions: the job client
    hands the runtime env to upload_working_dir_if_needed, which adds Ray's default excludes (.git, .venv,
    venv, __pycache__) to the env's and passes them to the upload; create_package zips the directory without
    them and without what each directory's .gitignore (unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1) and
    .rayignore leave out. The zip's names and size in bytes."""
    from ray._private.runtime_env.packaging import create_package
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    passed: list[list[str]] = []
    upload_working_dir_if_needed({**runtime_env, "working_dir": str(REPO)}, include_gitignore=include_gitignore,
                                 upload_fn=lambda _dir, excludes, is_file=False: passed.append(excludes))
    (excludes,) = passed
    package = tmp_path / "working_dir.zip"
    create_package(str(REPO), package, include_gitignore=include_gitignore, excludes=excludes)
    with zipfile.ZipFile(package) as z:
        return z.namelist(), package.stat().st_size


@pytest.mark.parametrize(("runtime_env", "include_gitignore"), [("runtime_env.yaml", True), ("runtime_env.yaml", False),
                                                                 (None, True)],
                         ids=["runtime-env", "runtime-env-without-gitignore", "plain-working-dir"])
def test_a_job_upload_leaves_out_the_raw_results_and_stays_small(tmp_path: Path, runtime_env: str | None,
                                                                 include_gitignore: bool) -> None:
    """Raw results (a local results/, a job's --out; ignored by git since issue 41) stay out of every upload: the
    runtime env excludes them, and .rayignore, which Ray reads whatever the runtime env says, leaves them out of a
    plain `--working-dir .`. A checkout without a results/ packs as well; the rule itself is checked below."""
    assert "/results/" in (REPO / ".gitignore").read_text().splitlines()
    assert "/results/" in (REPO / ".rayignore").read_text().splitlines()
    names, size = _ray_upload(tmp_path, load(runtime_env) if runtime_env else {}, include_gitignore)
    assert not [n for n in names if n.startswith("results/")], [n for n in names if n.startswith("results/")][:5]
    assert not [n for n in names if n.startswith("bench/reports/data/")]  # the reports' raw results, in git
    assert "bench/reports/issue-42.md" in names  # the reports themselves travel
    assert {"bench/run.py", "bench/RESULTS.md", "bench/calibration/h200-llama8b.json", ".rayignore"} <= set(names)
    if runtime_env:
        from ray._private.runtime_env.packaging import _get_excludes

        assert _get_excludes(REPO, load(runtime_env)["excludes"])(REPO / "results")  # by itself too
        assert size < 8 << 20, f"the job's upload is {size / 2**20:.1f} MiB"


def test_readme_submit_command_uses_the_runtime_env() -> None:
    readme = (REPO / "README.md").read_text()
    assert "--runtime-env deploy/runtime_env.yaml -- python -m bench.run --quick" in readme


# -- lora-cache serve where it cannot join: fails fast, says which failure and its fix ---------------------
def _no_ray_env() -> dict[str, str]:
    """This environment without RAY_* (RAY_ADDRESS, RAY_AUTH_MODE, ...): the test sets what it needs."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


def test_serve_against_an_unreachable_cluster_fails_fast_with_the_fix() -> None:
    env = _no_ray_env()
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lora_cache.app.cli", "serve", "--address", address,
                           "--model", "tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert time.monotonic() - t0 < 20  # Ray alone keeps trying for minutes
    assert "lora-cache serve: error: no Ray cluster answers at" in done.stderr
    assert "connection refused" in done.stderr and "the GCS port" in done.stderr


@pytest.mark.parametrize("address", ["ray://10.0.0.10:10001", "http://10.0.0.10:8265"])
def test_a_ray_client_or_dashboard_address_is_refused_with_the_fix(address: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ClusterUnreachableError, match="give the GCS host:port"):
        connect(address, "lora-cache")


def test_an_unreadable_token_path_is_refused_before_ray_reads_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))  # Ray would abort the process on it
    with pytest.raises(ClusterAuthError, match=r"is not a readable file holding a token.*ray get-auth-token"):
        connect(f"127.0.0.1:{free_port()}", "lora-cache")
    assert not ray.is_initialized()


def test_a_port_that_is_not_a_ray_gcs_is_named_within_the_bound() -> None:
    """Something listens, nothing answers as a GCS (Ray alone waits 40 s): the check gives up at its bound.
    In a child process: the abandoned probe thread stays blocked in Ray's client until that process exits."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        gcs = f"127.0.0.1:{listener.getsockname()[1]}"
        code = f"from lora_cache.runtime.cluster import check_gcs; check_gcs({gcs!r}, timeout_s=1.0)"
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-c", code], env=_no_ray_env(), capture_output=True, text=True,
                              timeout=60)
    assert time.monotonic() - t0 < 15
    assert done.returncode == 1 and "ClusterUnreachableError" in done.stderr
    assert f"{gcs} accepts connections but no Ray GCS answered within 1 s" in done.stderr
