"""Joining a Ray cluster (``lora-cache serve --address``): fail fast, and say which failure and its fix.

On its own, ``ray.init(address=...)`` waits 20 s and says only "Failed to connect" when the cluster
wants a token this process lacks or does not match, and waits minutes on an address nobody answers.
``connect`` checks first, in order, each failure with its own message:

1. the address: ``auto`` means ``RAY_ADDRESS`` or the cluster ``ray start`` last started on this machine; Ray
   turns a loopback host into the machine's address, which an embedded ``serve``'s cluster (on 127.0.0.1 only)
   does not answer on: a loopback address that only loopback answers is joined on loopback (``loopback_join``);
2. this process's token settings: ``RAY_AUTH_MODE`` (``token`` is refused on a Ray without token auth), and
   the token Ray would read (``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else
   ``~/.ray/auth_token``); a set but unreadable or empty ``RAY_AUTH_TOKEN_PATH`` would abort the process inside Ray;
3. a TCP connection to the GCS port (refused or timed out: unreachable);
4. one GCS call with those token settings (refused: the mode is off, or the token is not the cluster's).

Token auth (Ray >= 2.52; 2.60 turns it on by itself for clusters it starts locally) is chosen by the
``RAY_AUTH_MODE`` environment variable, which must be the same on every node and client. Ray >= 2.59 turns
it on by itself when joining ``auto`` with a token on disk, never for an explicit ``host:port``: there,
``RAY_AUTH_MODE=token`` must be set (deploy/ does it on every node; see the README's deploy section).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import ray

from lora_cache.errors import ConfigError, LoraCacheError
from lora_cache.runtime import full_disk, ray_compat, reaper

CONNECT_TIMEOUT_S = 5.0  # TCP connect to the GCS port
GCS_ANSWER_TIMEOUT_S = 15.0  # the first GCS call; Ray alone would wait 40 s
DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")
TOKEN_FIX = ("put the cluster's token (print it on the head node with `ray get-auth-token`) in ~/.ray/auth_token, "
             "or in a file named by RAY_AUTH_TOKEN_PATH, or in RAY_AUTH_TOKEN")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ObserveConfig:
    """What a service shows of itself: its processes' logs and its metrics endpoint."""

    log_level: str = field(default="INFO", metadata={"help": f"log level of this process, the controller and the "
                                                             f"workers: {'|'.join(LOG_LEVELS)}"})
    log_format: str = field(default="text", metadata={"help": "Ray's structured logging of every process of the "
                                                               "service: text|json"})
    worker_logs: bool = field(default=True, metadata={
        "help": "print the controller's and workers' output here, each line prefixed with its actor (they are "
                "also in the log directory printed at start)"})
    metrics_port: int = field(default=0, metadata={
        "help": "Prometheus port of an embedded cluster's node (0: any free port; printed at start)"})

    def __post_init__(self) -> None:
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r} is not one of {'|'.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format {self.log_format!r} is not one of {'|'.join(LOG_FORMATS)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {self.metrics_port}: give a port in 0..65535 (0: any free port)")

    def init_kwargs(self) -> dict[str, object]:
        """``ray.init`` arguments: Ray's logging config (every process of the job) and the driver's output."""
        logging.basicConfig(level=self.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = ray.LoggingConfig(encoding=self.log_format.upper(), log_level=self.log_level.upper())
        return {"logging_config": config, "log_to_driver": self.worker_logs}


def endpoints() -> dict[str, str]:
    """Where this node's metrics and this cluster's logs are, once joined (printed by ``serve`` at start)."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return {"metrics": f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics",
            "logs": os.path.join(ray_compat.session_dir(), "logs")}


class ClusterConnectError(LoraCacheError, ConnectionError):
    """The Ray cluster to join cannot be reached, or refused this process: the --address or the token this
    process was given does not work (usage, exit 2)."""

    usage = True


class ClusterUnreachableError(ClusterConnectError):
    """No Ray cluster answers at the address."""


class ClusterAuthError(ClusterConnectError):
    """The cluster wants a token this process does not send, or sends wrongly."""


def auth_mode() -> str:
    """This process's ``RAY_AUTH_MODE`` as Ray reads it ("" if unset)."""
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower()


def _holds_token(path: Path) -> bool:
    try:
        return bool(path.expanduser().read_text().strip())
    except OSError:  # missing, a directory, not readable
        return False


def token_source() -> str | None:
    """Where Ray would read this process's token from, in Ray's order of precedence; None: nowhere."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    return str(DEFAULT_TOKEN_PATH.expanduser()) if _holds_token(DEFAULT_TOKEN_PATH) else None


def check_token_auth_supported() -> None:
    """Refuse ``RAY_AUTH_MODE=token`` on a Ray without token auth, which would run without it, unguarded."""
    if auth_mode() == "token" and not ray_compat.has_token_auth():
        since = ".".join(map(str, ray_compat.TOKEN_AUTH_SINCE))
        raise ConfigError(f"RAY_AUTH_MODE=token, but Ray {ray.__version__} has no token authentication (Ray >= "
                          f"{since} has): install Ray >= {since} on every node and on this host (pip install "
                          f"'ray[default]>={since},<2.61'), or unset RAY_AUTH_MODE to run without it")


def check_token_settings(address: str) -> None:
    """Step 2: refuse settings that Ray would abort on or reject, before Ray reads them (a Ray without token
    auth reads none of them)."""
    if not ray_compat.has_token_auth():
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and not os.environ.get("RAY_AUTH_TOKEN") and not _holds_token(Path(path)):
        raise ClusterAuthError(f"RAY_AUTH_TOKEN_PATH={path} is not a readable file holding a token; {TOKEN_FIX}")
    if auth_mode() == "token" and token_source() is None:
        raise ClusterAuthError(f"RAY_AUTH_MODE=token but this process has no Ray token to join {address} "
                               f"with; {TOKEN_FIX}")


def resolve_address(address: str) -> str:
    """Step 1: the GCS ``host:port`` that ``ray.init(address)`` would join."""
    if address.startswith(("ray://", "http://", "https://")):
        raise ClusterUnreachableError(
            f"--address {address!r} is a Ray Client or dashboard address; lora-cache serve joins the cluster "
            "itself: run it on a node of the cluster with --address auto, or give the GCS host:port "
            "(`ray start --head --port`, 6379 by default)")
    try:
        resolved = ray_compat.bootstrap_address(address)
    except (ConnectionError, ValueError) as e:
        hint = ("no RAY_ADDRESS and no cluster started with `ray start` on this machine; start one (`ray start "
                "--head`, or `ray up deploy/<cluster>.yaml`) or give --address host:port of its GCS"
                if address == "auto" else "give host:port of the head node's GCS, e.g. 10.0.0.1:6379")
        raise ClusterUnreachableError(f"--address {address!r}: {e}; {hint}") from e
    if resolved is None:
        raise ClusterUnreachableError(f"--address {address!r} names no cluster; give auto or host:port")
    return str(resolved)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname
        return False


def _answers(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return True
    except OSError:
        return False


def loopback_join(address: str, gcs: str) -> str | None:
    """The loopback GCS address to join when ``address`` names this machine by a loopback host and the cluster
    there listens on loopback only (an embedded ``serve``'s); None: join ``gcs`` as Ray resolved it.

    Ray resolves a loopback host to the machine's address (``gcs``) and looks for this node's raylet at that
    address; an embedded cluster advertises 127.0.0.1 and answers nowhere else, so Ray would fail at the
    machine's address. A cluster of ``ray start`` listens on every interface and advertises the machine's
    address: Ray's resolution is right for it, and kept."""
    given = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    host, _, port = given.rpartition(":")
    gcs_host = gcs.rpartition(":")[0]
    if not port.isdigit() or not _is_loopback(host) or _is_loopback(gcs_host):
        return None
    if _answers(gcs_host, int(port), timeout_s=1.0) or not _answers("127.0.0.1", int(port)):
        return None
    return f"127.0.0.1:{port}"


def check_reachable(gcs: str, address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Step 3: something accepts TCP connections at the GCS port."""
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        why = f"no answer within {timeout_s:.0f} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ClusterUnreachableError(
            f"no Ray cluster answers at {gcs} (--address {address}): {why.lower()}; "
            "check that the head node is up (`ray status` on it), that this host can reach it (firewall, "
            "security group), and that the port is the GCS port (`ray start --head --port`, 6379 by "
            "default; not the dashboard's 8265 or Ray Client's 10001)") from e


def _auth_refused(gcs: str) -> ClusterAuthError:
    mode, source = auth_mode(), token_source()
    if mode != "token":
        then = (f"; it would then send the token in {source} (the cluster's own: `ray get-auth-token` on the head "
                "node)" if source else f", and {TOKEN_FIX}")
        return ClusterAuthError(f"the Ray cluster at {gcs} requires token authentication, but RAY_AUTH_MODE is "
                                f"{mode or 'unset'} in this process: set RAY_AUTH_MODE=token{then}")
    return ClusterAuthError(f"the Ray cluster at {gcs} refused this process's token, from {source}: it is not the "
                            f"cluster's token; {TOKEN_FIX}")


def check_gcs(gcs: str, timeout_s: float = GCS_ANSWER_TIMEOUT_S) -> None:
    """Step 4: one GCS call with this process's token settings, bounded in time."""
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            ray_compat.probe_gcs(gcs)
            outcome.append(None)
        except BaseException as e:  # handed to the caller's thread below
            outcome.append(e)

    thread = threading.Thread(target=probe, name="lora-cache-gcs-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise ClusterUnreachableError(
            f"{gcs} accepts connections but no Ray GCS answered within {timeout_s:.0f} s: check that the port is "
            "the GCS port (`ray start --head --port`, 6379 by default), and that the head node is healthy")
    error = outcome[0]
    if error is None:
        return
    if ray_compat.is_auth_refusal(error):
        raise _auth_refused(gcs) from None
    raise ClusterUnreachableError(f"the Ray GCS at {gcs} did not answer: {error}") from error


def local_only() -> None:
    """Make Ray advertise 127.0.0.1, and its Python servers (agents, metrics) bind it, for an embedded cluster.

    Ray turns ``_node_ip_address="127.0.0.1"`` into the machine's external address unless clusters are off
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: read at import by this process, from the environment by the ones
    Ray starts). A cluster of one node needs no other address."""
    ray_compat.advertise_loopback_only()


def connect(address: str, namespace: str, observe: ObserveConfig | None = None) -> None:
    """``ray.init`` on an embedded local Ray (``address`` empty: always a new cluster, advertised on 127.0.0.1;
    ``RAY_ADDRESS`` is for ``--address auto``) or on the cluster at ``address``. Every worker process of the job
    keeps running when Ray's temp disk is full (``full_disk``). Its processes die with this
    one, even SIGKILLed (Ray's reaper); Ray's own gRPC servers still bind every interface (token auth guards
    them; docs/known-issues.md)."""
    observe = observe or ObserveConfig(worker_logs=False)
    check_token_auth_supported()
    if not address:  # a fresh cluster of this process's own, whatever RAY_ADDRESS or a `ray start` left says
        local_only()
        ray.init(address="local", _node_ip_address="127.0.0.1", namespace=namespace, include_dashboard=False,
                 _metrics_export_port=observe.metrics_port or None, runtime_env=full_disk.runtime_env(),
                 **observe.init_kwargs())  # type: ignore[arg-type]
        reaper.watch_tree()  # what Ray's reaper leaves of it when this process is SIGKILLed
        gcs = ray.get_runtime_context().gcs_address
        print(f"lora-cache: started a Ray cluster of this process's own at {gcs}; services on this machine join it "
              f"with --address {gcs}", flush=True)
        return
    if address == "auto":  # what ray.init("auto") does: token mode when a token is on disk and the mode is unset
        ray_compat.enable_token_auth_if_token_available()
    gcs = resolve_address(address)
    loopback = loopback_join(address, gcs)
    if loopback is not None:  # this node is the cluster's 127.0.0.1 node, as the embedded one advertised it
        local_only()
        gcs = loopback
    check_token_settings(gcs)
    check_reachable(gcs, address)
    check_gcs(gcs)
    ray.init(address=gcs, namespace=namespace, runtime_env=full_disk.runtime_env(),
             **observe.init_kwargs())  # type: ignore[arg-type]
    alive = sum(1 for n in ray.nodes() if n["Alive"])
    print(f"lora-cache: joined the Ray cluster at {gcs} ({alive} nodes alive, token auth "
          f"{'on' if auth_mode() == 'token' else 'off'})", flush=True)
