"""Who is calling, and how much each caller may take: per-client limits of the gateway (lifecycle step 2).

A client is its credential (docs/decisions.md, "Secure by default"): the identity of its client certificate
(mutual TLS), else a digest of its bearer token (never the token itself), and only a call without either
by its address. Routers behind one address with their own tokens (or certificates) are separate clients;
routers sharing one token are one client wherever they run.

- ``StreamLimits``: long-lived streams (``WatchReadiness``, ``AttachRank``) open at once, per client and in all.
- ``CallRate``: unary calls per client, a token bucket each (``calls_per_client_s``, ``call_burst_per_client``).
- ``speaks_for``: the replicas the current call's credential may speak for (``auth.Grant``), checked by
  ``check_speaks_for`` where a call names a replica as its own (``ReportQueue``, ``AttachRank``).

Beyond a limit the call is refused at once with CapacityError (RESOURCE_EXHAUSTED) naming the limit and its
flag; other clients are not affected. Plain Python: the servicer passes in the client's name.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from lora_cache.errors import CapacityError, PermissionDeniedError

MAX_RATE_CLIENTS = 65536  # buckets kept at most; full ones (idle clients) go first, then the longest unused


def token_digest(token: str | bytes) -> str:
    """A short name of a bearer token (or of ``Bearer <token>``) for limits and logs: never the token itself."""
    raw = token.encode() if isinstance(token, str) else token
    if raw.startswith(b"Bearer "):
        raw = raw[len(b"Bearer "):]
    return hashlib.sha256(raw).hexdigest()[:12]


def certificate_names(auth_context: dict[str, list[bytes]]) -> list[str]:
    """The names of a verified client certificate (gRPC's auth context): its subject CN, then its SANs; empty
    without a client certificate."""
    names = [v.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
             for v in auth_context.get(key, ())]
    return list(dict.fromkeys(names))


def certificate_identity(auth_context: dict[str, list[bytes]]) -> str | None:
    """A client certificate's identity: its subject CN, else its first SAN; None without a client certificate."""
    return next(iter(certificate_names(auth_context)), None)


def client_of(context: Any) -> str:
    """Who is calling (a ``grpc.aio.ServicerContext``), for per-client limits: ``cert NAME``, ``token DIGEST``
    or, without a credential, ``address HOST`` (the peer without its port)."""
    if (who := certificate_identity(context.auth_context() or {})) is not None:
        return f"cert {who[:64]}"  # a CN is at most 64 characters; a SAN is cut there for the messages
    sent = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    if sent is not None:
        return f"token {token_digest(sent)}"
    peer = context.peer() or "unknown"
    return "address " + (peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer)


class StreamLimits:
    """Long-lived streams (``WatchReadiness``, ``AttachRank``) open at once, per client and in all: each holds
    an RPC slot of the server (and a Watch a long poll of the controller), so one client cannot take them
    all. Beyond a limit the stream is refused at once with RESOURCE_EXHAUSTED naming the limit."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self.open: Counter[str] = Counter()  # client -> its streams open now
        self.refused = 0

    @contextlib.contextmanager
    def hold(self, client: str, rpc: str) -> Iterator[None]:
        if self.open[client] >= self.per_client:
            self.refused += 1
            raise CapacityError(f"{rpc} refused: client {client} has {self.open[client]} streams open, the most one "
                                f"client may hold (max_streams_per_client={self.per_client}); close streams it no "
                                "longer reads, or share one Watch among its threads")
        if sum(self.open.values()) >= self.total:
            self.refused += 1
            raise CapacityError(f"{rpc} refused: this gateway has {self.total} streams open, its limit "
                                "(max_streams); retry later or raise --max-streams")
        self.open[client] += 1
        try:
            yield
        finally:
            self.open[client] -= 1
            if not self.open[client]:
                del self.open[client]


class CallRate:
    """Unary calls per client: a token bucket each, ``per_s`` calls a second on average and ``burst`` at once.
    A call over it is refused (CapacityError) and costs nothing; other clients' buckets are their own."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_RATE_CLIENTS) -> None:
        self.per_s, self.burst, self.clock, self.max_clients = per_s, burst, clock, max_clients
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (calls left, at), LRU
        self.refused = 0

    def take(self, client: str, rpc: str) -> None:
        """One call of ``client``; CapacityError naming the limit and its flags when its bucket is empty."""
        now = self.clock()
        left, at = self.buckets.get(client, (float(self.burst), now))
        left = min(float(self.burst), left + (now - at) * self.per_s)
        if left < 1.0:
            self.refused += 1
            self.buckets[client] = (left, now)
            raise CapacityError(f"{rpc} refused: client {client} is over its call rate ({self.per_s:g} calls/s, "
                                f"bursts of {self.burst}: calls_per_client_s, call_burst_per_client); slow down and "
                                "retry, or raise --calls-per-client-s / --call-burst-per-client")
        self.buckets[client] = (left - 1.0, now)
        self.buckets.move_to_end(client)
        if len(self.buckets) > self.max_clients:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget full buckets (a new one is the same), then the longest unused until within ``max_clients``."""
        for client, (left, at) in list(self.buckets.items()):
            if left + (now - at) * self.per_s >= self.burst:
                del self.buckets[client]
        while len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)


# The replicas the current call may speak for (None: any; also every call of a gateway without authentication).
speaks_for: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("speaks_for", default=None)


def check_speaks_for(replica: str, rpc: str, rank: int | None = None) -> None:
    """PermissionDeniedError unless the current call may speak for ``replica`` (its credential's binding): bound to
    the replica, or, for a call of one of its ranks (``rank``: AttachRank), to ``REPLICA/RANK``; a call for the
    replica as a whole (ReportQueue: ``rank`` None) is allowed to a credential bound to any of its ranks."""
    bound = speaks_for.get()
    if bound is None or replica in bound:
        return
    if f"{replica}/{rank}" in bound if rank is not None else any(b.startswith(f"{replica}/") for b in bound):
        return
    who = f"replica {replica[:64]!r}" + (f" rank {rank}" if rank is not None else "")
    raise PermissionDeniedError(
        f"{rpc} for {who} refused: this engine credential speaks for "
        f"{', '.join(repr(r) for r in sorted(bound)[:8])} only; use that replica's (or rank's) own credential (a "
        "line 'TOKEN REPLICA' or 'TOKEN REPLICA/RANK' of --engine-token-file, or its identity's replicas in "
        "--tls-client-roles)")
