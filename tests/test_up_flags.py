"""`splitserve up --served-model-name NAME --api-key KEY`, without starting anything: the router's command line
carries the name, the key travels in the router's environment only, and the banner's example commands use both
(the key as ``$PD_API_KEY``, never its value)."""

from __future__ import annotations

import shlex
import sys

import pytest

from splitserve.cli import _up_banner, self_command
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


def test_banner_generate_command_runs_as_printed_from_a_venv_that_is_not_activated(monkeypatch, tmp_path):
    exe = tmp_path / ".venv" / "bin" / "splitserve"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(exe), "up"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no splitserve on PATH
    assert self_command() == ".venv/bin/splitserve"
    monkeypatch.setenv("PATH", f"{exe.parent}:/usr/bin:/bin")  # activated: PATH finds this very file
    assert self_command() == "splitserve"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/pytest"])  # not started as splitserve: the plain name
    assert self_command() == "splitserve"


def test_up_passes_the_batching_limits_to_every_worker():
    config = parse(["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--enable-chunked-prefill", "--no-store"])
    args = config.worker_args()
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert args[args.index("--max-num-batched-tokens") + 1] == "256"
    assert "--enable-chunked-prefill" in args
    assert "--enable-chunked-prefill" not in parse(["--no-store"]).worker_args()
    with pytest.raises(ValueError, match="--max-num-seqs"):
        UpConfig(model="m", max_num_seqs=0)


def _argv(cluster: Cluster, name: str) -> list[str]:
    return next(c for c in cluster.children if c.name == name).argv


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_up_passes_push_layer_groups_to_decode_workers_and_decode_migrations_to_the_router(monkeypatch):
    for var in ("PD_KV_PUSH_LAYER_GROUPS", "PD_DECODE_MIGRATIONS"):
        monkeypatch.delenv(var, raising=False)
    config = parse(["--kv-transfer-mode", "push", "--kv-push-layer-groups", "1", "--decode-migrations", "0", "--no-store",
                    "--decode", "2", "--http-port", "0", "--grpc-port", "0"])
    cluster, _, _ = up_cluster(config)
    assert _flag(_argv(cluster, "decode-0"), "--kv-push-layer-groups") == "1"
    assert _flag(_argv(cluster, "decode-1"), "--kv-push-layer-groups") == "1"
    assert "--kv-push-layer-groups" not in _argv(cluster, "prefill-0")  # `splitserve prefill` has no such flag
    assert _flag(_argv(cluster, "router"), "--decode-migrations") == "0"
    assert "--decode-migrations" not in _argv(cluster, "decode-0")
    pull, _, _ = up_cluster(parse(["--kv-push-layer-groups", "1", "--no-store", "--http-port", "0", "--grpc-port", "0"]))
    assert "--kv-push-layer-groups" not in _argv(pull, "decode-0")  # direct pull: no push to configure
    assert _flag(_argv(pull, "router"), "--decode-migrations") == "1"


def test_up_passes_the_disaggregation_stall_cap_to_the_router(monkeypatch):
    monkeypatch.delenv("PD_DISAGG_MAX_STALL_MS", raising=False)
    cluster, _, _ = up_cluster(parse(["--disagg", "auto", "--disagg-max-stall-ms", "75", "--no-store", "--http-port", "0",
                                      "--grpc-port", "0"]))
    assert _flag(_argv(cluster, "router"), "--disagg") == "auto"
    assert _flag(_argv(cluster, "router"), "--disagg-max-stall-ms") == "75"
    monkeypatch.setenv("PD_DISAGG_MAX_STALL_MS", "0")
    assert parse([]).disagg_max_stall_ms == 0.0


def test_up_elastic_workers_all_get_push_layer_groups(monkeypatch):
    monkeypatch.delenv("PD_KV_PUSH_LAYER_GROUPS", raising=False)
    cluster, _, _ = up_cluster(parse(["--elastic", "--kv-transfer-mode", "push", "--kv-push-layer-groups", "2", "--no-store", "--http-port", "0",
                                      "--grpc-port", "0"]))
    for name in ("prefill-0", "decode-0"):  # a worker started as prefill may become a decode worker
        assert _flag(_argv(cluster, name), "--kv-push-layer-groups") == "2"


def test_up_push_and_migration_defaults_and_bounds(monkeypatch):
    monkeypatch.setenv("PD_KV_PUSH_LAYER_GROUPS", "2")  # the default model's 2 layers, one group each
    monkeypatch.setenv("PD_DECODE_MIGRATIONS", "2")
    config = parse([])
    assert (config.kv_push_layer_groups, config.decode_migrations) == (2, 2)
    with pytest.raises(ValueError, match="--kv-push-layer-groups 3 exceeds the model's 2 layers"):
        parse(["--kv-push-layer-groups", "3"])
    monkeypatch.delenv("PD_KV_PUSH_LAYER_GROUPS")
    monkeypatch.delenv("PD_DECODE_MIGRATIONS")
    config = parse([])
    assert (config.kv_push_layer_groups, config.decode_migrations) == (0, 1)  # the workers' and the router's defaults
    with pytest.raises(ValueError, match="--kv-push-layer-groups"):
        UpConfig(model="m", kv_push_layer_groups=-1)
    with pytest.raises(ValueError, match="--decode-migrations"):
        UpConfig(model="m", decode_migrations=-1)


def test_elastic_worker_accepts_push_layer_groups(monkeypatch):
    from splitserve.services.worker.config import parse as worker_parse
    monkeypatch.delenv("PD_KV_PUSH_LAYER_GROUPS", raising=False)
    assert worker_parse(["--kv-push-layer-groups", "2"]).kv_push_layer_groups == 2
    assert worker_parse([]).kv_push_layer_groups == 0
    with pytest.raises(ValueError, match="--kv-push-layer-groups must be >= 0"):
        worker_parse(["--kv-push-layer-groups", "-1"])
    with pytest.raises(ValueError, match="--kv-push-layer-groups 3 exceeds the model's 2 layers"):
        worker_parse(["--kv-push-layer-groups", "3"])
