"""`splitserve up`: router + N prefill + M decode workers as separate local processes.

Waits until every process is healthy, prints the endpoints, reports any process that dies,
and on Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL after a grace period). Each
child also gets PR_SET_PDEATHSIG, so none outlives a launcher that is killed outright.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.rpc.server import sync_channel
from splitserve.rpc.tls import TlsConfig, tls_from_env
from splitserve.transfer import ucx_env_defaults

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    health: str  # "grpc:host:port" or "http://host:port/health"
    proc: subprocess.Popen | None = None
    reported: bool = False


@dataclass
class Cluster:
    """Processes of one local cluster. ``start`` → ``wait_healthy`` → ``stop``."""

    children: list[Child] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        for child in self.children:
            self.start_child(child)

    def start_child(self, child: Child, extra_env: dict[str, str] | None = None) -> None:
        """(Re)start one child process (e.g. a replacement for one that died)."""
        env = {**os.environ, **self.env, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        for key, value in ucx_env_defaults().items():
            env.setdefault(key, value)
        child.reported = False
        child.proc = subprocess.Popen(child.argv, env=env, preexec_fn=_die_with_parent, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 180.0, children: list[Child] | None = None) -> None:
        """Raises RuntimeError if a process exits or is not healthy within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.children if children is None else children)
        tls = tls_from_env({**os.environ, **self.env})  # what the children were given
        while pending:
            for child in list(pending):
                code = child.proc.poll()
                if code is not None:
                    raise RuntimeError(f"{child.name} exited with code {code} during start-up")
                if _healthy(child.health, tls):
                    pending.remove(child)
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {', '.join(c.name for c in pending)}")
            time.sleep(0.2)

    def dead(self) -> list[Child]:
        """Children that exited since the last call (each reported once)."""
        out = []
        for child in self.children:
            if child.proc and child.proc.poll() is not None and not child.reported:
                child.reported = True
                out.append(child)
        return out

    def stop(self, grace_s: float = 10.0) -> None:
        for child in self.children:
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()


def _healthy(target: str, tls: TlsConfig | None = None) -> bool:
    if target.startswith("http"):
        try:
            return httpx.get(target, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    address = target.removeprefix("grpc:")
    try:
        with sync_channel(address, tls) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def build_cluster(
    *, model: str, num_prefill: int = 1, num_decode: int = 1, host: str = "127.0.0.1", http_port: int = 8000,
    grpc_port: int = 50050, worker_args: list[str] | None = None, env: dict[str, str] | None = None,
) -> tuple[Cluster, int, int]:
    """Describe a cluster; ports 0 are replaced by free ones. Returns (cluster, http_port, grpc_port)."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("need at least one prefill and one decode worker")
    http_port = http_port or free_port(host)
    grpc_port = grpc_port or free_port(host)
    py = [sys.executable, "-m", "splitserve.cli"]
    common = ["--model", model, *(worker_args or [])]
    children, prefill_addrs, decode_addrs = [], [], []
    for role, count, addrs in (("prefill", num_prefill, prefill_addrs), ("decode", num_decode, decode_addrs)):
        for i in range(count):
            port = free_port(host)
            addrs.append(f"{host}:{port}")
            children.append(Child(f"{role}-{i}", [*py, role, *common, "--host", host, "--port", str(port)], f"grpc:{host}:{port}"))
    router = [*py, "router", "--model", model, "--host", host, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
              "--prefill", ",".join(prefill_addrs), "--decode", ",".join(decode_addrs)]
    children.append(Child("router", router, f"http://{host}:{http_port}/health"))
    return Cluster(children, env or {}), http_port, grpc_port
