"""``lora_cache.runtime.ray_compat``, the one module that touches Ray's private APIs (issue 45): what each function
returns on the Ray these tests run on (CI runs them on the newest supported Ray and on the floor: ``.ci/run``),
and that no other module of the service imports Ray's private APIs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from lora_cache.runtime import cluster, ray_compat
from tests.ray_local import init_local

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lora_cache", "workers", "bench")
COMPAT = "lora_cache/runtime/ray_compat.py"
PRIVATE_MODULES = ("ray._private", "ray._raylet", "ray.serve._private", "ray.autoscaler._private")
KNOWN_EXCEPTIONS: set[str] = set()  # none: the Serve router moved to the public router API (issue 45 item 2)


def test_release_reads_major_and_minor() -> None:
    assert ray_compat.release("2.60.0") == (2, 60)
    assert ray_compat.release("2.61.0rc1") == (2, 61)
    assert ray_compat.release("3.0.0.dev0") == (3, 0)
    with pytest.raises(ValueError, match="'nightly'"):
        ray_compat.release("nightly")


def test_this_ray_is_in_the_supported_range_that_pyproject_declares() -> None:
    (floor, ceiling), = re.findall(r'"ray\[default\]>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert ray_compat.release(floor) == ray_compat.FLOOR
    (ci_floor,) = re.findall(r"^FLOOR=([\d.]+)$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    assert ray_compat.release(ci_floor) == ray_compat.FLOOR, ".ci/run tests another floor than pyproject's"
    assert ray_compat.FLOOR <= ray_compat.VERSION < ray_compat.release(ceiling), ray.__version__


def test_token_auth_is_what_this_ray_has() -> None:
    assert ray_compat.has_token_auth() == hasattr(ray.exceptions, "AuthenticationError")
    assert not ray_compat.is_auth_refusal(ConnectionError("refused"))
    if ray_compat.has_token_auth():
        assert ray_compat.is_auth_refusal(ray.exceptions.AuthenticationError("token mismatch"))


def _auth_mode_after_enable(env: dict[str, str]) -> str:
    """RAY_AUTH_MODE after ``enable_token_auth_if_token_available`` in a fresh process (it changes Ray's
    process-wide config, so never in this one)."""
    code = ("import os; from lora_cache.runtime import ray_compat; "
            "ray_compat.enable_token_auth_if_token_available(); print(os.environ.get('RAY_AUTH_MODE', ''))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def test_auto_token_mode_only_on_a_ray_that_does_it(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a" * 32)
    on = _auth_mode_after_enable({"RAY_AUTH_TOKEN_PATH": str(token), "HOME": str(tmp_path)})
    assert on == ("token" if ray_compat.VERSION >= ray_compat.AUTO_TOKEN_SINCE else "")
    assert _auth_mode_after_enable({"HOME": str(tmp_path)}) == ""  # no token anywhere: unchanged


def test_token_mode_on_a_ray_without_token_auth_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    if ray_compat.has_token_auth():
        cluster.check_token_auth_supported()  # nothing to refuse
        return
    with pytest.raises(cluster.ConfigError, match=rf"Ray {re.escape(ray.__version__)} has no token auth.*"
                                                  r"pip install 'ray\[default\]>=2.52"):
        cluster.connect("127.0.0.1:1", "ns")


def test_bootstrap_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ray_compat.bootstrap_address("10.0.0.7:6379") == "10.0.0.7:6379"
    assert str(ray_compat.bootstrap_address("localhost:6379")).endswith(":6379")  # this node's address
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6380")
    assert ray_compat.bootstrap_address("auto") == "10.0.0.7:6380"
    with pytest.raises(ValueError):
        ray_compat.bootstrap_address("no-port-here")


def test_auto_init_is_off_in_the_test_process() -> None:
    """conftest calls ``disable_auto_init``: a Ray API raises instead of starting a cluster."""
    assert not ray.is_initialized()
    with pytest.raises(Exception, match="Ray has not been started yet"):
        ray.put(1)
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    init_local(num_cpus=1, include_dashboard=False, namespace="ray-compat-test")
    yield
    ray.shutdown()


@pytest.mark.ray
def test_kv_round_trip_and_session_dir(local_ray: None) -> None:
    key, namespace = "ray-compat-test-key", "ray-compat-test"
    assert ray_compat.kv_get(key, namespace) is None
    ray_compat.kv_put(key, b"one", namespace)
    ray_compat.kv_put(key, b"two", namespace)  # overwrites
    assert ray_compat.kv_get(key, namespace) == b"two"
    assert ray_compat.kv_get(key, "another-namespace") is None
    ray_compat.kv_del(key, namespace)
    ray_compat.kv_del(key, namespace)  # nothing there: nothing happens
    assert ray_compat.kv_get(key, namespace) is None

    session = Path(ray_compat.session_dir())
    assert session.name.startswith("session_"), session
    assert (session / "logs").is_dir()
    found = cluster.endpoints()
    assert found["logs"] == str(session / "logs")
    assert re.fullmatch(r"http://[\d.]+:\d+/metrics", found["metrics"]), found


def _ray_private_uses(path: Path) -> list[str]:
    """``module:line what`` for each import or attribute chain of Ray's private modules in ``path``, and each
    import of ``internal_kv``'s underscore functions."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if not isinstance(node, ast.stmt | ast.expr):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [ast.unparse(node)]
        for name in names:
            if name.startswith(PRIVATE_MODULES) or "._internal_kv_" in name:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


def test_no_module_but_the_compat_module_uses_private_ray_apis() -> None:
    files = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
    uses = [use for p in files if str(p.relative_to(ROOT)) not in {COMPAT, *KNOWN_EXCEPTIONS}
            for use in _ray_private_uses(p)]
    assert not uses, ("Ray's private APIs outside lora_cache/runtime/ray_compat.py (use a public API, or add a "
                      "function there saying why none serves):\n" + "\n".join(uses))
    assert _ray_private_uses(ROOT / COMPAT), "the guard finds nothing even where private APIs are used"
