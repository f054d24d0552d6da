"""Helpers of the KV store chaos tests: a real cluster with a store (master + storage nodes) whose nodes are
killed (SIGKILL), hung (SIGSTOP) and brought back, and the leak checks run after every test."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import grpc
import pytest
from pd.v1 import common_pb2, decode_pb2_grpc, kvstore_pb2_grpc, prefill_pb2_grpc

from splitserve.client import RouterClient
from splitserve.launcher import Child
from splitserve.model import load_model
from splitserve.paths import default_model_path
from tests.cluster import grpc_address, start_cluster
from tests.idle import wait_idle_sync, wait_until_sync
from tests.idle import wait_until as poll_until
from tests.test_e2e_kvstore import STORIES

B = 16  # block_size of the embedded model
IO_TIMEOUT_S = 2.0  # workers' store read/write deadline (PD_KVSTORE_IO_TIMEOUT_S)
HEARTBEAT_TIMEOUT_S = 2.0
MASTER_ARGS = ["--lease-s", "10", "--put-timeout-s", "5", "--heartbeat-interval-s", "0.2",
               "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)]
NODE_ARGS = ["--segment-mb", "16", "--io-timeout-s", "2"]


def token_pool(n: int = 1024, seed: int = 6) -> list[int]:
    """``n`` token ids: the test stories, then seeded random ids (any slice is a distinct prompt)."""
    tok = load_model(default_model_path(), weights=False).tokenizer
    ids = [t for text in STORIES for t in tok.encode(text)]
    rng = random.Random(seed)
    return ids + [rng.randrange(3, tok.vocab_size) for _ in range(n - len(ids))]


class StoreCluster:
    """Router, prefill and decode workers, a KV store master and ``nodes`` storage nodes."""

    def __init__(self, *, num_prefill: int, nodes: int, replicas: int, worker_args: list[str] = ()) -> None:
        self.cluster, _, self.router = start_cluster(
            num_prefill=num_prefill, num_decode=1, store_nodes=nodes,
            worker_args=["--kv-cache-mb", "32", *worker_args], master_args=["--replicas", str(replicas), *MASTER_ARGS],
            node_args=NODE_ARGS, env={"PD_KVSTORE_IO_TIMEOUT_S": str(IO_TIMEOUT_S)})
        self.num_nodes = nodes
        self._stopped: set[str] = set()

    def stop(self) -> None:
        self.resume_all()
        self.cluster.stop()

    def child(self, name: str) -> Child:
        return next(c for c in self.cluster.children if c.name == name)

    def address(self, name: str) -> str:
        return grpc_address(self.cluster, name)

    def node(self, i: int) -> Child:
        return self.child(f"kvstore-node-{i}")

    def workers(self) -> list[Child]:
        return [c for c in self.cluster.children if c.name.startswith(("prefill", "decode"))]

    # ------------------------------------------------------------------ stats
    def stats(self, name: str) -> dict[str, float]:
        stub_cls = (decode_pb2_grpc.DecodeServiceStub if name.startswith("decode") else
                    kvstore_pb2_grpc.KVStoreMasterServiceStub if name == "kvstore-master" else
                    kvstore_pb2_grpc.KVStoreNodeServiceStub if name.startswith("kvstore-node") else
                    prefill_pb2_grpc.PrefillServiceStub)
        with grpc.insecure_channel(self.address(name)) as ch:
            return dict(stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=5).counters)

    def master(self) -> dict[str, float]:
        return self.stats("kvstore-master")

    def total(self, prefix: str, key: str) -> float:
        return sum(self.stats(w.name).get(key, 0) for w in self.workers() if w.name.startswith(prefix))

    def wait_for(self, what: str, predicate, timeout_s: float) -> float:
        return wait_until_sync(what, predicate, timeout_s)

    def wait_writes(self, timeout_s: float = 10.0) -> None:
        self.wait_for("store writes finished", lambda: self.total("prefill", "kvstore_writes_in_flight") == 0, timeout_s)

    def read_stats(self) -> tuple[dict[str, dict], None]:
        """GetStats counters of every live worker by name (tests/idle.py); the router is not checked here."""
        return {w.name: self.stats(w.name) for w in self.workers()}, None

    def wait_idle(self, timeout_s: float) -> None:
        """Every worker's KV pool back at its baseline, nothing running, held or being written (tests/idle.py)."""
        wait_idle_sync(self.read_stats, timeout_s)

    async def router_stats(self) -> dict[str, float]:
        async with RouterClient(self.router) as client:
            return await client.stats()

    # ------------------------------------------------------------------ faults
    def kill(self, i: int) -> None:
        node = self.node(i)
        node.proc.kill()
        node.proc.wait()
        self._stopped.discard(node.name)

    def hang(self, i: int) -> None:
        os.kill(self.node(i).proc.pid, signal.SIGSTOP)
        self._stopped.add(self.node(i).name)

    def resume(self, i: int) -> None:
        os.kill(self.node(i).proc.pid, signal.SIGCONT)
        self._stopped.discard(self.node(i).name)

    def resume_all(self) -> None:
        for name in list(self._stopped):
            child = self.child(name)
            if child.proc.poll() is None:
                os.kill(child.proc.pid, signal.SIGCONT)
        self._stopped.clear()

    def wait_segments(self, n: int, timeout_s: float) -> float:
        return self.wait_for(f"{n} storage segments mounted", lambda: self.master()["segments"] == n, timeout_s)

    def restore(self) -> None:
        """Resume hung nodes, restart dead ones, and wait until the master has every segment again."""
        self.resume_all()
        dead = [self.node(i) for i in range(self.num_nodes) if self.node(i).proc.poll() is not None]
        for child in dead:
            self.cluster.start_child(child)
        if dead:
            self.cluster.wait_healthy(timeout_s=60, children=dead)
        self.wait_segments(self.num_nodes, timeout_s=10)


async def tokens(address: str, prompt: list[int], max_tokens: int = 12, timeout: float | None = None):
    """(token ids, usage) of one greedy request through a router."""
    ids, usage = [], None
    async with RouterClient(address) as client:
        async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout):
            ids += list(r.token_ids)
            if r.HasField("usage"):
                usage = r.usage
    return ids, usage


async def decoding_stream(address: str, prompt: list[int], max_tokens: int) -> asyncio.Future:
    """Start a greedy stream and return it (a future of its token ids) once it is decoding."""
    running = asyncio.Event()

    async def run() -> list[int]:
        ids = []
        async with RouterClient(address) as client:
            async for r in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                ids += list(r.token_ids)
                if len(ids) >= 3:  # the first token comes from prefill, the next ones from the decode worker
                    running.set()
        return ids

    stream = asyncio.ensure_future(run())
    await asyncio.wait([stream, asyncio.ensure_future(running.wait())], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert running.is_set() and not stream.done(), "the stream did not start decoding"
    return stream


class References:
    """Greedy tokens from the colocated server (no store, no transfer), computed once per prompt."""

    def __init__(self, colocated) -> None:
        self.address = colocated.grpc_address
        self._cache: dict[tuple, list[int]] = {}

    async def __call__(self, prompt: list[int], max_tokens: int = 12) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._cache:
            self._cache[key] = (await tokens(self.address, prompt, max_tokens))[0]
        return self._cache[key]

    async def many(self, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
        return [await self(p, max_tokens) for p in prompts]


# Fixtures shared by the chaos test modules (import them by name; each module defines ``store``; ``refs`` is in
# tests/conftest.py).


@pytest.fixture(autouse=True)
def no_leaks(store):
    """After every test: every worker's KV pool at its baseline, nothing running, held or being written (a
    write stuck on a hung node ends at its I/O timeout); then the nodes are restored."""
    yield
    try:
        store.wait_idle(timeout_s=IO_TIMEOUT_S + 3.0)
    finally:
        store.restore()


async def wait_until(what: str, predicate, timeout_s: float) -> None:
    """Poll a blocking ``predicate`` (gRPC stats) off the event loop until it holds."""
    await poll_until(what, lambda: asyncio.to_thread(predicate), timeout_s)
