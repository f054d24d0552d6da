"""`splitserve up`: router + N prefill + M decode workers (+ KV store master and storage nodes) as separate
local processes.

Waits until every process is healthy, prints the endpoints, reports any process that dies,
and on Ctrl-C / SIGTERM stops them gracefully, front to back: the router first (it drains: in-flight
requests finish within the shutdown grace period while the workers still serve them), then the prefill
and decode workers (drained too), then the KV store's storage nodes, then its master; a process still running
after the grace period (plus a margin) is killed. Each child also asks for PR_SET_PDEATHSIG at start-up
(:mod:`splitserve.parent_death`), so none outlives a launcher that is killed outright.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.env import env_float
from splitserve.parent_death import PARENT_PID_ENV
from splitserve.rpc.server import sync_channel
from splitserve.rpc.shutdown import DEFAULT_GRACE_S
from splitserve.rpc.tls import TlsConfig, tls_from_env
from splitserve.transfer import ucx_env_defaults

if TYPE_CHECKING:
    from splitserve.up_config import UpConfig


_PORTS = random.SystemRandom()
_HANDED_OUT: set[int] = set()  # ports free_port returned in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, drawn at random below Linux's ephemeral range (32768+), so that the
    kernel does not hand it to an outgoing connection before the service binds it. Drawn from the OS's
    entropy, not the ``random`` module's state: a test runner that reseeds ``random`` before every test
    (pytest-randomly) would otherwise hand every test the same ports, colliding with a cluster still stopping.
    Never the same port twice in one process: a cluster takes a dozen ports before any is bound, and two equal draws
    (about 1 in 200 per cluster over 12,000 ports) made one of its processes fail with "address already in use"."""
    for _ in range(200):
        port = _PORTS.randrange(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:  # crowded range: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    name: str
    argv: list[str]
    health: str  # "grpc:host:port" or "http://host:port/health"
    metrics: str = ""  # Prometheus endpoint, "http://host:port/metrics"
    env: dict[str, str] = field(default_factory=dict)  # this process's variables on top of the cluster's
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
        env = {**os.environ, **self.env, **child.env, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
        for key, value in ucx_env_defaults().items():
            env.setdefault(key, value)
        child.reported = False
        env[PARENT_PID_ENV] = str(os.getpid())  # the child dies with us (splitserve.parent_death; no preexec_fn)
        child.proc = subprocess.Popen(child.argv, env=env, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 180.0, children: list[Child] | None = None) -> None:
        """Wait until every process (default: all) answers its health check and, when the router is among them,
        the router has every worker in rotation (its ``/health`` is 200 as soon as one decode worker is up; a
        request sent before its first poll of a prefill worker would be prefilled on the decode worker).

        Raises:
            RuntimeError: a process exits, or is not healthy within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.children if children is None else children)
        tls = tls_from_env({**os.environ, **self.env})  # what the children were given
        while pending:
            for child in list(pending):
                code = child.proc.poll()
                if code is not None:
                    raise RuntimeError(f"{child.name} exited with code {code} during start-up")
                if _healthy(child.health, tls) and (child.name != "router" or _all_workers_up(child, self.env)):
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

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM in stages, front to back: the router (the workers move on as soon as it has drained and closed
        its port; its exit overlaps), then the prefill and decode workers, then the KV store's storage nodes
        (each unmounts its segment from the master), then the master and the rest. A process still running
        ``grace_s`` after its SIGTERM (default: the children's shutdown grace, ``PD_SHUTDOWN_GRACE_S``, plus
        10 s) is killed."""
        if grace_s is None:
            grace_s = env_float("PD_SHUTDOWN_GRACE_S", DEFAULT_GRACE_S, {**os.environ, **self.env}) + 10.0
        front, workers, nodes, rest = [], [], [], []
        for child in self.children:
            stage = (front if child.name == "router" else workers if child.name.startswith(("prefill", "decode"))
                     else nodes if child.name.startswith("kvstore-node") else rest)
            stage.append(child)
        front_deadline = self._term(front, grace_s)
        self._wait(front, front_deadline, until_closed=True)
        for stage in (workers, nodes, rest):
            self._wait(stage, self._term(stage, grace_s))
        self._wait(front, front_deadline)

    def interrupt(self) -> None:
        """SIGTERM to every running child again: a process already draining stops at once."""
        for child in self.children:
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    @staticmethod
    def _term(children: list[Child], grace_s: float) -> float:
        for child in children:
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        return time.monotonic() + grace_s

    @staticmethod
    def _wait(children: list[Child], deadline: float, until_closed: bool = False) -> None:
        """Until every child has exited (or, ``until_closed``, no longer accepts connections on its health port);
        SIGKILL those still running at ``deadline``."""
        pending = [c for c in children if c.proc is not None]
        while pending and time.monotonic() < deadline:
            pending = [c for c in pending if c.proc.poll() is None and not (until_closed and not _accepting(c.health))]
            if pending:
                time.sleep(0.05)
        for child in pending:
            if child.proc.poll() is None:
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()


def _accepting(target: str) -> bool:
    """Whether the port of a health target ("grpc:host:port" or "http://host:port/...") accepts connections."""
    address = target.removeprefix("grpc:").removeprefix("http://").removeprefix("https://").split("/")[0]
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _all_workers_up(router: Child, cluster_env: dict[str, str]) -> bool:
    """The router's ``GET /v1/workers`` lists every worker as up (with the router's API key, if it has one)."""
    key = {**os.environ, **cluster_env, **router.env}.get("PD_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        workers = httpx.get(router.health.removesuffix("/health") + "/v1/workers", timeout=1.0, headers=headers).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return all(w.get("state") == "up" for w in workers)


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
    store_nodes: int = 0, master_args: list[str] | None = None, node_args: list[str] | None = None,
    router_args: list[str] | None = None, router_env: dict[str, str] | None = None,
    role_args: dict[str, list[str]] | None = None, elastic: bool = False,
) -> tuple[Cluster, int, int]:
    """Describe a cluster; ports 0 are replaced by free ones (workers' gRPC and /metrics ports are
    always free ones). Returns (cluster, http_port, grpc_port).

    ``router_env`` adds environment variables for the router alone (e.g. PD_API_KEY: a secret stays off every
    command line and out of the other processes).

    ``role_args`` adds flags for the workers of one role only (``{"decode": ["--cpus", "1"]}``).

    ``elastic``: every worker is a `splitserve worker --role prefill|decode` (its role can change in place; still
    named prefill-<i> / decode-<i> after its role at start) and the router gets them all as ``--workers``.

    ``store_nodes`` > 0 adds a KV store master and that many storage nodes, and points every worker at the
    master (``--kvstore-master``); ``master_args``/``node_args`` go to those processes.
    """
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("need at least one prefill and one decode worker")
    if store_nodes < 0:
        raise ValueError("store_nodes must be >= 0")
    http_port = http_port or free_port(host)
    grpc_port = grpc_port or free_port(host)
    py = [sys.executable, "-m", "splitserve.cli"]
    common = ["--model", model, *(worker_args or [])]
    children, prefill_addrs, decode_addrs, store = [], [], [], []
    if store_nodes:  # listed after the workers (children[0] stays prefill-0); workers retry until the master is up
        store, master = store_children(host, store_nodes, master_args, node_args)
        common += ["--kvstore-master", master]
    for role, count, addrs in (("prefill", num_prefill, prefill_addrs), ("decode", num_decode, decode_addrs)):
        for i in range(count):
            port, metrics_port = free_port(host), free_port(host)
            addrs.append(f"{host}:{port}")
            command = ["worker", "--role", role] if elastic else [role]
            argv = [*py, *command, *common, *(role_args or {}).get(role, []), "--host", host, "--port", str(port),
                    "--metrics-port", str(metrics_port)]
            children.append(Child(f"{role}-{i}", argv, f"grpc:{host}:{port}", f"http://{host}:{metrics_port}/metrics"))
    addresses = (["--workers", ",".join(prefill_addrs + decode_addrs)] if elastic
                 else ["--prefill", ",".join(prefill_addrs), "--decode", ",".join(decode_addrs)])
    router = [*py, "router", "--model", model, "--host", host, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
              *addresses, *(router_args or [])]
    children += store
    children.append(Child("router", router, f"http://{host}:{http_port}/health", f"http://{host}:{http_port}/metrics",
                          env=dict(router_env or {})))
    return Cluster(children, env or {}), http_port, grpc_port


def up_cluster(config: UpConfig) -> tuple[Cluster, int, int]:
    """The processes of ``splitserve up`` for ``config`` (nothing started). Returns (cluster, http_port, grpc_port),
    ports 0 replaced by free ones.

    Raises:
        ValueError: as :func:`build_cluster`.
    """
    return build_cluster(
        model=config.model, num_prefill=config.num_prefill, num_decode=config.num_decode, host=config.host,
        http_port=config.http_port, grpc_port=config.grpc_port, worker_args=config.worker_args(),
        env=config.child_env(), store_nodes=config.store_nodes, master_args=["--replicas", str(config.store_replicas)],
        node_args=["--segment-mb", str(config.store_mb)], router_args=config.router_args(), router_env=config.router_env(),
        role_args=config.role_args(), elastic=config.elastic,
    )


def store_children(host: str, num_nodes: int, master_args: list[str] | None = None,
                   node_args: list[str] | None = None) -> tuple[list[Child], str]:
    """A KV store master ("kvstore-master") and ``num_nodes`` storage nodes ("kvstore-node-<i>", node id
    "node-<i>") on free ports. Returns (children, master gRPC address)."""
    py = [sys.executable, "-m", "splitserve.cli"]
    master = f"{host}:{free_port(host)}"
    mport = free_port(host)
    children = [Child("kvstore-master", [*py, "kvstore-master", "--host", host, "--port", master.rpartition(":")[2],
                                         "--metrics-port", str(mport), *(master_args or [])], f"grpc:{master}",
                      f"http://{host}:{mport}/metrics")]
    for i in range(num_nodes):
        port, mport = free_port(host), free_port(host)
        children.append(Child(f"kvstore-node-{i}", [*py, "kvstore-node", "--master", master, "--node-id", f"node-{i}",
                                                    "--host", host, "--port", str(port), "--metrics-port", str(mport),
                                                    *(node_args or [])], f"grpc:{host}:{port}", f"http://{host}:{mport}/metrics"))
    return children, master


def store_health(cluster: Cluster) -> str:
    """One line per KV store process: health, and the master's view (mounted segments, capacity, use).
    Over TLS when the cluster's processes were given it (``PD_TLS_*``)."""
    from pd.v1 import common_pb2, kvstore_pb2_grpc

    tls = tls_from_env({**os.environ, **cluster.env})
    lines = []
    for child in cluster.children:
        if not child.name.startswith("kvstore-"):
            continue
        address = child.health.removeprefix("grpc:")
        state = "SERVING" if _healthy(child.health, tls) else "NOT SERVING"
        detail = ""
        if child.name == "kvstore-master" and state == "SERVING":
            try:
                with sync_channel(address, tls) as channel:
                    c = kvstore_pb2_grpc.KVStoreMasterServiceStub(channel).GetStats(common_pb2.GetStatsRequest(), timeout=2).counters
                detail = (f", {int(c['segments'])} segment(s) mounted, {c['capacity_bytes'] / 2**20:.0f} MiB, "
                          f"{c['used_bytes'] / 2**20:.1f} MiB used, {int(c['objects'])} objects")
            except grpc.RpcError as exc:
                detail = f", stats unavailable: {exc.code().name}"
        lines.append(f"  {child.name:15s}: {address} {state}{detail}")
    return "\n".join(lines)
