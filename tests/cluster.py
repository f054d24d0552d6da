"""Test helpers: start real router/prefill/decode (and colocated) processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx

from splitserve.launcher import Cluster, build_cluster, free_port
from splitserve.paths import default_model_path
from splitserve.rpc.server import sync_channel
from splitserve.rpc.tls import tls_from_env

TEST_ENV = {"UCX_NET_DEVICES": "lo", "PD_LOG_LEVEL": "WARNING"}


def start_cluster(num_prefill=1, num_decode=1, worker_args=None, model=None, store_nodes=1, master_args=None,
                  node_args=None, env=None, router_args=None, router_env=None) -> tuple[Cluster, str, str]:
    """Returns (cluster, http base url, router grpc address); caller stops the cluster. Like `splitserve up`,
    it includes a KV store (master + ``store_nodes`` storage nodes of 32 MiB) unless ``store_nodes=0``.
    ``env`` adds environment variables for every process, ``router_env`` for the router alone."""
    cluster, http_port, grpc_port = build_cluster(
        model=str(model or default_model_path()), num_prefill=num_prefill, num_decode=num_decode,
        http_port=0, grpc_port=0, worker_args=worker_args or ["--kv-cache-mb", "64"], env={**TEST_ENV, **(env or {})},
        store_nodes=store_nodes, master_args=master_args, node_args=node_args or ["--segment-mb", "32"],
        router_args=router_args, router_env=router_env,
    )
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=120)
    except Exception:
        cluster.stop()
        raise
    return cluster, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"


def grpc_address(cluster: Cluster, name: str) -> str:
    """gRPC address of a cluster process by name (e.g. "prefill-0", "kvstore-master")."""
    return next(c for c in cluster.children if c.name == name).health.removeprefix("grpc:")


def snapshot(cluster: Cluster) -> dict[str, list[str]]:
    """Each process's argv by name, as started: what :func:`restore` brings the cluster back to."""
    return {c.name: list(c.argv) for c in cluster.children}


def restore(cluster: Cluster, argv: dict[str, list[str]], timeout_s: float = 120.0) -> list[str]:
    """Bring a cluster shared by the tests of a module back to how it started, whatever the test before did:
    every process continued (SIGCONT: one a test SIGSTOPped), every process that exited (SIGKILL, SIGTERM) or
    runs with an argv other than ``argv[name]`` (a test restarted it with other flags) started again with its
    original argv (same ports); then wait until every process is healthy, the router has every worker up (a
    restarted one answered its poll since it came back: not the router's last view of the old process) and the
    KV store master (if any) has a segment of every storage node. Cheap when nothing changed (health checks).

    Args:
        argv: each process's original argv by name (:func:`snapshot` right after start).
    Returns:
        The names of the processes restarted.
    Raises:
        RuntimeError, AssertionError: not healthy again within ``timeout_s``."""
    restarted = []
    for child in cluster.children:
        if child.proc is not None and child.proc.poll() is None:
            os.kill(child.proc.pid, signal.SIGCONT)
            if child.argv == argv[child.name]:
                continue
            child.proc.kill()
            child.proc.wait()
        child.argv = list(argv[child.name])
        cluster.start_child(child)
        restarted.append(child.name)
    cluster.wait_healthy(timeout_s=timeout_s)
    healthy_at = time.monotonic()
    workers = [c.health.removeprefix("grpc:") for c in cluster.children
               if c.name in restarted and c.name.startswith(("prefill", "decode"))]
    router = next((c for c in cluster.children if c.name == "router"), None)
    if workers and router is not None and router.name not in restarted:
        # the router may still hold its view of the old process: wait for a successful poll of the new one
        deadline = time.monotonic() + timeout_s
        while not _polled_since(router, cluster, workers, time.monotonic() - healthy_at):
            assert time.monotonic() < deadline, f"the router has not polled the restarted workers {workers}"
            time.sleep(0.1)
    nodes = sum(c.name.startswith("kvstore-node") for c in cluster.children)
    if nodes:
        master = grpc_address(cluster, "kvstore-master")
        deadline = time.monotonic() + timeout_s
        while _store_segments(master, cluster) != nodes:
            assert time.monotonic() < deadline, f"the KV store master has not every segment ({nodes}) again"
            time.sleep(0.1)
    return restarted


def _polled_since(router, cluster: Cluster, addresses: list[str], seconds: float) -> bool:
    """The router lists every worker up, and each of ``addresses`` answered its poll less than ``seconds`` ago."""
    key = {**os.environ, **cluster.env, **router.env}.get("PD_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        view = httpx.get(router.health.removesuffix("/health") + "/v1/workers", timeout=2.0, headers=headers).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    ago = {w["address"]: w.get("last_ok_s_ago") for w in view}
    return (all(w.get("state") == "up" for w in view)
            and all(ago.get(a) is not None and ago[a] < seconds for a in addresses))


def _store_segments(master: str, cluster: Cluster) -> float:
    from pd.v1 import common_pb2, kvstore_pb2_grpc

    try:
        with sync_channel(master, tls_from_env({**os.environ, **cluster.env})) as ch:
            stub = kvstore_pb2_grpc.KVStoreMasterServiceStub(ch)
            return stub.GetStats(common_pb2.GetStatsRequest(), timeout=5).counters["segments"]
    except grpc.RpcError:
        return -1


class Colocated:
    """`splitserve colocated` in its own process."""

    def __init__(self, model=None, extra=None) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "splitserve.cli", "colocated", "--model", str(model or default_model_path()),
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--kv-cache-mb", "64", *(extra or [])]
        self.proc = subprocess.Popen(argv, env={**os.environ, **TEST_ENV})
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"colocated server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("colocated server not healthy")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def read_up_banner(proc, timeout_s: float = 150) -> list[str]:
    """Lines printed by a `splitserve up` process (stdout piped, text mode) up to and including its
    "Ctrl-C stops the cluster" banner, or until it exits or ``timeout_s`` passes (the caller asserts on them).

    Then a daemon thread keeps reading the pipe into ``proc.later_lines``: the cluster's processes log to it, and a
    pipe nobody reads fills up (64 KiB) and blocks whichever process writes next, mid-request (a CI run hung a
    stream that way)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C stops the cluster" in line:
            break
    proc.later_lines = later = []
    threading.Thread(target=lambda: later.extend(iter(proc.stdout.readline, "")), daemon=True, name="up-stdout").start()
    return lines
