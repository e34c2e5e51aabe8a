"""TLS material (the gateway's pair and client CA, an attached rank's client certificate), checked before anything
starts: which file is wrong, and why.

gRPC reports a bad certificate or key only when the port is bound, as a bare "failed to add port"; checked
here, each mistake names its file and the fix: a file that holds no PEM certificate (or key), the two files
swapped, an encrypted key (gRPC cannot ask for its passphrase), a certificate that does not parse, and a key
of another certificate. Plain Python (``ssl``), no gRPC.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

from lora_cache.errors import ConfigError

MAX_PEM_BYTES = 1 << 20  # a certificate chain or key is a few KiB; more is not PEM material
_BLOCK = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----")


def check_tls_pair(cert: str, key: str, cert_option: str = "tls_cert", key_option: str = "tls_key") -> None:
    """ConfigError naming the option (``tls_cert``/``tls_key``, or a client's ``cert_option``/``key_option``), the
    file and the fix, unless ``key`` is the private key of the first certificate in ``cert``."""
    c, k = cert_option, key_option
    whose = "server" if c == "tls_cert" else "client"
    cert_kinds, key_kinds = _kinds(c, cert), _kinds(k, key)
    if "CERTIFICATE" not in cert_kinds:
        swapped = any(kind.endswith("PRIVATE KEY") for kind in cert_kinds) and "CERTIFICATE" in key_kinds
        raise ConfigError(f"{c} {cert!r} holds no PEM certificate ('-----BEGIN CERTIFICATE-----')"
                          + (f"; it holds a private key and {k} holds the certificate: swap {_flag(c)} and "
                             f"{_flag(k)}" if swapped else f"; give the {whose}'s certificate chain in PEM"))
    private = [kind for kind in key_kinds if kind.endswith("PRIVATE KEY")]
    if not private:
        raise ConfigError(f"{k} {key!r} holds no PEM private key ('-----BEGIN PRIVATE KEY-----')"
                          + (f"; it holds a certificate: give the private key of {_flag(c)}"
                             if "CERTIFICATE" in key_kinds else f"; give the private key of {_flag(c)} in PEM"))
    if "ENCRYPTED PRIVATE KEY" in private:
        raise ConfigError(f"{k} {key!r} is encrypted; gRPC cannot ask for its passphrase: give an unencrypted "
                          f"key (openssl pkey -in {key} -out KEY.pem) and keep it readable by this user only")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cadata=Path(cert).read_text(errors="replace"))
    except ssl.SSLError as e:
        raise ConfigError(f"{c} {cert!r} does not parse as X.509 ({e.reason or e}); give a PEM certificate "
                          "chain as issued (e.g. openssl x509 -in FILE -noout -text shows it)") from e
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{k} {key!r} is not the private key of {c} {cert!r} (their public keys "
                              "differ); give the key the certificate was issued for") from e
        raise ConfigError(f"{k} {key!r} does not load with {c} {cert!r} ({e.reason or e}); give the "
                          "PEM private key of the certificate") from e


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def check_client_ca(ca: str) -> None:
    """ConfigError naming ``--tls-client-ca``, the file and the fix, unless it holds PEM CA certificates."""
    if "CERTIFICATE" not in _kinds("tls_client_ca", ca):
        raise ConfigError(f"tls_client_ca {ca!r} holds no PEM certificate ('-----BEGIN CERTIFICATE-----'); give the "
                          "certificate of the CA that signs the clients' certificates")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cadata=Path(ca).read_text(errors="replace"))
    except ssl.SSLError as e:
        raise ConfigError(f"tls_client_ca {ca!r} does not parse as X.509 ({e.reason or e}); give the CA's PEM "
                          "certificate as issued") from e


def _kinds(option: str, path: str) -> set[str]:
    """The PEM block kinds in the file (``CERTIFICATE``, ``PRIVATE KEY``, ...)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{option} {path!r} cannot be read ({e.strerror}); give a PEM file this user can "
                          "read") from e
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(f"{option} {path!r} is over {MAX_PEM_BYTES // 1024} KiB: not a PEM certificate or key; "
                          "check the path")
    return set(_BLOCK.findall(data.decode("ascii", errors="replace")))
