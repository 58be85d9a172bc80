"""Certificates, keys and web configuration files for the --web-config tests, made with ``cryptography``."""

from __future__ import annotations

import datetime
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

import bcrypt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: a cheap cost: the tests check behaviour, not bcrypt's strength
COST = 4


def hashed(password: str, cost: int = COST) -> str:
    """A bcrypt hash as htpasswd -B writes it ($2y$)."""
    made = bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()
    return "$2y$" + made[4:]


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
           ca: bool = False, server: bool = False, sans: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer if issuer is not None else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass
class Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate
    the CA signed, and one it did not (self-signed), all as PEM files in `folder`."""

    folder: Path

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _issue("atopgpud test CA", ca_key, None, ca=True)
        self.ca = self.folder / "ca.crt"
        _write_cert(ca, self.ca)
        self.server_cert, self.server_key = self.issue("server", (ca.subject, ca_key), server=True,
                                                       sans=[x509.DNSName("localhost"),
                                                             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        self.client_cert, self.client_key = self.issue("client", (ca.subject, ca_key),
                                                       sans=[x509.DNSName("scraper.example.org")])
        self.stranger_cert, self.stranger_key = self.issue("stranger", None)
        self._ca = (ca.subject, ca_key)

    def issue(self, name: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, server: bool = False,
              sans: list[x509.GeneralName] | None = None) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(name, key, issuer, server=server, sans=sans)
        cert_path, key_path = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        _write_cert(cert, cert_path)
        _write_key(key, key_path)
        return cert_path, key_path

    def reissue_server(self, name: str) -> tuple[Path, Path]:
        """Another server certificate of the same CA, under another name (a renewal)."""
        return self.issue(name, self._ca, server=True,
                          sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])


def web_config(path: Path, tls: dict | None = None, users: dict[str, str] | None = None, **more: object) -> Path:
    """Write a web configuration file (JSON is YAML) and return its path."""
    document: dict[str, object] = dict(more)
    if tls is not None:
        document["tls_server_config"] = tls
    if users is not None:
        document["basic_auth_users"] = users
    path.write_text(json.dumps(document))
    return path
