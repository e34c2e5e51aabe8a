"""``LoraCacheRouter``'s settings (lifecycle step 1): one frozen dataclass, checked where the deployment is built.

Apart from the router (``ray_serve.py``, which re-exports it) so that a deployment's settings are checked, and their
PEM files read, without Ray Serve imported: the router module holds only what runs inside Serve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lora_cache.api.client import AsyncLoraCacheClient
from lora_cache.errors import ConfigError
from lora_cache.routing.ranking import RouterConfig


@dataclass(frozen=True)
class RouterSettings:
    """``LoraCacheRouter``'s settings (``RequestRouterConfig.request_router_kwargs``)."""

    server: str = field(default="127.0.0.1:50051", metadata={"help": "the lora-cache gateway, host:port"})
    token: str = field(default="", metadata={"help": "the gateway's bearer token, if it has one"})
    hint_timeout_s: float = field(default=0.5, metadata={"help": "deadline of a Hint call (sent after routing)"})
    retry_s: float = field(
        default=5.0,
        metadata={
            "help": "after lora-cache failed (the readiness stream broke, a Hint failed), route by Serve's own "
            "ranking this long before connecting again; after a Hint past its deadline (a busy controller), send "
            "no hints this long (the ranking goes on)"
        },
    )
    hints: str = field(
        default="all",
        metadata={
            "help": "which routed requests the controller is hinted of: all (every one, batched: its plans and "
            "popularity), cold (only those sent where the adapter was not READY), or none"
        },
    )
    hint_batch_s: float = field(
        default=0.02,
        metadata={
            "help": "hints of routed requests, and the cancels of completed ones, are sent together, one Hint and one "
            "CancelHint call this often (0: one per request)"
        },
    )
    cold_hint_now: bool = field(
        default=True,
        metadata={
            "help": "a hint for a request sent where its adapter is not READY leaves at once, not with the next "
            "batch: the planner hears of the need before the replica's own load lands (batched, a global plan "
            "evicted what the replica loaded for the request before its hint came; bench/RESULTS.md)"
        },
    )
    epsilon: float = field(
        default=0.25,
        metadata={"help": "load bound of the ranking (lora-cache's RouterConfig.epsilon), over this router's requests"},
    )
    min_bound: float = field(
        default=8.0, metadata={"help": "requests in flight every replica may take before the bound applies"}
    )
    traffic_s: float = field(
        default=0.0,
        metadata={
            "help": "half-life of the router's count of requests sent to each replica lately: a cold adapter goes to "
            "the replica with the fewest (RouterConfig.cold_traffic), not to its hash pick alone; 0 (the default): "
            "hash order. Off: it balanced traffic but not slots, and loaded more than the hash order in 3 of 5 "
            "paired runs (bench/RESULTS.md, issue 32 sixth round)"
        },
    )
    tls_ca: str = field(default="", metadata={
        "help": "the CA that signed the gateway's certificate (its --tls-cert): PEM text, or a file readable where "
                "the router runs; set: the router speaks TLS (the ray up configs' gateway does)"})
    tls_client_cert: str = field(default="", metadata={
        "help": "the certificate this router presents to a gateway that asks for one (--tls-client-ca): PEM text "
                "or a file; with tls_client_key"})
    tls_client_key: str = field(default="", metadata={"help": "its private key: PEM text or a file"})
    loading_s: float = field(
        default=5.0,
        metadata={
            "help": "a replica this router sent an adapter to (not READY there) ranks as loading it this long, "
            "until the readiness stream says READY: the adapter's next requests follow the first"
        },
    )

    def __post_init__(self) -> None:
        host, _, port = self.server.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(
                f"server {self.server!r} is not host:port; give the lora-cache gateway's address, e.g. 127.0.0.1:50051"
            )
        if not 0 < self.hint_timeout_s <= 10:
            raise ConfigError(
                f"hint_timeout_s is {self.hint_timeout_s}; give a short positive deadline (<= 10 s): a router "
                "must not pile up calls to lora-cache"
            )
        if self.retry_s < 0 or self.loading_s < 0 or self.traffic_s < 0:
            raise ConfigError(
                f"retry_s ({self.retry_s}), loading_s ({self.loading_s}) and traffic_s ({self.traffic_s}) must be "
                ">= 0 seconds"
            )
        if self.hints not in ("cold", "all", "none"):
            raise ConfigError(f"hints is {self.hints!r}; give cold, all or none")
        if not 0 <= self.hint_batch_s <= 1:
            raise ConfigError(f"hint_batch_s is {self.hint_batch_s}; give [0, 1] s")
        RouterConfig(epsilon=self.epsilon, min_bound=self.min_bound)  # the ranking's own checks
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ConfigError("tls_client_cert and tls_client_key go together; give both to present a certificate")
        for name in ("tls_ca", "tls_client_cert", "tls_client_key"):
            self._pem(name)  # a file that is not there, or not PEM, fails at deployment

    def _pem(self, name: str) -> bytes | None:
        """Setting ``name`` as PEM bytes (given as text, or read from the file it names); None if unset."""
        value = getattr(self, name)
        if not value:
            return None
        if value.lstrip().startswith("-----BEGIN"):
            return value.encode()
        try:
            data = Path(value).read_bytes()
        except OSError as e:
            raise ConfigError(f"{name} {value!r} cannot be read ({e.strerror}); give PEM text, or a file readable "
                              "where the router runs") from e
        if b"-----BEGIN" not in data:
            raise ConfigError(f"{name} {value!r} holds no PEM block; give the PEM file (or its text)")
        return data

    def client(self) -> AsyncLoraCacheClient:
        """The router's client of the gateway: its token, TLS (``tls_ca``) and certificate if set."""
        return AsyncLoraCacheClient(self.server, token=self.token or None, timeout_s=self.hint_timeout_s,
                                    root_certificates=self._pem("tls_ca"), client_cert=self._pem("tls_client_cert"),
                                    client_key=self._pem("tls_client_key"))

    def ranking(self) -> RouterConfig:
        return RouterConfig(epsilon=self.epsilon, min_bound=self.min_bound, cold_traffic=self.traffic_s > 0)
