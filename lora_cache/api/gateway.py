"""The gRPC gateway (lifecycle step 2): a grpc.aio server in front of the controller actor.

It serves ``lora_cache.v1.LoraCacheService`` (lora_cache/api/servicer.py), the standard health
service (grpc.health.v1) and server reflection. Limits: message size, concurrent RPCs (beyond it
gRPC answers RESOURCE_EXHAUSTED), streams and unary calls per client (``callers.py``: a client is its
credential), hints per call, and the bounded hint ingest queue. Callers prove who they are with bearer tokens
or, under mutual TLS, client certificates, each mapped to roles (``auth.py``: ``RPC_ROLES``); beyond loopback
the gateway does not start without one of them unless told ``--insecure``. With a certificate and key, the
port speaks TLS.

Health (grpc.health.v1) tells the truth about the controller behind the gateway: ``HealthWatch`` pings it
every ``HEALTH_EVERY_S`` and answers NOT_SERVING for "", the API's name and the service's health name
(``serve --service``) within ``HEALTH_EVERY_S + HEALTH_TIMEOUT_S`` of it becoming unreachable, SERVING
again once it answers.

``start_gateway`` runs on the caller's event loop; ``start_gateway_thread`` gives synchronous
callers (``lora-cache serve``) a gateway on its own loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import json
import logging
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from lora_cache.api.auth import ROLES, CallerCheck, Credentials, Grant
from lora_cache.api.callers import CallRate, StreamLimits
from lora_cache.api.ingest import FLUSH_S as INGEST_FLUSH_S
from lora_cache.api.ingest import HintIngest
from lora_cache.api.servicer import SERVICE_NAME, Servicer, generic_handler
from lora_cache.api.validate import BINDING_FORM, binding_ok
from lora_cache.errors import ConfigError
from lora_cache.runtime.tls import check_client_ca, check_tls_pair

MiB = 1 << 20
log = logging.getLogger(__name__)
STOP_STEP_S = 10.0  # a gateway stop step that overruns its own wait by this is abandoned (Gateway.stop)
HEALTH_EVERY_S = 0.5  # the controller is pinged this often
HEALTH_TIMEOUT_S = 1.0  # and counted unreachable when a ping takes longer (NOT_SERVING within 1.5 s)


@dataclass(frozen=True)
class GatewayConfig:
    """The router-facing gRPC server: where it listens, its limits, and who may call it."""

    grpc_host: str = field(default="127.0.0.1", metadata={
        "help": "address the gRPC gateway listens on (0.0.0.0 or [::] to expose it beyond this machine)"})
    grpc_port: int = field(default=50051, metadata={"help": "gRPC gateway port (0: any free port)"})
    max_message_bytes: int = field(default=4 * MiB, metadata={"help": "largest gRPC message received or sent"})
    max_push_bytes: int = field(default=4 << 30, metadata={
        "help": "largest weights one PushAdapter stream may carry (the gateway holds one push whole before it "
                "forwards it; an 8B rank-64 adapter is ~0.35 GB)"})
    max_concurrent_rpcs: int = field(default=1024, metadata={
        "help": "RPCs served at once (streams included); beyond it calls get RESOURCE_EXHAUSTED"})
    max_hints_per_call: int = field(default=4096, metadata={
        "help": "most hints, hint ids or queue entries in one call"})
    ingest_queue_hints: int = field(default=65536, metadata={
        "help": "hints waiting for the controller at most; a Hint call beyond it gets RESOURCE_EXHAUSTED"})
    token_file: str = field(default="", metadata={"path": True,
        "help": "file holding the bearer token every call but health checks must send (empty: no auth)"})
    token: str = field(default="", metadata={"help": "the bearer token itself (prefer --token-file: "
                                                     "command lines are visible to other users)"})
    router_token_file: str = field(default="", metadata={"path": True, "help":
        "file of the bearer tokens of routers (one a line: one per router, each its own client for the limits): "
        "Hint, CancelHint, Lookup, Route, WatchReadiness, ReportQueue, ResolveAdapter, Status"})
    engine_token_file: str = field(default="", metadata={"path": True, "help":
        "file of the bearer tokens of engines: AttachRank, ReportQueue, ResolveAdapter, Status; a line "
        "'TOKEN REPLICA...' binds the token to those replicas (it may attach and report queues for them only; "
        "REPLICA/RANK: that rank of it), a bare 'TOKEN' speaks for any replica (warned of at start)"})
    operator_token_file: str = field(default="", metadata={"path": True, "help":
        "file of the bearer token of operators: RegisterAdapter(s), UnregisterAdapter, PushAdapter, ResizePool, "
        "Status"})
    max_streams_per_client: int = field(default=64, metadata={
        "help": "WatchReadiness and AttachRank streams one client (address and token) holds at once"})
    max_streams: int = field(default=256, metadata={
        "help": "WatchReadiness and AttachRank streams open at once in all (each Watch holds a controller poll); "
                "at most half of max_concurrent_rpcs is used, so unary calls always find a slot"})
    tls_cert: str = field(default="", metadata={
        "path": True, "help": "PEM certificate chain file: serve TLS (with --tls-key)"})
    tls_key: str = field(default="", metadata={"path": True, "help": "PEM private key file of --tls-cert"})
    tls_client_ca: str = field(default="", metadata={"path": True, "help":
        "PEM certificate of the CA that signs the clients' certificates: mutual TLS, every caller presents one "
        "(with --tls-cert, and --tls-client-roles or tokens)"})
    tls_client_roles: str = field(default="", metadata={"path": True, "help":
        'JSON file of client certificate identities (subject CN or a SAN) and their roles, '
        '{"router-1": ["router"], "ops": ["operator"]}; an engine bound to its replicas: '
        '{"engine-0": {"roles": ["engine"], "replicas": ["replica-0"]}} (or "replica-0/1": that rank only)'})
    calls_per_client_s: float = field(default=2000.0, metadata={
        "help": "unary calls a second one client (its certificate, token, or without either its address) may make "
                "on average; beyond it calls get RESOURCE_EXHAUSTED"})
    call_burst_per_client: int = field(default=4000, metadata={
        "help": "unary calls one client may make at once above --calls-per-client-s"})
    insecure: bool = field(default=False, metadata={
        "help": "listen beyond loopback without authentication (no token, no client certificates): anyone who "
                "reaches the port may register, unregister and attach; refused without this flag"})

    def __post_init__(self) -> None:
        if not self.grpc_host:
            raise ConfigError("grpc_host is empty; give an address to listen on, e.g. 127.0.0.1 or 0.0.0.0")
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"grpc_port is {self.grpc_port}; give a port in 0..65535 (0: any free port)")
        if self.max_push_bytes < 0:
            raise ConfigError(f"max_push_bytes is {self.max_push_bytes}; give a size in bytes (0 refuses pushes)")
        if not 64 * 1024 <= self.max_message_bytes < 2**31:
            raise ConfigError(f"max_message_bytes is {self.max_message_bytes}; give 64 KiB to 2 GiB - 1, "
                              f"e.g. {4 * MiB} (4 MiB)")
        for name in ("max_concurrent_rpcs", "max_hints_per_call", "max_streams_per_client", "max_streams",
                     "call_burst_per_client"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}; give at least 1")
        if self.ingest_queue_hints < self.max_hints_per_call:
            raise ConfigError(f"ingest_queue_hints ({self.ingest_queue_hints}) must hold at least one full call "
                              f"(max_hints_per_call, {self.max_hints_per_call}); raise it or lower "
                              "max_hints_per_call")
        if self.token and self.token_file:
            raise ConfigError("both token and token_file are set; give one (token_file keeps it off the command line)")
        self.role_tokens()  # every token file readable, every token well-formed
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"tls_cert ({self.tls_cert!r}) and tls_key ({self.tls_key!r}) go together; "
                              "give both to serve TLS, or neither")
        for name in ("tls_cert", "tls_key"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ConfigError(f"{name} {getattr(self, name)!r} is not a file; give a PEM file path")
        if self.tls_cert:
            check_tls_pair(self.tls_cert, self.tls_key)  # which file is wrong, before anything starts
        self._check_mutual_tls()
        if not self.calls_per_client_s > 0:
            raise ConfigError(f"calls_per_client_s is {self.calls_per_client_s}; give a rate above 0 calls/s, "
                              "e.g. 2000")
        if not self.authenticated() and not self.insecure and not is_loopback(self.grpc_host):
            raise ConfigError(
                f"grpc_host {self.grpc_host!r} listens beyond this machine, and no caller is authenticated: anyone "
                "who reaches the port could register, unregister and attach. Give --token-file (or "
                "--router-token-file, --engine-token-file, --operator-token-file), and --tls-cert/--tls-key so the "
                "token does not travel in plaintext; or client certificates (--tls-client-ca, --tls-client-roles); "
                "or listen on 127.0.0.1; or pass --insecure to accept it")

    def _check_mutual_tls(self) -> None:
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError(f"tls_client_ca ({self.tls_client_ca!r}) needs the server's own --tls-cert and --tls-key:"
                              " client certificates are asked for in the TLS handshake")
        if self.tls_client_roles and not self.tls_client_ca:
            raise ConfigError(f"tls_client_roles ({self.tls_client_roles!r}) needs --tls-client-ca: the CA whose "
                              "certificates it names")
        if self.tls_client_ca:
            check_client_ca(self.tls_client_ca)
            if not self.tls_client_roles and not self.role_tokens():
                raise ConfigError(f"tls_client_ca ({self.tls_client_ca!r}) is set, but nothing gives a caller a role: "
                                  "give --tls-client-roles (identities and their roles), or token files")
        self.client_roles()  # the roles file readable and well-formed

    def client_roles(self) -> dict[str, Grant]:
        """Each client certificate identity of ``tls_client_roles`` and its grant (empty: no file): a list of roles
        (any replica), or ``{"roles": [...], "replicas": [...]}`` binding its engine role to those replicas."""
        if not self.tls_client_roles:
            return {}
        fix = ('give a JSON object of identities and their roles, e.g. {"router-1": ["router"], "engine-0": '
               '{"roles": ["engine"], "replicas": ["replica-0"]}}')
        try:
            doc = json.loads(Path(self.tls_client_roles).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"tls_client_roles {self.tls_client_roles!r} cannot be read as JSON ({e}); {fix}") from e
        if not isinstance(doc, dict) or not doc:
            raise ConfigError(f"tls_client_roles {self.tls_client_roles!r} is not a non-empty JSON object; {fix}")
        out = {}
        for identity, value in doc.items():
            roles, replicas = (value.get("roles"), value.get("replicas")) if isinstance(value, dict) else (value, None)
            where = f"tls_client_roles {self.tls_client_roles!r}: identity {identity[:64]!r}"
            if isinstance(value, dict) and set(value) - {"roles", "replicas"}:
                raise ConfigError(f"{where} has keys {sorted(value)[:8]}; give only 'roles' and 'replicas'")
            if not isinstance(roles, list) or not roles or not set(roles) <= set(ROLES):
                raise ConfigError(f"{where} has roles {str(roles)[:64]}; give a list of {', '.join(ROLES)}")
            if replicas is not None and (not isinstance(replicas, list) or not replicas
                                         or not all(binding_ok(r) for r in replicas)):
                raise ConfigError(f"{where} has replicas {str(replicas)[:64]}; give a non-empty list of "
                                  f"{BINDING_FORM}, or leave 'replicas' out: any replica")
            out[identity] = Grant(frozenset(roles), None if replicas is None else frozenset(replicas))
        return out

    def authenticated(self) -> bool:
        """Whether every call but health checks must prove who it is (a bearer token or a client certificate)."""
        return bool(self.token or self.token_file or self.tls_client_ca
                    or any(getattr(self, f"{r}_token_file") for r in ROLES))

    def security(self) -> str:
        """How callers are checked and the port speaks, in words (the gateway's description, and its log)."""
        transport = "mutual TLS" if self.tls_client_ca else "TLS" if self.tls_cert else "plaintext"
        if self.authenticated():
            return f"{'bearer tokens' if self.role_tokens() else 'client certificates'}, {transport}"
        if is_loopback(self.grpc_host):
            return f"no authentication (loopback only), {transport}"
        return f"INSECURE: no authentication beyond loopback (--insecure), {transport}"

    def bearer_token(self) -> str | None:
        """The token calls must carry, or None when auth is off."""
        if self.token_file:
            path = Path(self.token_file)
            if not path.is_file():
                raise ConfigError(f"token_file {self.token_file!r} is not a file; write the token into it")
            token = path.read_text().strip()
            if not token:
                raise ConfigError(f"token_file {self.token_file!r} is empty; write the token into it")
            return token
        return self.token or None

    def token_for(self, role: str) -> str | None:
        """A token that carries ``role`` (the every-role token if set, else that role's own file), for a client
        this process runs itself (``serve --demo``'s router); None when auth is off. ConfigError when auth is
        on and no token carries the role."""
        if role not in ROLES:
            raise ConfigError(f"role {role!r} is unknown; give one of {', '.join(sorted(ROLES))}")
        tokens = self.role_tokens()
        if not tokens:
            return None
        for token, roles in tokens.items():
            if role in roles:
                return token
        raise ConfigError(f"no token carries the {role} role; give --{role}-token-file (or --token-file, every role)")

    def role_tokens(self) -> dict[str, frozenset[str]]:
        """Each accepted token and the roles it carries (empty: auth is off)."""
        return {token: grant.roles for token, grant in self.token_grants().items()}

    def token_grants(self) -> dict[str, Grant]:
        """Each accepted token and its grant. ``token``/``token_file`` carries every role (what it meant before
        roles) for any replica; a role's own file, that role. A line ``TOKEN REPLICA...`` of the engine file binds
        that engine token to those replicas (the only ones it may speak for); a bare ``TOKEN`` speaks for any. A
        token in several files carries all their roles; any of them unbound leaves it unbound."""
        roles: dict[str, set[str]] = {}
        bound: dict[str, set[str] | None] = {}
        if (token := self.bearer_token()) is not None:
            roles[token], bound[token] = set(ROLES), None
        for role in ROLES:
            if path := getattr(self, f"{role}_token_file"):
                for token, replicas in _read_tokens(f"{role}_token_file", path, bindable=role == "engine"):
                    roles.setdefault(token, set()).add(role)
                    if token not in bound or replicas is None:
                        bound[token] = None if replicas is None else set(replicas)
                    elif (held := bound[token]) is not None:
                        held.update(replicas)
        for token in roles:
            if not (token.isascii() and token.isprintable() and " " not in token):
                raise ConfigError("a bearer token must be printable ASCII without spaces (it travels in a header)")
        return {t: Grant(frozenset(r), None if (b := bound.get(t)) is None else frozenset(b))
                for t, r in roles.items()}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name to listen on) reaches this machine only: 127.x, ::1, localhost."""
    bare = host.strip("[]").lower()
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False  # a name (or 0.0.0.0's kin): it may resolve beyond this machine


def _read_tokens(name: str, value: str, bindable: bool = False) -> list[tuple[str, tuple[str, ...] | None]]:
    """The tokens of a role's file, one a line: one per client (a router each), each its own client for the
    per-client limits; with ``bindable`` (the engine file) a line may name the replicas its token speaks for after
    it (``TOKEN REPLICA...``; None: a bare token, any replica)."""
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{name} {value!r} is not a file; write the token into it")
    out: list[tuple[str, tuple[str, ...] | None]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split()
        if not words:
            continue
        if len(words) > 1 and not bindable:
            raise ConfigError(f"{name} {value!r} line {number} has {len(words)} words; give one token a line (only "
                              "--engine-token-file binds a token to replicas: 'TOKEN REPLICA...')")
        for replica in words[1:]:
            if not binding_ok(replica):
                raise ConfigError(f"{name} {value!r} line {number}: {replica[:64]!r} is not a replica or a rank; "
                                  f"give 'TOKEN REPLICA...', each {BINDING_FORM}")
        out.append((words[0], tuple(words[1:]) if len(words) > 1 else None))
    if not out:
        raise ConfigError(f"{name} {value!r} is empty; write the token into it")
    return out


class HealthWatch:
    """Keeps the health service's answers for ``names`` equal to whether the controller answers a ping."""

    def __init__(self, health_servicer: Any, ping: Callable[[], Awaitable[object]], names: tuple[str, ...],
                 every_s: float = HEALTH_EVERY_S, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        self.health, self.ping, self.names = health_servicer, ping, names
        self.every_s, self.timeout_s = every_s, timeout_s
        self.serving: bool | None = None  # None: not yet checked
        self.task: asyncio.Task[None] | None = None

    async def check(self) -> bool:
        """One ping; the health status set from it (only when it changes). True: the controller answered."""
        try:
            await asyncio.wait_for(self.ping(), self.timeout_s)
            up = True
        except Exception:  # any failure to answer (dead, restarting, hung, unreachable) is NOT_SERVING
            up = False
        if up != self.serving:
            self.serving = up
            status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in self.names:
                await self.health.set(name, status)
        return up

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self.check()

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


@dataclass
class Gateway:
    """A running gateway: its server, the port it got, and its hint ingest."""

    config: GatewayConfig
    server: grpc.aio.Server
    port: int
    ingest: HintIngest
    health: Any
    watch: HealthWatch
    stopping: str = ""  # the step of ``stop`` in progress (named when a stop overruns its time)
    overran: list[str] = field(default_factory=list)  # the stop's steps that overran their bound

    @property
    def target(self) -> str:
        return f"{self.config.grpc_host}:{self.port}"

    async def stop(self, grace_s: float = 2.0, step_s: float = STOP_STEP_S) -> None:
        """Stop taking calls, let calls in progress finish for ``grace_s``, then flush the ingest. Each step is
        bounded (``step_s`` beyond its own wait): one that overruns is printed with every task still running
        (where each waits) and the stop goes on, so a hung call never holds the process that owns the gateway."""
        steps: tuple[tuple[str, Callable[[], Awaitable[None]], float], ...] = (
            ("the health watch's stop", self.watch.stop, step_s),
            ("the health service's graceful shutdown", self.health.enter_graceful_shutdown, step_s),
            (f"the gRPC server's stop (grace {grace_s} s)", lambda: self.server.stop(grace_s), grace_s + step_s),
            ("the hint ingest's close", self.ingest.close, INGEST_FLUSH_S + step_s))
        for name, step, bound in steps:
            self.stopping = name
            task = asyncio.ensure_future(step())
            done, _ = await asyncio.wait({task}, timeout=bound)
            if not done:  # cancelled, not awaited: a step that ignores its cancellation must not hold the stop
                task.cancel()
                self.overran.append(name)
                print(f"lora-cache gateway (port {self.port}): {name} did not finish within {bound:.0f} s; the stop "
                      f"goes on without it. Tasks still running:\n{_task_stacks()}", file=sys.stderr, flush=True)
            else:
                task.result()  # a step that failed fails the stop, as it did before steps were bounded
        self.stopping = "done"


def _task_stacks(depth: int = 8) -> str:
    """Every task of the running loop but this one: the chain of coroutines it is suspended in (innermost last,
    at most ``depth``) and what the innermost awaits."""
    out = []
    for task in asyncio.all_tasks():
        if task is asyncio.current_task():
            continue
        out.append(f"  {task.get_name()}:")
        awaited: Any = task.get_coro()
        for _ in range(depth):
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is None:
                break
            out.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        if awaited is not None:
            out.append(f"    awaiting {awaited!r:.200}")
    return "\n".join(out) + "\n" if out else "  (none)\n"


def _credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    pair = [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
    if config.tls_client_ca:  # mutual TLS: the handshake refuses a client without a certificate of this CA
        return grpc.ssl_server_credentials(pair, root_certificates=Path(config.tls_client_ca).read_bytes(),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


async def start_gateway(config: GatewayConfig, controller: Any, health_name: str = "") -> Gateway:
    """Serve LoraCacheService (+ health, reflection) for ``controller`` on the running event loop;
    ``health_name``: the service's own name in the health service (besides "" and the API's)."""
    tokens = config.token_grants()
    if config.insecure and not config.authenticated() and not is_loopback(config.grpc_host):
        log.warning("lora-cache gateway on %s:%s has NO AUTHENTICATION (--insecure): anyone who reaches the port "
                    "may register, unregister and attach; give --token-file (with --tls-cert/--tls-key) to close it",
                    config.grpc_host, config.grpc_port)
    ingest = HintIngest(controller.hint_batches.remote, config.ingest_queue_hints)
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0),
               # the clients' keepalive (client.KEEPALIVE) on streams that may say nothing for minutes
               ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000), ("grpc.http2.max_ping_strikes", 0)]
    callers = Credentials(tokens, config.client_roles(), bool(config.tls_client_ca))
    if config.authenticated() and (unbound := callers.unbound_engines()):
        log.warning("lora-cache gateway: %d engine credential(s) speak for any replica (an engine holding one may "
                    "report another replica's queue or attach as it); bind each to its replica: a line 'TOKEN "
                    "REPLICA' of --engine-token-file, or 'replicas' in --tls-client-roles", unbound)
    check = CallerCheck(callers)
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=config.max_concurrent_rpcs,
                             interceptors=[check] if config.authenticated() else None)
    total = max(1, min(config.max_streams, config.max_concurrent_rpcs // 2))  # unary calls keep half the slots
    streams = StreamLimits(min(config.max_streams_per_client, total), total)
    calls = CallRate(config.calls_per_client_s, config.call_burst_per_client)
    server.add_generic_rpc_handlers((generic_handler(Servicer(controller, ingest, config.max_hints_per_call,
                                                              streams=streams, calls=calls,
                                                              max_push_bytes=config.max_push_bytes)),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.grpc_host}:{config.grpc_port}"
    credentials = _credentials(config)
    try:
        port = (server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address))
    except RuntimeError as e:
        raise ConfigError(f"cannot listen on {address} ({e}); is the port taken? choose another --grpc-port") from e
    await server.start()
    ingest.start()
    names = tuple(dict.fromkeys(("", SERVICE_NAME, health_name)))  # "" and the API's, then the service's own
    watch = HealthWatch(health_servicer, lambda: controller.ping.remote(), names)
    await watch.check()
    watch.start()
    return Gateway(config, server, port, ingest, health_servicer, watch)


class GatewayThread:
    """A gateway on its own event loop in a daemon thread, for synchronous callers."""

    def __init__(self, config: GatewayConfig, controller: Any, start_timeout_s: float = 30.0,
                 health_name: str = "") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lora-cache-gateway", daemon=True)
        self._thread.start()
        try:
            self.gateway = asyncio.run_coroutine_threadsafe(start_gateway(config, controller, health_name),
                                                            self._loop).result(start_timeout_s)
        except BaseException:
            self._shutdown_loop()
            raise

    @property
    def port(self) -> int:
        return self.gateway.port

    @property
    def target(self) -> str:
        return self.gateway.target

    def stop(self, grace_s: float = 2.0, timeout_s: float = 60.0) -> None:
        """Stop the gateway (``Gateway.stop``: its steps are bounded) and its loop. The loop itself blocked (a
        synchronous call on it) is a TimeoutError after ``grace_s + timeout_s`` naming the step and where the
        loop's thread was; the loop is then left as it is (no call into a blocked loop)."""
        stopped = asyncio.run_coroutine_threadsafe(self.gateway.stop(grace_s), self._loop)
        try:
            stopped.result(grace_s + timeout_s)
        except concurrent.futures.TimeoutError:
            frame = sys._current_frames().get(self._thread.ident or -1)
            where = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else "(the thread has ended)\n"
            raise TimeoutError(f"the gateway on port {self.port} did not stop within {grace_s + timeout_s:.0f} s: "
                               f"stuck at {self.gateway.stopping or 'its start'}; its loop's thread was at:\n"
                               f"{where}") from None
        self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def start_gateway_thread(config: GatewayConfig, controller: Any, health_name: str = "") -> GatewayThread:
    """``start_gateway`` on a background thread; ``.stop()`` it when done."""
    return GatewayThread(config, controller, health_name=health_name)
