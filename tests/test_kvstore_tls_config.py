"""TLS settings of the KV store processes and of `splitserve up`: the same flags and PD_TLS_* defaults as every
other gRPC process (tests/test_kvstore_tls.py runs them over mutual TLS)."""

from __future__ import annotations

import pytest

from splitserve.cli import _up
from splitserve.healthcheck import main as healthcheck
from splitserve.rpc.tls import TlsConfig
from splitserve.services.kvstore.master.config import parse as parse_master
from splitserve.services.kvstore.node.config import parse as parse_node
from splitserve.up_config import tls_env as up_tls_env
from tests.certs import make_pki, tls_env


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_master_and_node_take_tls_from_flags_and_env(pki, monkeypatch):
    assert not parse_master([]).tls.enabled and not parse_node([]).tls.enabled  # off by default
    mtls = TlsConfig(pki.cert, pki.key, pki.ca, client_auth=True)
    flags = ["--tls-cert", pki.cert, "--tls-key", pki.key, "--tls-ca", pki.ca, "--tls-client-auth"]
    assert parse_master(flags).tls == mtls and parse_node(flags).tls == mtls
    for key, value in tls_env(pki).items():
        monkeypatch.setenv(key, value)
    assert parse_master([]).tls == mtls and parse_node([]).tls == mtls
    monkeypatch.setenv("PD_TLS_SERVER_NAME", "store.internal")
    assert parse_node([]).tls.server_name == "store.internal"


def test_bad_tls_settings_are_refused(pki, tmp_path):
    with pytest.raises(ValueError, match="together"):
        parse_master(["--tls-cert", pki.cert])
    with pytest.raises(ValueError, match="not found"):
        parse_node(["--tls-ca", str(tmp_path / "missing.pem")])
    with pytest.raises(SystemExit) as exit_:  # up: servers cannot run on a CA alone
        _up(["--tls-ca", pki.ca])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit):
        _up(["--tls-cert", pki.cert, "--tls-key", pki.key, "--tls-client-auth"])  # mTLS needs a CA


def test_up_passes_one_tls_configuration_to_every_process(pki):
    env = up_tls_env(TlsConfig(pki.cert, pki.key, pki.ca, client_auth=True, server_name="localhost"))
    assert env == {**tls_env(pki), "PD_TLS_SERVER_NAME": "localhost"}
    assert up_tls_env(TlsConfig()) == {}


def test_healthcheck_reports_a_bad_tls_configuration(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_TLS_CA", str(tmp_path / "missing.pem"))
    assert healthcheck(["grpc:127.0.0.1:1"]) == 2
