"""`splitserve up --served-model-name NAME --api-key KEY`, without starting anything: the router's command line
carries the name, the key travels in the router's environment only, and the banner's example commands use both
(the key as ``$PD_API_KEY``, never its value)."""

from __future__ import annotations

import shlex

import pytest

from splitserve.cli import _up_banner
from splitserve.launcher import Cluster, up_cluster
from splitserve.up_config import UpConfig, parse

KEY = "flag-key-81b2"


def router(cluster: Cluster):
    return next(c for c in cluster.children if c.name == "router")


def test_name_on_the_router_command_line_and_key_in_its_environment_only(monkeypatch):
    monkeypatch.delenv("PD_API_KEY", raising=False)
    config = parse(["--served-model-name", "my-model", "--api-key", KEY, "--http-port", "0", "--grpc-port", "0"])
    cluster, _, _ = up_cluster(config)
    argv = router(cluster).argv
    assert argv[argv.index("--served-model-name") + 1] == "my-model"
    assert router(cluster).env == {"PD_API_KEY": KEY}
    assert all(c.env == {} for c in cluster.children if c.name != "router")
    assert all(KEY not in " ".join(c.argv) for c in cluster.children)
    assert KEY not in repr(config) and "PD_API_KEY" not in cluster.env


def test_without_the_flags_the_router_gets_neither(monkeypatch):
    monkeypatch.delenv("PD_API_KEY", raising=False)
    monkeypatch.delenv("PD_SERVED_MODEL_NAME", raising=False)
    cluster, _, _ = up_cluster(parse(["--http-port", "0", "--grpc-port", "0"]))
    assert "--served-model-name" not in router(cluster).argv and router(cluster).env == {}


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("PD_API_KEY", KEY)
    monkeypatch.setenv("PD_SERVED_MODEL_NAME", "env-model")
    config = parse([])
    assert config.api_key == KEY and config.served_model_name == "env-model"


def test_banner_commands_use_the_served_name_and_the_key_variable(monkeypatch):
    monkeypatch.setattr("splitserve.launcher.store_health", lambda cluster: "")
    monkeypatch.delenv("PD_API_KEY", raising=False)
    config = parse(["--served-model-name", "my model's", "--api-key", KEY])
    banner = _up_banner(config, Cluster(), 8123, 50123)
    assert KEY not in banner
    curl = banner.split("\ntry:\n", 1)[1].split("\n  splitserve generate", 1)[0]
    argv = shlex.split(curl.split("\n", 1)[1].replace("\\\n", " "), comments=True)  # past the comment line, as bash reads it
    assert argv[:2] == ["curl", "-sN"] and "Authorization: Bearer $PD_API_KEY" in argv
    assert '"model": "my model\'s"' in argv[argv.index("-d") + 1]  # quoted for the shell, whatever the name
    assert "splitserve generate --router 127.0.0.1:50123 " in banner

    plain = _up_banner(parse([]), Cluster(), 8123, 50123)
    assert "Authorization" not in plain and "PD_API_KEY" not in plain


def test_up_passes_the_batching_limits_to_every_worker():
    config = parse(["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--enable-chunked-prefill", "--no-store"])
    args = config.worker_args()
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert args[args.index("--max-num-batched-tokens") + 1] == "256"
    assert "--enable-chunked-prefill" in args
    assert "--enable-chunked-prefill" not in parse(["--no-store"]).worker_args()
    with pytest.raises(ValueError, match="--max-num-seqs"):
        UpConfig(model="m", max_num_seqs=0)
