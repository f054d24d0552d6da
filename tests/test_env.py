"""The PD_* environment parser (splitserve/env.py): every spelling it accepts, and a bad value is one usage line
naming the variable (exit 2), never a silent default or a traceback."""

from __future__ import annotations

import math

import pytest

from splitserve import cli
from splitserve.launcher import free_port
from splitserve.env import EnvError, env_bool, env_choice, env_float, env_int, env_str
from splitserve.services.decode.config import parse as parse_decode
from splitserve.services.prefill.config import parse as parse_prefill
from splitserve.up_config import parse as parse_up

@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "Yes", "on", "ON", " on "])
def test_true_spellings(value) -> None:
    assert env_bool("PD_X", False, {"PD_X": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "False", "no", "NO", "off", "Off"])
def test_false_spellings(value) -> None:
    assert env_bool("PD_X", True, {"PD_X": value}) is False


@pytest.mark.parametrize("environ", [{}, {"PD_X": ""}, {"PD_X": "  "}])
def test_unset_or_empty_is_the_default(environ) -> None:
    assert env_bool("PD_X", True, environ) is True
    assert env_int("PD_X", 7, environ) == 7
    assert env_float("PD_X", 2.5, environ) == 2.5
    assert env_str("PD_X", "d", environ) == "d"
    assert env_choice("PD_X", ("a", "b"), "b", environ) == "b"


def test_values_are_parsed_and_stripped() -> None:
    assert env_int("PD_X", 0, {"PD_X": " 42 "}) == 42
    assert env_float("PD_X", 0.0, {"PD_X": "1.5"}) == 1.5
    assert env_float("PD_X", 0.0, {"PD_X": "inf"}) == math.inf
    assert env_str("PD_X", None, {"PD_X": " host "}) == "host"
    assert env_choice("PD_X", ("direct", "store"), "direct", {"PD_X": "store"}) == "store"


@pytest.mark.parametrize(("parse", "value", "expected"), [
    (env_bool, "maybe", "expected a boolean: 1/0, true/false, yes/no, on/off"),
    (env_int, "12.5", "expected an integer"),
    (env_int, "ten", "expected an integer"),
    (env_float, "fast", "expected a number"),
    (env_float, "nan", "expected a number"),
])
def test_a_bad_value_names_the_variable_and_what_is_accepted(parse, value, expected) -> None:
    with pytest.raises(EnvError) as err:
        parse("PD_X", 0, {"PD_X": value})
    assert str(err.value).startswith(f"PD_X={value!r}: {expected}")
    assert err.value.name == "PD_X" and isinstance(err.value, ValueError)


def test_a_bad_choice_lists_the_choices() -> None:
    with pytest.raises(EnvError, match=r"PD_X='carrier-pigeon': expected one of direct, store"):
        env_choice("PD_X", ("direct", "store"), "direct", {"PD_X": "carrier-pigeon"})


def test_chunked_prefill_on_is_on(monkeypatch) -> None:
    """Before the shared parser, ``on`` was silently off here (only 1/true/yes were read as true)."""
    monkeypatch.setenv("PD_ENABLE_CHUNKED_PREFILL", "on")
    assert parse_prefill([]).engine.enable_chunked_prefill is True
    monkeypatch.setenv("PD_ENABLE_CHUNKED_PREFILL", "OFF")
    assert parse_prefill([]).engine.enable_chunked_prefill is False


def test_worker_configs_read_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("PD_BLOCK_SIZE", "32")
    monkeypatch.setenv("PD_KV_CHECKSUM", "yes")
    monkeypatch.setenv("PD_KV_TRANSFER_FAILURE", "error")
    monkeypatch.setenv("PD_DECODE_PORT", "0")
    config = parse_decode([])
    assert (config.engine.block_size, config.kv_checksum, config.kv_transfer_failure, config.port) == (32, True, "error", 0)
    assert parse_decode(["--block-size", "64", "--no-kv-checksum"]).engine.block_size == 64  # flags win


def test_up_reads_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("PD_KVSTORE_NODES", "3")
    monkeypatch.setenv("PD_KVSTORE_REPLICAS", "2")
    config = parse_up(["--model", "synthetic:llama-tiny"])
    assert (config.store_nodes, config.store_replicas) == (3, 2)
    assert parse_up(["--no-store", "--model", "synthetic:llama-tiny"]).store_nodes == 0


@pytest.mark.parametrize(("command", "name", "value", "fragment"), [
    ("prefill", "PD_ENABLE_CHUNKED_PREFILL", "maybe", "PD_ENABLE_CHUNKED_PREFILL='maybe': expected a boolean"),
    ("decode", "PD_BLOCK_SIZE", "sixteen", "PD_BLOCK_SIZE='sixteen': expected an integer"),
    ("decode", "PD_KV_TRANSFER_FAILURE", "retry", "PD_KV_TRANSFER_FAILURE='retry': expected one of fallback, error"),
    ("router", "PD_MISS_LIMIT", "2.5", "PD_MISS_LIMIT='2.5': expected an integer"),
    ("router", "PD_LOCAL_PREFILL_FALLBACK", "sometimes", "PD_LOCAL_PREFILL_FALLBACK='sometimes'"),
    ("router", "PD_REQUEST_TIMEOUT_S", "soon", "PD_REQUEST_TIMEOUT_S='soon': expected a number"),
    ("kvstore-master", "PD_KVSTORE_LEASE_S", "long", "PD_KVSTORE_LEASE_S='long': expected a number"),
    ("kvstore-node", "PD_KVSTORE_SEGMENT_MB", "1e3", "PD_KVSTORE_SEGMENT_MB='1e3': expected an integer"),
    ("up", "PD_KV_CACHE_MB", "lots", "PD_KV_CACHE_MB='lots': expected an integer"),
    ("up", "PD_TLS_CLIENT_AUTH", "please", "PD_TLS_CLIENT_AUTH='please': expected a boolean"),
])
def test_a_bad_variable_is_one_usage_line_and_exit_2(monkeypatch, capsys, command, name, value, fragment) -> None:
    def started(*args, **kwargs):
        raise AssertionError("a server or cluster was started")

    for module, _ in cli.SERVERS.values():
        monkeypatch.setattr(f"{module}.main", started)
    monkeypatch.setattr("splitserve.launcher.Cluster.start", started)
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        cli.main([command])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"splitserve {command}: error: {fragment}"), err
    assert out == ""


def test_a_bad_log_level_is_a_usage_error_too(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PD_LOG_LEVEL", "chatty")
    monkeypatch.setattr("splitserve.launcher.Cluster.start", lambda self: None)
    with pytest.raises(SystemExit) as exit_:
        # free router ports: 8000 and 50050 may be a running cluster's (their check comes first)
        cli.main(["up", "--model", "synthetic:llama-tiny", "--no-store", "--http-port", str(free_port()),
                  "--grpc-port", str(free_port())])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "splitserve up: error: PD_LOG_LEVEL='CHATTY': expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)")
