"""Mutual TLS (issue 46, item 2): client certificates of one CA, their identities mapped to roles, against a
real gRPC server (the gateway in-process with a stand-in controller). Certificates are made here with
``cryptography``: a CA, the server's certificate for localhost, clients' certificates, and a stranger CA."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from lora_cache.api.auth import Credentials, Grant
from lora_cache.api.client import ClientConfig, ClientError, LoraCacheClient
from lora_cache.api.gateway import GatewayConfig, start_gateway_thread
from lora_cache.api.servicer import SERVICE_NAME
from lora_cache.errors import ConfigError
from tests.test_gateway import StallController


class Issued(NamedTuple):
    cert: Path
    key: Path


def _issue(out: Path, name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
           ca: bool = False) -> tuple[Issued, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    paths = Issued(out / f"{name}.crt", out / f"{name}.key")
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return paths, cert, key


class Pki(NamedTuple):
    ca: Issued
    server: Issued
    clients: dict[str, Issued]  # router-1, router-2, ops, stranger (of the CA); rogue (of another CA)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    out = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = _issue(out, "test-ca", None, ca=True)
    server = _issue(out, "localhost", (ca_cert, ca_key))[0]
    clients = {n: _issue(out, n, (ca_cert, ca_key))[0] for n in ("router-1", "router-2", "ops", "stranger")}
    _, rogue_cert, rogue_key = _issue(out, "rogue-ca", None, ca=True)
    clients["rogue"] = _issue(out, "rogue", (rogue_cert, rogue_key))[0]
    (out / "roles.json").write_text(json.dumps({"router-1": ["router"], "router-2": ["router"], "ops": ["operator"]}))
    return Pki(ca, server, clients)


def _config(pki: Pki, **kwargs: object) -> GatewayConfig:
    return GatewayConfig(grpc_host="localhost", grpc_port=0, tls_cert=str(pki.server.cert), tls_key=str(pki.server.key),
                         tls_client_ca=str(pki.ca.cert), tls_client_roles=str(pki.ca.cert.parent / "roles.json"),
                         **kwargs)  # type: ignore[arg-type]


def _client(pki: Pki, target: str, who: str | None) -> LoraCacheClient:
    cert = pki.clients[who] if who else None
    return LoraCacheClient(target, root_certificates=pki.ca.cert.read_bytes(), timeout_s=10,
                           client_cert=cert.cert.read_bytes() if cert else None,
                           client_key=cert.key.read_bytes() if cert else None)


def _error(client: LoraCacheClient, call: str) -> ClientError:
    with client, pytest.raises(ClientError) as info:
        if call == "status":
            client.status()
        else:
            client.unregister("adapter-000")
    return info.value


def test_client_certificates_map_to_roles_and_strangers_are_named(pki: Pki) -> None:
    gw = start_gateway_thread(_config(pki), StallController())
    try:
        target = f"localhost:{gw.port}"
        with _client(pki, target, "router-1") as lc:
            assert lc.status().epoch == 1
        denied = _error(_client(pki, target, "router-1"), "unregister")  # a router cannot unregister
        assert denied.code == "PERMISSION_DENIED" and "operator role" in denied.message
        assert "--tls-client-roles" in denied.message
        stranger = _error(_client(pki, target, "stranger"), "status")  # the CA's, but not in the roles file
        assert stranger.code == "PERMISSION_DENIED" and "'stranger' is not in --tls-client-roles" in stranger.message
        for who in (None, "rogue"):  # no certificate, or one of another CA: the handshake fails
            assert _error(_client(pki, target, who), "status").code == "UNAVAILABLE"
    finally:
        gw.stop()


def test_the_call_rate_is_per_certificate_identity(pki: Pki) -> None:
    gw = start_gateway_thread(_config(pki, calls_per_client_s=0.001, call_burst_per_client=2), StallController())
    try:
        target = f"localhost:{gw.port}"
        with _client(pki, target, "router-1") as one, _client(pki, target, "router-2") as two:
            assert one.status().epoch == 1 and one.status().epoch == 1
            with pytest.raises(ClientError) as info:
                one.status()
            assert info.value.code == "RESOURCE_EXHAUSTED" and "client cert router-1" in info.value.message
            assert two.status().epoch == 1 and two.status().epoch == 1  # the other certificate is its own client
    finally:
        gw.stop()


def test_mutual_tls_counts_as_authentication_beyond_loopback_and_its_config_is_checked(pki: Pki,
                                                                                       tmp_path: Path) -> None:
    assert _config(pki).security() == "client certificates, mutual TLS"
    GatewayConfig(grpc_host="0.0.0.0", tls_cert=str(pki.server.cert), tls_key=str(pki.server.key),
                  tls_client_ca=str(pki.ca.cert), tls_client_roles=str(pki.ca.cert.parent / "roles.json"))
    (tmp_path / "bad.json").write_text('{"router-1": ["admin"]}')
    (tmp_path / "notjson").write_text("router-1: router")
    pair = {"tls_cert": str(pki.server.cert), "tls_key": str(pki.server.key)}
    for kwargs, fragment in [
        ({"tls_client_ca": str(pki.ca.cert)}, "needs the server's own --tls-cert"),
        ({**pair, "tls_client_roles": str(tmp_path / "bad.json")}, "needs --tls-client-ca"),
        ({**pair, "tls_client_ca": str(pki.ca.cert)}, "nothing gives a caller a role"),
        ({**pair, "tls_client_ca": str(pki.ca.key)}, "holds no PEM certificate"),
        ({**pair, "tls_client_ca": str(pki.ca.cert), "tls_client_roles": str(tmp_path / "bad.json")},
         "identity 'router-1' has roles"),
        ({**pair, "tls_client_ca": str(pki.ca.cert), "tls_client_roles": str(tmp_path / "notjson")},
         "cannot be read as JSON"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            GatewayConfig(grpc_port=0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="go together"):
        ClientConfig(tls_client_cert=str(pki.clients["ops"].cert))
    config = ClientConfig(tls_ca=str(pki.ca.cert), tls_client_cert=str(pki.clients["ops"].cert),
                          tls_client_key=str(pki.clients["ops"].key))
    gw = start_gateway_thread(_config(pki), StallController())
    try:
        with LoraCacheClient.from_config(ClientConfig(**{**config.__dict__, "server": f"localhost:{gw.port}"})) as lc:
            assert lc.status().epoch == 1  # an operator may see Status
    finally:
        gw.stop()


def test_a_calls_roles_are_its_certificates_and_its_tokens_together() -> None:
    """``Credentials.verdict``, plain Python: the rules ``CallerCheck`` applies in each call."""
    creds = Credentials({"eng-token": frozenset({"engine"})}, {"router-1": frozenset({"router"})}, mutual_tls=True)
    route, attach = f"/{SERVICE_NAME}/Route", f"/{SERVICE_NAME}/AttachRank"
    assert creds.verdict(route, None, ["router-1"]) is None
    assert creds.verdict(attach, "Bearer eng-token", ["router-1"]) is None  # the token adds the engine role
    denied = creds.verdict(route, "Bearer eng-token", ["stranger"])  # the token alone: the engine role
    assert denied is not None and denied.code == grpc.StatusCode.PERMISSION_DENIED and "router role" in denied.why
    wrong = creds.verdict(route, "Bearer nope", ["router-1"])  # a wrong token is never ignored
    assert wrong is not None and wrong.code == grpc.StatusCode.UNAUTHENTICATED
    long = creds.verdict(route, None, ["x" * 500])
    assert long is not None and f"'{'x' * 64}'" in long.why and "x" * 65 not in long.why


def test_the_ray_serve_router_speaks_tls_and_presents_its_certificate(pki: Pki, tmp_path: Path) -> None:
    """The ``ray up`` configs' gateway speaks TLS: ``LoraCacheRouter``'s client (``RouterSettings.client``, what
    the router builds on its loop) takes the CA as PEM text or a file, and its own certificate, and is served by
    a gateway that asks for client certificates; bad settings fail at deployment, naming the fix."""
    import asyncio

    pytest.importorskip("ray.serve")
    from lora_cache.integrations.ray_serve import RouterSettings

    gw = start_gateway_thread(_config(pki), StallController())
    try:
        me = pki.clients["router-1"]
        settings = RouterSettings(server=f"localhost:{gw.port}", tls_ca=pki.ca.cert.read_text(),
                                  tls_client_cert=str(me.cert), tls_client_key=str(me.key))

        async def status() -> int:
            async with settings.client() as lc:
                return (await lc.status()).epoch

        assert asyncio.run(status()) == 1
    finally:
        gw.stop()
    with pytest.raises(ConfigError, match="tls_client_cert and tls_client_key go together"):
        RouterSettings(tls_client_cert=str(me.cert))
    with pytest.raises(ConfigError, match=r"tls_ca '/nope.pem' cannot be read .*give PEM text, or a file"):
        RouterSettings(tls_ca="/nope.pem")
    (tmp_path / "x.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="holds no PEM block"):
        RouterSettings(tls_ca=str(tmp_path / "x.pem"))


def test_client_identities_bind_their_engine_role_and_bad_bindings_are_named(pki: Pki, tmp_path: Path) -> None:
    def roles(doc: object) -> dict[str, Grant]:
        (tmp_path / "roles.json").write_text(json.dumps(doc))
        return GatewayConfig(grpc_host="localhost", grpc_port=0, tls_cert=str(pki.server.cert),
                             tls_key=str(pki.server.key), tls_client_ca=str(pki.ca.cert),
                             tls_client_roles=str(tmp_path / "roles.json")).client_roles()

    got = roles({"router-1": ["router"], "engine-0": {"roles": ["engine"], "replicas": ["replica-0"]}})
    assert got == {"router-1": Grant(frozenset({"router"})),
                   "engine-0": Grant(frozenset({"engine"}), frozenset({"replica-0"}))}
    for doc, expected in [({"e": {"roles": ["engine"], "replicas": []}}, "has replicas []; give a non-empty list"),
                          ({"e": {"roles": ["engine"], "replicas": ["a b"]}}, "has replicas"),
                          ({"e": {"roles": ["engine"], "replica": ["r"]}}, "give only 'roles' and 'replicas'"),
                          ({"e": {"replicas": ["r"]}}, "has roles None")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            roles(doc)
