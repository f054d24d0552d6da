"""TLS for every gRPC hop (router <-> workers, clients <-> router), optionally mutual TLS.

Off by default (local development on loopback). On when this process is given a certificate or a CA:

* ``cert_file`` + ``key_file`` (PEM): this process's certificate chain and key. Servers present it; with
  mutual TLS clients present it too, so one pair per process serves both roles.
* ``ca_file`` (PEM): the CA bundle that peers' certificates must chain to (the system roots when
  unset on a client).
* ``client_auth``: servers require and verify client certificates signed by ``ca_file`` (mutual TLS).
* ``server_name``: the name checked in servers' certificates when it differs from the dialled host.

Every setting is a flag with a ``PD_TLS_*`` environment default, so ``splitserve up`` passes one
configuration to all processes it starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import grpc

from splitserve.env import env_bool, env_str


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    client_auth: bool = False
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS: --tls-cert and --tls-key must be given together")
        if self.client_auth and not (self.ca_file and self.cert_file):
            raise ValueError("TLS: mutual TLS (--tls-client-auth) needs --tls-ca and a certificate (--tls-cert/--tls-key)")
        for path in (self.cert_file, self.key_file, self.ca_file):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS: file not found: {path}")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for a server socket. Raises ValueError without a certificate."""
        if not self.cert_file:
            raise ValueError("TLS: a server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a client channel (presents this process's certificate when it has one)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str | None) -> bytes:
    return Path(path).read_bytes()  # type: ignore[arg-type]


def add_tls_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("TLS (gRPC)")
    g.add_argument("--tls-cert", default=env_str("PD_TLS_CERT"), help="PEM certificate chain of this process")
    g.add_argument("--tls-key", default=env_str("PD_TLS_KEY"), help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=env_str("PD_TLS_CA"), help="PEM CA bundle that peers' certificates chain to")
    g.add_argument("--tls-client-auth", action="store_true", default=env_bool("PD_TLS_CLIENT_AUTH"),
                   help="servers require client certificates signed by --tls-ca (mutual TLS)")
    g.add_argument("--tls-server-name", default=env_str("PD_TLS_SERVER_NAME"), help="name expected in servers' certificates")


def tls_config(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(args.tls_cert or None, args.tls_key or None, args.tls_ca or None, args.tls_client_auth,
                     args.tls_server_name or None)


def tls_from_env(environ: Mapping[str, str] | None = None) -> TlsConfig:
    """The configuration the ``PD_TLS_*`` variables of ``environ`` (default ``os.environ``) describe."""
    return TlsConfig(env_str("PD_TLS_CERT", None, environ), env_str("PD_TLS_KEY", None, environ),
                     env_str("PD_TLS_CA", None, environ), env_bool("PD_TLS_CLIENT_AUTH", False, environ),
                     env_str("PD_TLS_SERVER_NAME", None, environ))
