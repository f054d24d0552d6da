"""Bad settings on every command: one line `splitserve <cmd>: error: ...` on stderr, exit 2, nothing started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve import cli, launcher

CASES = [
    # (argv, fragment of the error)
    (["decode", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["decode", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["decode", "--kv-cache-mb", "-1"], "--kv-cache-mb must be >= 1, got -1"),
    (["decode", "--port", "70000"], "--port must be a TCP port in [0, 65535]"),
    (["decode", "--kv-transfer-timeout-s", "0"], "kv_transfer_timeout_s must be > 0"),
    (["decode", "--metrics-port", "-2"], "metrics_port must be"),
    (["decode", "--model", "/nonexistent/model"], "--model: no such file or directory: /nonexistent/model"),
    (["decode", "--model", "synthetic:llama-1t"], "unknown synthetic model 'synthetic:llama-1t'; known: synthetic:"),
    (["decode", "--kv-transfer-mode", "store"], "--kv-transfer-mode store needs --kvstore-master"),
    (["prefill", "--port", "-1"], "--port must be a TCP port"),
    (["prefill", "--data-port", "65536"], "--data-port must be a TCP port"),
    (["prefill", "--kv-lease-s", "0"], "kv_lease_s must be > 0"),
    (["prefill", "--data-advertise", "nohost"], "data_advertise"),
    (["prefill", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens must be >= 0 (0: the default for the chunking mode), got -1"),
    (["router", "--disagg", "foo"], "--disagg must be 'always', 'auto' or a token count, got 'foo'"),
    (["router", "--http-port", "99999"], "--http-port must be a TCP port"),
    (["router", "--grpc-port", "-5"], "--grpc-port must be a TCP port"),
    (["router", "--policy", "random"], "--policy must be one of"),
    (["router", "--prefill", ","], "at least one --prefill"),
    (["router", "--miss-limit", "0"], "--miss-limit"),
    (["router", "--tls-cert", "/nope/cert.pem", "--tls-key", "/nope/key.pem"], "TLS: file not found: /nope/cert.pem"),
    (["router", "--tls-cert", "/etc/hostname"], "--tls-cert and --tls-key must be given together"),
    (["router", "--tls-client-auth"], "mutual TLS (--tls-client-auth) needs --tls-ca"),
    (["colocated", "--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["colocated", "--max-model-len", "99999"], "--max-model-len 99999 exceeds the model's maximum context length 512"),
    (["prefill", "--max-model-len", "-1"], "--max-model-len must be >= 0"),
    (["decode", "--decode-threads", "-2"], "--decode-threads must be >= -1"),
    (["colocated", "--http-port", "65536"], "--http-port must be a TCP port"),
    (["colocated", "--tls-ca", "/nope/ca.pem"], "TLS: file not found"),
    (["kvstore-master", "--replicas", "0"], "default_replicas must be in [1, 16]"),
    (["kvstore-master", "--evict-low", "0.95"], "evict_low <= evict_high"),
    (["kvstore-master", "--port", "100000"], "--port must be a TCP port"),
    (["kvstore-node", "--segment-mb", "0"], "segment_mb must be >= 1"),
    (["kvstore-node", "--data-port", "-1"], "--data-port must be a TCP port"),
    (["up", "--prefill", "0"], "need at least one prefill and one decode worker"),
    (["up", "--store-nodes", "-1"], "--store-nodes must be >= 0"),
    (["up", "--max-model-len", "4097", "--model", "synthetic:llama-tiny"],
     "prefill-0: --max-model-len 4097 exceeds the model's maximum context length 4096"),
    (["up", "--block-size", "0"], "prefill-0: --block-size must be >= 1, got 0"),
    (["up", "--http-port", "99999"], "router: --http-port must be a TCP port"),
    (["up", "--disagg", "foo"], "router: --disagg must be"),
    (["up", "--store-mb", "0"], "kvstore-node-0: segment_mb must be >= 1"),
    (["up", "--store-nodes", "17", "--store-replicas", "17"], "kvstore-master: default_replicas must be in [1, 16]"),
    (["up", "--store-replicas", "3"], "--store-replicas 3 needs at least as many storage nodes (--store-nodes 1)"),
    (["up", "--http-port", "18100", "--grpc-port", "18100"], "--http-port and --grpc-port must differ"),
    (["up", "--model", "/nonexistent/model"], "prefill-0: --model: no such file or directory"),
    (["up", "--no-store", "--kv-transfer-mode", "store"], "--kv-transfer-mode store needs the KV store"),
    (["up", "--kv-transfer-mode", "push", "--kv-push-layer-groups", "3"],
     "--kv-push-layer-groups 3 exceeds the model's 2 layers (at most 2; 0: one group per layer)"),
    (["decode", "--kv-push-layer-groups", "3"], "--kv-push-layer-groups 3 exceeds the model's 2 layers"),
    (["worker", "--kv-push-layer-groups", "5"], "--kv-push-layer-groups 5 exceeds the model's 2 layers"),
    (["decode", "--kv-push-layer-groups", "-1"], "--kv-push-layer-groups must be >= 0 (0: one per layer), got -1"),
    (["router", "--chat-token-continuity-mb", "0"], "--chat-token-continuity-mb must be >= 1 (MiB), got 0"),
    (["colocated", "--chat-token-continuity-mb", "-2"], "--chat-token-continuity-mb must be >= 1 (MiB), got -2"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["generate", "hi", "--seed", str(2**63)], "--seed must be a signed 64-bit integer"),
    (["up", "--disagg-max-stall-ms", "-1"], "--disagg-max-stall-ms must be >= 0 (0: no cap), got -1"),
    (["router", "--disagg-max-stall-ms", "-5"], "--disagg-max-stall-ms must be >= 0 (0: no cap), got -5"),
    (["generate", "hi", "--tls-ca", "/nope/ca.pem"], "TLS: file not found"),
]


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail at once (instead of serving forever) if a command got past its settings."""
    def started(*args, **kwargs):
        raise AssertionError("a server or cluster was started")

    for module, _ in cli.SERVERS.values():
        monkeypatch.setattr(f"{module}.main", started)
    monkeypatch.setattr(launcher.Cluster, "start", started)
    monkeypatch.setattr(cli.asyncio, "run", started)


@pytest.mark.parametrize(("argv", "fragment"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_setting_is_one_usage_line_and_exit_2(argv, fragment, nothing_starts, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"splitserve {argv[0]}: error: "), err
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


def test_argparse_errors_still_exit_2(nothing_starts, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["decode", "--port", "abc"])
    assert exit_.value.code == 2 and "splitserve decode: error: argument --port: invalid int value" in capsys.readouterr().err


def test_help_exits_0_without_starting(nothing_starts, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["router", "--help"])
    assert exit_.value.code == 0 and "usage: splitserve router" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["decode", "--port", "0", "--block-size", "32"],
    ["decode", "--kv-push-layer-groups", "2"],  # as many groups as the default model has layers
    ["router", "--no-chat-token-continuity", "--chat-token-continuity-mb", "1"],
    ["prefill", "--model", "synthetic:llama-tiny"],
    ["router", "--model", "synthetic:llama-tiny", "--disagg", "64", "--http-port", "0"],
    ["colocated", "--http-port", "65535"],
    ["kvstore-node", "--port", "0", "--data-port", "0"],
])
def test_good_settings_reach_the_server(monkeypatch, argv) -> None:
    seen = []
    monkeypatch.setattr(f"{cli.SERVERS[argv[0]][0]}.main", lambda rest: seen.append(rest))
    cli.main(argv)
    assert seen == [argv[1:]]


@pytest.mark.slow
@pytest.mark.integration
def test_a_real_process_prints_no_traceback() -> None:
    """The installed entry point, end to end (one case: each process start imports torch)."""
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode", "--num-blocks", "-1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "splitserve decode: error: --num-blocks must be >= 0 (0: as many as --kv-cache-mb holds), got -1"
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode", "--block-size", "0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("splitserve decode: error: --block-size must be >= 1, got 0")
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
def test_a_port_in_use_is_one_error_line_not_a_traceback() -> None:
    """A server whose gRPC port is taken exits 1 with one line naming the address (kvstore-master: no torch import)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "kvstore-master", "--port", str(port), "--metrics-port", "-1"],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"splitserve kvstore-master: error: cannot listen on 127.0.0.1:{port} (gRPC): the port is in use or the address is not local")


@pytest.mark.integration
@pytest.mark.parametrize("flag, what", [("--http-port", "HTTP"), ("--grpc-port", "gRPC")])
def test_up_on_a_busy_port_is_one_line_at_once(flag, what) -> None:
    """Before any process starts (was: ~90 lines of tracebacks after ~10 s)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the other listener gets a free port too: its default (8000 / 50051) may be another cluster's
        other = ["--grpc-port", str(launcher.free_port())] if flag == "--http-port" else ["--http-port", str(launcher.free_port())]
        proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "up", flag, str(port), *other], capture_output=True,
                              text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"splitserve up: error: cannot listen on 127.0.0.1:{port} ({what}): the port is in use or the address is not local"]


@pytest.mark.integration
def test_up_with_a_model_folder_missing_its_tokenizer_is_one_line_before_anything_starts(tmp_path) -> None:
    import shutil

    from splitserve.paths import default_model_path

    for name in ("config.json", "model.safetensors"):
        shutil.copy(default_model_path() / name, tmp_path / name)
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "up", "--model", str(tmp_path), "--http-port", "0",
                           "--grpc-port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"--model: {tmp_path} has no tokenizer.json (only fast tokenizers are supported)")
