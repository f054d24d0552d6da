"""The KV store as real processes: a master and two storage nodes (UCX segments), driven by the real client.

Round trip with two replicas, the master never sees object bytes, eviction under memory pressure, a
read that outlives its lease, zombie-write reclamation after the writer is killed, and replica failover
when a storage node is killed (last: it kills a node)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import numpy as np
import pytest
from pd.v1 import common_pb2, kvstore_pb2_grpc

from splitserve.errors import LeaseExpired, ObjectNotFound
from splitserve.kvstore.client import KVStoreClient, ObjectLocation, PutTicket
from splitserve.launcher import Cluster, store_children
from tests.cluster import TEST_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OBJ = 16 * 1024  # one TinyStories KV block
SEGMENT_MB = 1
# heartbeat every 1 s: the master places no replica on a node silent for 2 intervals, and a busy 2-core machine
# (a whole test suite beside this one) delays a 0.2 s heartbeat past 0.4 s often enough to under-replicate a put
MASTER_ARGS = ["--replicas", "2", "--lease-s", "2", "--put-timeout-s", "1", "--heartbeat-interval-s", "1",
               "--heartbeat-timeout-s", "4"]


def _store():
    children, master = store_children("127.0.0.1", 2, MASTER_ARGS, ["--segment-mb", str(SEGMENT_MB)])
    cluster = Cluster(children, TEST_ENV)
    cluster.start()
    try:
        cluster.wait_healthy(timeout_s=60)
        yield cluster, master
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def store():
    """Two storage nodes shared by the tests that leave both alive (any order)."""
    yield from _store()


@pytest.fixture
def own_store():
    """A store of the test's own, for a test that kills a node (the shared one must keep both in any order)."""
    yield from _store()


def child(cluster, name):
    return next(c for c in cluster.children if c.name == name)


def stats(address, stub_cls=kvstore_pb2_grpc.KVStoreMasterServiceStub):
    with grpc.insecure_channel(address) as ch:
        return dict(stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=5).counters)


def node_stats(cluster, i):
    return stats(child(cluster, f"kvstore-node-{i}").health.removeprefix("grpc:"), kvstore_pb2_grpc.KVStoreNodeServiceStub)


def blobs(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, OBJ, dtype=np.uint8) for _ in range(n)]


async def client_for(master, **kw):
    c = KVStoreClient(master, **kw)
    await c.start()
    return c


async def test_round_trip_on_two_replicas_without_bytes_through_the_master(store):
    cluster, master = store
    before = [stats(master), node_stats(cluster, 0), node_stats(cluster, 1)]
    keys, data = [f"rt-{uuid.uuid4().hex[:8]}-{i}" for i in range(24)], blobs(24, 1)
    client = await client_for(master)
    try:
        report = await client.put(keys, data)
        assert sorted(report.written) == sorted(keys) and not report.failed
        again = await client.put(keys[:3], data[:3])
        assert again.existed == keys[:3] and not again.written  # a second writer never overwrites
        locs = await client.lookup(keys)
        assert all(isinstance(l, ObjectLocation) and {r.node_id for r in l.replicas} == {"node-0", "node-1"} for l in locs)
        out = [np.zeros(OBJ, np.uint8) for _ in keys]
        assert await client.read(locs, out) == [None] * len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
    finally:
        await client.close()
    after = [stats(master), node_stats(cluster, 0), node_stats(cluster, 1)]
    moved = len(keys) * OBJ
    written = sum(after[i]["ucx_bytes_written"] - before[i]["ucx_bytes_written"] for i in (1, 2))
    read = sum(after[i]["ucx_bytes_read"] - before[i]["ucx_bytes_read"] for i in (1, 2))
    assert written == 2 * moved and read == moved  # every byte went over UCX to/from the nodes
    master_bytes = sum(after[0][k] - before[0][k] for k in ("grpc_bytes_received", "grpc_bytes_sent"))
    assert master_bytes < moved / 20, master_bytes  # the master saw keys and offsets only


async def test_eviction_under_memory_pressure_keeps_the_most_recent(store):
    cluster, master = store
    n = 2 * SEGMENT_MB * 2**20 // OBJ  # twice what a node holds (every object has a replica on both)
    keys, data = [f"ev-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)], blobs(n, 2)
    evicted_before = stats(master)["evicted_objects"]
    client = await client_for(master)
    try:
        for i in range(0, n, 8):  # in batches, as prefill workers write
            report = await client.put(keys[i : i + 8], data[i : i + 8])
            assert len(report.written) == len(keys[i : i + 8]), report.failed
        s = stats(master)
        assert s["evicted_objects"] - evicted_before >= n // 2 and s["used_bytes"] <= 0.9 * s["capacity_bytes"]
        exist = await client.exist(keys)
        assert not any(exist[:8]) and all(exist[-8:])  # least recently used went first
        locs = await client.lookup(keys[-8:])
        out = [np.zeros(OBJ, np.uint8) for _ in locs]
        assert await client.read(locs, out) == [None] * 8
        assert all(np.array_equal(a, b) for a, b in zip(out, data[-8:]))
        assert isinstance((await client.lookup(keys[:1]))[0], ObjectNotFound)
    finally:
        await client.close()


async def test_read_finishing_after_its_lease_reports_lease_expired(store):
    cluster, master = store
    keys, data = [f"le-{uuid.uuid4().hex[:8]}-{i}" for i in range(4)], blobs(4, 3)
    client = await client_for(master)
    try:
        await client.put(keys, data)
        locs = await client.lookup(keys)  # lease of 2 s starts now
        nodes = [child(cluster, f"kvstore-node-{i}").proc for i in (0, 1)]
        for p in nodes:
            os.kill(p.pid, signal.SIGSTOP)  # a slow storage node
        try:
            reading = asyncio.create_task(client.read(locs, [np.zeros(OBJ, np.uint8) for _ in keys]))
            await asyncio.sleep(2.5)
        finally:
            for p in nodes:
                os.kill(p.pid, signal.SIGCONT)
        results = await reading
        assert all(isinstance(r, LeaseExpired) for r in results), results
        fresh = await client.lookup(keys)  # a new lease, a prompt read: fine again
        out = [np.zeros(OBJ, np.uint8) for _ in keys]
        assert await client.read(fresh, out) == [None] * 4 and np.array_equal(out[2], data[2])
    finally:
        await client.close()


ZOMBIE = """
import asyncio, sys
from splitserve.kvstore.client import KVStoreClient
async def main():
    c = KVStoreClient(sys.argv[1])
    for _ in range(20):  # another test's objects may still be leased (2 s) in the shared 2 x 1 MiB store: no room yet
        t = (await c.put_start([sys.argv[2]], int(sys.argv[3])))[0]
        if type(t).__name__ != "StoreNoSpace":
            break
        await asyncio.sleep(0.5)
    print(type(t).__name__, flush=True)
    await asyncio.sleep(3600)  # killed here: never calls PutEnd
asyncio.run(main())
"""


async def test_zombie_write_of_a_killed_writer_is_reclaimed(store):
    cluster, master = store
    key, size = f"zombie-{uuid.uuid4().hex[:8]}", 256 * 1024
    base = stats(master)
    writer = subprocess.Popen([sys.executable, "-c", ZOMBIE, master, key, str(size)], env={**os.environ, **TEST_ENV},
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "PutTicket"
    finally:
        writer.kill()
        writer.wait()
    assert stats(master)["objects_processing"] >= 1
    client = await client_for(master)
    try:
        deadline = time.monotonic() + 10
        while stats(master)["puts_reclaimed"] == base["puts_reclaimed"]:  # put timeout 1 s, sweep every 0.2 s
            assert time.monotonic() < deadline, "zombie write was never reclaimed"
            await asyncio.sleep(0.1)
        s = stats(master)
        assert s["objects_processing"] == 0 and s["used_bytes"] <= base["used_bytes"]
        ticket = (await client.put_start([key], size))[0]  # the key is free again
        assert isinstance(ticket, PutTicket)
        await client.put_revoke([ticket])
    finally:
        await client.close()


async def test_reads_fail_over_to_a_surviving_replica_when_a_node_is_killed(own_store):
    cluster, master = own_store
    keys, data = [f"fo-{uuid.uuid4().hex[:8]}-{i}" for i in range(8)], blobs(8, 4)
    writer = await client_for(master)  # default timeouts: a fresh store's first UCX connects under load
    client = await client_for(master, io_timeout_s=3.0, connect_timeout_s=0.5)  # gives up on the dead node fast
    try:
        put = await writer.put(keys, data)
        locs = await client.lookup(keys)
        assert all(len(getattr(l, "replicas", ())) == 2 for l in locs), (put, locs)
        for _ in range(10):  # the reader connects to both nodes before one dies (a connect may miss 0.5 s under load)
            if await client.read(await client.lookup(keys), [np.zeros(OBJ, np.uint8) for _ in keys]) == [None] * 8:
                break
        first = locs[0].replicas[0].node_id  # the replica a reader tries first dies
        survivor = "node-1" if first == "node-0" else "node-0"
        victim = child(cluster, f"kvstore-{first}").proc
        victim.kill()
        victim.wait()
        out = [np.zeros(OBJ, np.uint8) for _ in keys]
        assert await client.read(await client.lookup(keys), out) == [None] * 8  # the survivor serves every key
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        deadline = time.monotonic() + 10
        while stats(master)["segments"] != 1:  # heartbeat timeout 4 s
            assert time.monotonic() < deadline, "the master never dropped the dead node"
            await asyncio.sleep(0.2)
        after = await client.lookup(keys)
        assert all([r.node_id for r in l.replicas] == [survivor] for l in after)
        t = (await client.put_start([f"{keys[0]}-new"], OBJ))[0]
        assert [r.node_id for r in t.replicas] == [survivor]
        await client.put_revoke([t])
    finally:
        await client.close()
        await writer.close()
