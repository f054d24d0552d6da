"""Router, prefill and decode in separate Linux network namespaces, joined by veth pairs to a bridge in a fourth
("switch") namespace where the client runs: gRPC (client → router → workers) and UCX (decode pulls KV from prefill)
really cross network boundaries, on the veth interfaces (UCX_NET_DEVICES), with the container UCX settings
(UCX_TLS=tcp,self). Needs root and iproute2; skipped with the reason otherwise. Namespaces are removed in teardown,
also on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.paths import default_model_path
from splitserve.transfer import ucx_env_defaults

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
TAG = f"ss{os.getpid() % 100000}"
SWITCH = f"{TAG}-sw"
NODES = {"router": "10.231.7.1", "prefill": "10.231.7.2", "decode": "10.231.7.3"}
CLIENT_ADDR = "10.231.7.254"
PREFILL_PORT, DATA_PORT, DECODE_PORT, HTTP_PORT, GRPC_PORT = 50061, 50062, 50071, 8000, 50050


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def netns(role: str) -> str:
    return f"{TAG}-{role}"


def veth(role: str) -> str:
    return f"{TAG}{role[0]}0"  # interface inside the role's namespace (<= 15 chars)


def create_network() -> None:
    ip("netns", "add", SWITCH)
    ip("-n", SWITCH, "link", "set", "lo", "up")
    ip("-n", SWITCH, "link", "add", "br0", "type", "bridge")
    ip("-n", SWITCH, "addr", "add", f"{CLIENT_ADDR}/24", "dev", "br0")
    ip("-n", SWITCH, "link", "set", "br0", "up")
    for role, addr in NODES.items():
        ns, dev, peer = netns(role), veth(role), f"sw-{role}"
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", SWITCH)
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        ip("-n", ns, "link", "set", dev, "up")
        ip("-n", SWITCH, "link", "set", peer, "master", "br0")
        ip("-n", SWITCH, "link", "set", peer, "up")


def remove_network() -> None:
    for ns in (*(netns(r) for r in NODES), SWITCH):  # deleting a namespace deletes its veth ends
        ip("netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def network():
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("needs Linux and iproute2 (`ip`): apt-get install iproute2")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN + CAP_NET_ADMIN); not running as root")
    probe = subprocess.run(["ip", "netns", "add", f"{TAG}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"creating network namespaces is not permitted here: {probe.stderr.strip()}")
    ip("netns", "del", f"{TAG}-probe", check=False)
    try:
        create_network()
        yield
    finally:
        remove_network()


def in_ns(ns: str, argv: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, cwd=ROOT, **kw)


def tx_bytes(role: str) -> int:
    stats = json.loads(ip("-n", netns(role), "-s", "-j", "link", "show", veth(role)).stdout)
    return stats[0]["stats64"]["tx"]["bytes"]


@pytest.fixture(scope="module")
def processes(network, tmp_path_factory):
    logs = tmp_path_factory.mktemp("netns-logs")
    py = [sys.executable, "-m", "splitserve.cli"]
    model = str(default_model_path())
    p, d, r = NODES["prefill"], NODES["decode"], NODES["router"]
    argv = {
        "prefill": [*py, "prefill", "--model", model, "--host", p, "--port", str(PREFILL_PORT), "--data-host", p,
                    "--data-port", str(DATA_PORT), "--metrics-port", "-1", "--kv-cache-mb", "64"],
        "decode": [*py, "decode", "--model", model, "--host", d, "--port", str(DECODE_PORT), "--metrics-port", "-1",
                   "--kv-cache-mb", "64"],
        "router": [*py, "router", "--model", model, "--host", r, "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT),
                   "--prefill", f"{p}:{PREFILL_PORT}", "--decode", f"{d}:{DECODE_PORT}"],
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "PD_", "OTEL_"))}
    base.update(ucx_env_defaults(), PYTHONUNBUFFERED="1", PD_LOG_LEVEL="INFO", OTEL_SDK_DISABLED="true", UCX_TLS="tcp,self")
    procs = {}
    try:
        for role, args in argv.items():
            env = {**base, "UCX_NET_DEVICES": veth(role)}  # UCX may only use this namespace's veth
            log = open(logs / f"{role}.log", "w")
            procs[role] = in_ns(netns(role), args, env, stdout=log, stderr=subprocess.STDOUT)
        targets = [f"grpc:{p}:{PREFILL_PORT}", f"grpc:{d}:{DECODE_PORT}", f"http://{r}:{HTTP_PORT}/health"]
        deadline = time.monotonic() + 120
        while targets:  # health checks from the switch namespace: already across the veth pairs
            for role, proc in procs.items():
                if proc.poll() is not None:
                    pytest.fail(f"{role} exited with {proc.returncode}:\n{(logs / f'{role}.log').read_text()[-3000:]}")
            check = subprocess.run(["ip", "netns", "exec", SWITCH, sys.executable, "-m", "splitserve.healthcheck", targets[0]],
                                   capture_output=True, cwd=ROOT, timeout=30)
            if check.returncode == 0:
                targets.pop(0)
            elif time.monotonic() > deadline:
                pytest.fail(f"not healthy after 120 s: {targets}")
            else:
                time.sleep(0.5)
        yield procs, logs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_namespaces_are_isolated(network):
    # nothing of the root namespace's loopback is visible: each role sees only its lo and its veth
    for role in NODES:
        names = {link["ifname"] for link in json.loads(ip("-n", netns(role), "-j", "link", "show").stdout)}
        assert names == {"lo", veth(role)}


def test_generation_crosses_namespaces_over_grpc_and_ucx(processes):
    procs, logs = processes
    tx_prefill, tx_decode = tx_bytes("prefill"), tx_bytes("decode")
    r, p, d = NODES["router"], NODES["prefill"], NODES["decode"]
    out = subprocess.run(["ip", "netns", "exec", SWITCH, sys.executable, "-m", "tests.netns_probe", f"{r}:{GRPC_PORT}",
                          f"http://{r}:{HTTP_PORT}", f"{p}:{PREFILL_PORT}", f"{d}:{DECODE_PORT}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:] + "".join((logs / f"{x}.log").read_text()[-2000:] for x in NODES)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["ids"]) == 12 and result["text"]
    assert result["http_status"] == 200 and result["http_text"], result
    # KV moved prefill → decode over UCX, and the same bytes arrived
    assert result["ucx_bytes_sent"] > 0 and result["ucx_bytes_sent"] == result["ucx_bytes_received"]
    # ... through the prefill namespace's veth (the only interface UCX may use there, and the only way out)
    print(f"\nUCX KV bytes {result['ucx_bytes_sent']}, prefill veth tx {tx_bytes('prefill') - tx_prefill} bytes")
    assert tx_bytes("prefill") - tx_prefill >= result["ucx_bytes_sent"]
    assert tx_bytes("decode") - tx_decode > 0
    for role, proc in procs.items():
        assert proc.poll() is None, f"{role} died"
