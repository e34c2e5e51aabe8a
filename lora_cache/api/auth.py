"""Who may call what (lifecycle step 2): bearer tokens and client certificates, each mapped to roles.

Every call but health checks proves who it is: a known bearer token (``authorization: Bearer <token>``), or,
under mutual TLS (``--tls-client-ca``), a client certificate that CA signed, whose identity (subject CN or a
SAN) ``--tls-client-roles`` names. Its roles are those of its token and its certificate together; the RPC
needs one of them (``RPC_ROLES``: routers, engines, operators). No known credential: UNAUTHENTICATED (an
unknown certificate identity: PERMISSION_DENIED naming it); a credential without the role: PERMISSION_DENIED
naming the role and the flag. The verdict (``Credentials.judge``) is plain Python; ``CallerCheck`` runs it in
each call, where the certificate the TLS handshake verified is known.

An engine credential may be bound to the replicas it speaks for (``Grant.replicas``: a line ``TOKEN REPLICA...``
of ``--engine-token-file``, or ``{"roles": ["engine"], "replicas": [...]}`` in ``--tls-client-roles``). A call
whose right to its RPC comes only from bound engine grants carries those replicas (``speaks_for``, set for the
call's handler); ``ReportQueue`` and ``AttachRank`` then refuse any other replica (``check_speaks_for``). An
entry ``REPLICA/RANK`` binds it to one rank: ``AttachRank`` as that rank only, ``ReportQueue`` for its replica.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NamedTuple

import grpc

from lora_cache.api.callers import certificate_names, speaks_for
from lora_cache.api.servicer import SERVICE_NAME

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # served without a credential: load balancers probe them
ROLES = ("router", "engine", "operator")
# Which roles may call each RPC of LoraCacheService (docs/decisions.md, "Roles of callers"); an RPC not named
# here (server reflection) takes any valid credential.
RPC_ROLES: dict[str, frozenset[str]] = {
    **dict.fromkeys(("Hint", "CancelHint", "Lookup", "Route", "WatchReadiness"), frozenset({"router"})),
    "ReportQueue": frozenset({"router", "engine"}),  # engines report their waiting queues
    "ResolveAdapter": frozenset({"router", "engine"}),  # a request for a name not yet registered
    "AttachRank": frozenset({"engine"}),
    "FetchPushed": frozenset({"engine"}),  # an attached rank's copy of a pushed version
    **dict.fromkeys(("RegisterAdapter", "RegisterAdapters", "UnregisterAdapter", "PushAdapter", "ResizePool"),
                    frozenset({"operator"})),  # a trainer pushes with an operator's credential
    "Status": frozenset(ROLES),
}


class Denial(NamedTuple):
    code: grpc.StatusCode
    why: str


class Grant(NamedTuple):
    """What one credential (a token, a certificate identity) may do: its roles, and the replicas its engine role
    speaks for (None: any replica, as every credential did before bindings)."""

    roles: frozenset[str]
    replicas: frozenset[str] | None = None


class Allowed(NamedTuple):
    """A call that may go on; ``replicas``: the only replicas it may speak for (None: any)."""

    replicas: frozenset[str] | None


def _grant(roles: frozenset[str] | Grant) -> Grant:
    return roles if isinstance(roles, Grant) else Grant(roles)


class Credentials:
    """The accepted bearer tokens and client-certificate identities, each with its grant (roles, or a ``Grant``)."""

    def __init__(self, tokens: Mapping[str, frozenset[str] | Grant],
                 identities: Mapping[str, frozenset[str] | Grant] | None = None, mutual_tls: bool = False) -> None:
        self._tokens = [(f"Bearer {t}".encode(), _grant(g)) for t, g in tokens.items()]
        self.identities = {name: _grant(g) for name, g in (identities or {}).items()}
        self.mutual_tls = mutual_tls  # the TLS handshake already refused callers without a certificate of the CA

    def grant_of(self, sent: str | bytes) -> Grant | None:
        """The grant of the token sent (None: no known token); every token is compared, in constant time each."""
        raw = sent.encode() if isinstance(sent, str) else sent
        found = [grant for expected, grant in self._tokens if hmac.compare_digest(raw, expected)]
        return found[0] if found else None  # tokens are distinct (the config merges a token's files)

    def verdict(self, method: str, sent: str | bytes | None, names: list[str]) -> Denial | None:
        """None when the call may go on (``judge``), else how it is refused."""
        judged = self.judge(method, sent, names)
        return judged if isinstance(judged, Denial) else None

    def judge(self, method: str, sent: str | bytes | None, names: list[str]) -> Denial | Allowed:
        """Whether the call (``method``; the ``authorization`` value ``sent``; its certificate's ``names``) may go
        on, and for which replicas; else how it is refused."""
        token = None if sent is None or not self._tokens else self.grant_of(sent)
        if sent is not None and self._tokens and token is None:
            return Denial(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is wrong; give the gateway's token "
                          "(lora_cache.api.client: token=...; CLI: --token-file)")
        cert = next((self.identities[n] for n in names if n in self.identities), None)
        grants = [g for g in (token, cert) if g is not None]
        if not grants:
            return self._unknown(names)
        roles = frozenset().union(*(g.roles for g in grants))
        rpc = method.rsplit("/", 1)[-1]
        needed = RPC_ROLES.get(rpc, frozenset(ROLES)) if method.startswith(f"/{SERVICE_NAME}/") else frozenset(ROLES)
        if roles & needed:
            return Allowed(_bound(grants, needed))
        flags = [f"--{r}-token-file" for r in sorted(needed)] + (["--tls-client-roles"] if self.mutual_tls else [])
        return Denial(grpc.StatusCode.PERMISSION_DENIED,
                      f"{rpc} needs the {' or '.join(sorted(needed))} role; this caller has the "
                      f"{', '.join(sorted(roles)) or 'no'} role: call with a credential from {' or '.join(flags)} "
                      "(or --token-file, every role)")

    def unbound_engines(self) -> int:
        """Credentials with the engine role that speak for any replica (the gateway warns of them)."""
        grants = [g for _, g in self._tokens] + list(self.identities.values())
        return sum(1 for g in grants if "engine" in g.roles and g.replicas is None)

    def _unknown(self, names: list[str]) -> Denial:
        if self.mutual_tls and names:
            name = names[0][:64]  # a SAN may be long; an error quotes at most 64 characters of a value
            return Denial(grpc.StatusCode.PERMISSION_DENIED,
                          f"client certificate identity {name!r} is not in --tls-client-roles, and the call has no "
                          f"known bearer token; add {name!r} with its roles to that file, or call with a token")
        return Denial(grpc.StatusCode.UNAUTHENTICATED,
                      "the call has no bearer token; this server requires metadata 'authorization: Bearer <token>' "
                      "(lora_cache.api.client: token=...; CLI: --token-file)")


def _bound(grants: list[Grant], needed: frozenset[str]) -> frozenset[str] | None:
    """The replicas a call may speak for: any (None) if a grant gives it a needed role other than a bound engine
    role, else the replicas of its bound engine grants."""
    engine = [g for g in grants if "engine" in (g.roles & needed)]
    if any(g.roles & (needed - {"engine"}) for g in grants) or any(g.replicas is None for g in engine):
        return None
    return frozenset().union(*(g.replicas or () for g in engine))


class CallerCheck(grpc.aio.ServerInterceptor):
    """Runs ``Credentials.verdict`` at the start of every call but health checks; a refused call is answered
    with its Denial and reaches no servicer."""

    def __init__(self, credentials: Credentials | str) -> None:
        if isinstance(credentials, str):  # one token: every role
            credentials = Credentials({credentials: frozenset(ROLES)})
        self.credentials = credentials

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        method = details.method

        def denial(context: grpc.aio.ServicerContext) -> Denial | None:
            judged = self.credentials.judge(method, sent, certificate_names(context.auth_context() or {}))
            if isinstance(judged, Denial):
                return judged
            speaks_for.set(judged.replicas)  # this call's task: its handler runs in it
            return None

        return _checked(handler, denial)


def _checked(handler: Any, denial: Callable[[grpc.aio.ServicerContext], Denial | None]) -> Any:
    """A handler of the same kind as ``handler`` that first asks ``denial`` and answers it, if any."""
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    behavior = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                (True, False): handler.stream_unary, (True, True): handler.stream_stream}[streaming_in, streaming_out]

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if (refused := denial(context)) is not None:
            await context.abort(refused.code, refused.why)
        return await behavior(request, context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if (refused := denial(context)) is not None:
            await context.abort(refused.code, refused.why)
        out = behavior(request, context)
        if hasattr(out, "__aiter__"):
            async for response in out:
                yield response
        else:  # a handler that writes its responses itself (context.write)
            await out

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[streaming_in, streaming_out](streaming if streaming_out else unary,
                                             request_deserializer=handler.request_deserializer,
                                             response_serializer=handler.response_serializer)
