"""The one place lora-cache touches Ray's private APIs (issue 45): everything else uses Ray's public API only.

Each function says what it needs, why no public API serves on every supported Ray, and the releases it is known
to work on. Supported: Ray ``FLOOR`` (2.30, the first release with the public ``ray.LoggingConfig`` that
``lora-cache serve`` configures every process's logging with) up to 2.60; CI runs the Ray tests on both ends
(``.ci/run``). ``tests/test_ray_compat.py`` checks what each function returns on the Ray it runs on, and that no
other module under ``lora_cache/``, ``workers/`` or ``bench/`` imports ``ray._private``, ``ray._raylet`` or
``internal_kv``'s underscore functions.

"Known to work on 2.30 to 2.60": tested on both ends, and the private name is there with the same signature in
every release between (read in the wheels of 2.30, 2.35, 2.40, 2.44, 2.48 and 2.51 to 2.58). Version gates compare
``VERSION`` with the release a feature appeared in; a gate goes when the floor passes it.
"""

from __future__ import annotations

import os
import re

import ray

FLOOR = (2, 30)  # pyproject.toml's server extra, the README and .ci/run name the same release
TOKEN_AUTH_SINCE = (2, 52)  # RAY_AUTH_MODE=token, ray.exceptions.AuthenticationError
AUTO_TOKEN_SINCE = (2, 59)  # ray.init("auto") turns token mode on when a token is on disk
SESSION_DIR_SINCE = (2, 55)  # RuntimeContext.get_temp_dir (get_session_name: 2.54)


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a Ray version string: ``"2.60.0"`` and ``"2.61.0rc1"`` -> (2, 60), (2, 61)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"Ray version {version!r} does not start with major.minor")
    return int(match[1]), int(match[2])


VERSION = release(ray.__version__)


def has_token_auth() -> bool:
    """Whether this Ray can authenticate its processes with a token (``RAY_AUTH_MODE=token``)."""
    return VERSION >= TOKEN_AUTH_SINCE


def enable_token_auth_if_token_available() -> None:
    """What ``ray.init("auto")`` does first on Ray >= 2.59: token mode on (``RAY_AUTH_MODE=token`` in this
    process) when the mode is unset and a token is on disk; we do it before our own checks of the token.

    Private because Ray exposes it only inside ``ray.init``. Older Rays never turn token mode on by themselves,
    so there it does nothing, as they do. Known to work on 2.59 and 2.60."""
    if VERSION < AUTO_TOKEN_SINCE:
        return
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def is_auth_refusal(error: BaseException) -> bool:
    """Whether a GCS call failed because the cluster refused this process's token (or its lack of one)."""
    return has_token_auth() and isinstance(error, ray.exceptions.AuthenticationError)


def bootstrap_address(address: str) -> str | None:
    """The GCS ``host:port`` that ``ray.init(address)`` joins: ``auto`` is ``RAY_ADDRESS``, else the cluster
    ``ray start`` last started on this machine (a file in Ray's temp dir); a hostname is resolved.

    Private because Ray resolves addresses only inside ``ray.init``, and we must resolve it before, to check
    the address and the token with messages of our own. Raises ``ConnectionError`` (auto finds no cluster) or
    ``ValueError`` (not host:port: Ray >= 2.51 says so itself; older ones pass a bare host through, refused
    here alike). Known to work on 2.30 to 2.60."""
    from ray._private.services import canonicalize_bootstrap_address

    resolved: str | None = canonicalize_bootstrap_address(address)
    if resolved is not None and ":" not in resolved:
        raise ValueError(f"Invalid address format: {resolved}")
    return resolved


def probe_gcs(address: str) -> None:
    """One call to the GCS at ``address`` with this process's token settings, before ``ray.init``: returns
    once it answers; raises what the client raised (``is_auth_refusal`` tells a refused token).

    Private because Ray's public clients (``ray.init``, ``ray.util.state``) either join the cluster or go through
    the dashboard; only the GCS client asks the GCS alone. Blocks until the GCS answers or Ray gives up (~40 s):
    run it on a thread. Tested on 2.30 and 2.60 (compiled: not read in the wheels between)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Cython, no stub

    GcsClient(address=address)


def advertise_loopback_only() -> None:
    """Let an embedded cluster advertise ``_node_ip_address="127.0.0.1"`` instead of the machine's address.

    Ray honours a loopback address only when clusters are off: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, an
    environment variable that the processes Ray starts read, but this one read at ``import ray``, into a private
    constant, so that is set too. Known to work on 2.30 to 2.60."""
    import ray._private.ray_constants as constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants.ENABLE_RAY_CLUSTER = False


def session_dir() -> str:
    """This node's session directory (``logs/`` in it), once joined.

    Public from 2.55 (``RuntimeContext.get_temp_dir``, the session directory's parent, and
    ``get_session_name``); before, only the private node object knows it. Known to work on 2.30 to 2.60."""
    if VERSION >= SESSION_DIR_SINCE:
        context = ray.get_runtime_context()
        return os.path.join(context.get_temp_dir(), context.get_session_name())
    node = ray._private.worker.global_worker.node
    assert node is not None, "session_dir() after ray.init"
    return str(node.get_session_dir_path())


def kv_get(key: str, namespace: str) -> bytes | None:
    """The value at ``key`` in the GCS key-value store (None: no such key); after ``ray.init``.

    The GCS kv is where Ray keeps its own metadata and the only store that outlives every actor and needs no
    storage of its own; Ray exposes it only as ``ray.experimental.internal_kv``'s underscore functions (the
    same three, same arguments, on 2.30 to 2.60)."""
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)  # type: ignore[no-any-return]


def kv_put(key: str, value: bytes, namespace: str) -> None:
    """Write ``value`` at ``key`` (overwriting) in the GCS key-value store; see ``kv_get``."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_del(key: str, namespace: str) -> None:
    """Delete ``key`` from the GCS key-value store (none there: nothing happens); see ``kv_get``."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=namespace)


def disable_auto_init() -> None:
    """A Ray API called in this process while Ray is down raises instead of starting or joining a cluster.

    Ray's switch is ``RAY_ENABLE_AUTO_CONNECT=0``, read at ``import ray`` into a private flag; setting the
    variable would turn it off in every subprocess too, so the flag is set (the tests' conftest: in the test
    process only). Known to work on 2.30 to 2.60."""
    import ray._private.auto_init_hook as hook

    hook.enable_auto_connect = False
