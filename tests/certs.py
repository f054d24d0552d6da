"""Test PKI: a CA and certificates for 127.0.0.1/localhost, written as PEM files (``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: str  # CA certificate (PEM path)
    cert: str  # leaf certificate for 127.0.0.1 / localhost, server and client auth
    key: str
    other_ca: str  # a second, unrelated CA
    other_cert: str  # a leaf signed by other_ca (must be rejected)
    other_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key, ca_cert, cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _write(path: Path, cert=None, key=None) -> str:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(path)


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("splitserve test CA")
    key, cert = _leaf(ca_key, ca_cert, "splitserve")
    other_ca_key, other_ca_cert = _ca("rogue CA")
    other_key, other_cert = _leaf(other_ca_key, other_ca_cert, "rogue")
    return Pki(
        ca=_write(directory / "ca.pem", cert=ca_cert), cert=_write(directory / "cert.pem", cert=cert),
        key=_write(directory / "key.pem", key=key), other_ca=_write(directory / "other-ca.pem", cert=other_ca_cert),
        other_cert=_write(directory / "other-cert.pem", cert=other_cert), other_key=_write(directory / "other-key.pem", key=other_key),
    )


def tls_env(pki: Pki, client_auth: bool = True) -> dict[str, str]:
    """PD_TLS_* variables for every process of a cluster (mutual TLS by default)."""
    env = {"PD_TLS_CERT": pki.cert, "PD_TLS_KEY": pki.key, "PD_TLS_CA": pki.ca}
    if client_auth:
        env["PD_TLS_CLIENT_AUTH"] = "1"
    return env
