"""TLS on the picker port (service.tls), as the InferencePool gateways connect to a picker:
over TLS, without verifying its certificate (Envoy AI Gateway and kgateway both render an
UpstreamTlsContext with an empty validation context). So a certificate made at start-up
serves them as well as a mounted one; a mounted one serves a gateway that does verify."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SELF_SIGNED = "self-signed"
CERTIFICATE_DAYS = 3650


class TlsError(Exception):
    """service.tls names files that cannot be used; the message says which."""


def server_credentials(setting: str) -> grpc.ServerCredentials | None:
    """None for plaintext (""), else the credentials for "self-signed" or a folder holding
    tls.crt and tls.key (the layout a kubernetes.io/tls Secret is mounted in)."""
    if not setting:
        return None
    if setting == SELF_SIGNED:
        key, certificate = self_signed()
    else:
        key, certificate = _read_pair(Path(setting))
    return grpc.ssl_server_credentials([(key, certificate)])


def self_signed(hostname: str | None = None) -> tuple[bytes, bytes]:
    """(private key, certificate) in PEM: an ECDSA P-256 key, a certificate for this host's
    name and localhost, made anew at each start (nothing secret is kept on disk)."""
    name = hostname or socket.gethostname()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llm-ring endpoint picker")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name), x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, certificate.public_bytes(serialization.Encoding.PEM)


def _read_pair(folder: Path) -> tuple[bytes, bytes]:
    pair = []
    for name in ("tls.key", "tls.crt"):
        path = folder / name
        try:
            pair.append(path.read_bytes())
        except OSError as exc:
            raise TlsError(f"service.tls: cannot read {path}: {exc.strerror or exc}") from None
    key, certificate = pair
    try:
        x509.load_pem_x509_certificate(certificate)
        serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"service.tls: {folder} does not hold a PEM certificate and unencrypted key: {exc}") from None
    return key, certificate
