"""KVStoreClient's data-plane failover (in process, a fake data plane and a fake clock): replicas on a node
that failed are skipped until the suspicion ends, a read never outlives its time budget, and a write with
a replica on a suspect node fails at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from splitserve.errors import StoreIOError
from splitserve.kvstore.client import KVStoreClient, ObjectLocation, PutTicket, ReplicaInfo, checksum
from splitserve.kvstore.suspects import SuspectNodes

SIZE = 64
A, B = "10.0.0.1:1", "10.0.0.2:1"


class FakeData:
    """Stands in for StoreDataClient: nodes in ``dead`` fail, nodes in ``slow`` never answer."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.slow: set[str] = set()
        self.calls: list[tuple[str, str, float]] = []

    async def read(self, endpoint, ranges, timeout_s):
        self.calls.append(("read", endpoint, timeout_s))
        if endpoint in self.slow:
            await asyncio.sleep(timeout_s)
            raise StoreIOError(f"storage node {endpoint} timed out")
        if endpoint in self.dead:
            raise StoreIOError(f"storage node {endpoint}: connection reset")
        for _offset, dst in ranges:
            dst[:] = 7
        return sum(dst.nbytes for _o, dst in ranges)

    async def write(self, endpoint, ranges, timeout_s):
        self.calls.append(("write", endpoint, timeout_s))
        if endpoint in self.dead:
            raise StoreIOError(f"storage node {endpoint}: connection reset")
        return sum(src.nbytes for _o, src in ranges)


@pytest.fixture
async def setup():
    now = [100.0]
    client = KVStoreClient("127.0.0.1:1", io_timeout_s=5.0, suspect_s=10.0, clock=lambda: now[0])
    client.data = FakeData()  # control plane unused: no master behind the channel
    yield client, client.data, now
    await client._channel.close()


def location(key, *endpoints, lease_deadline=1e9):
    good = checksum(np.full(SIZE, 7, np.uint8))
    return ObjectLocation(key, SIZE, good, tuple(ReplicaInfo(f"n{i}", ep, 0, SIZE) for i, ep in enumerate(endpoints)), lease_deadline)


def buffers(n):
    return [np.zeros(SIZE, np.uint8) for _ in range(n)]


async def test_read_fails_over_and_then_skips_the_suspect_node(setup):
    client, data, now = setup
    data.dead.add(A)
    assert await client.read([location("k1", A, B)], buffers(1)) == [None]  # A failed, B served
    assert [c[1] for c in data.calls] == [A, B] and A in client.suspects
    data.calls.clear()
    assert await client.read([location("k2", A, B)], buffers(1)) == [None]
    assert [c[1] for c in data.calls] == [B]  # A is not tried while suspect
    data.calls.clear()
    only_a = await client.read([location("k3", A)], buffers(1))
    assert isinstance(only_a[0], StoreIOError) and "failed recently" in str(only_a[0])
    assert data.calls == []  # failed at once, without trying A
    now[0] += 10.5  # the suspicion ends: A is tried again (and is back)
    data.dead.clear()
    assert await client.read([location("k4", A)], buffers(1)) == [None]
    assert [c[1] for c in data.calls] == [A] and A not in client.suspects


async def test_read_never_outlives_its_budget(setup):
    client, data, _now = setup
    data.slow.add(A)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    results = await client.read([location("k", A, B)], buffers(1), timeout_s=0.2)
    assert loop.time() - t0 < 0.5
    assert isinstance(results[0], StoreIOError)
    assert data.calls[0][2] <= 0.2  # the node request got what was left, not the 5 s I/O timeout
    assert A not in client.suspects  # our budget ran out, not the node's I/O timeout: no suspicion
    data.calls.clear()
    client.io_timeout_s = 0.1  # now the node misses the full I/O timeout: suspect, and B serves
    assert await client.read([location("k", A, B)], buffers(1), timeout_s=5.0) == [None]
    assert [c[1] for c in data.calls] == [A, B] and A in client.suspects


async def test_write_with_a_replica_on_a_suspect_node_fails_at_once(setup):
    client, data, _now = setup
    data.dead.add(A)
    tickets = [PutTicket("w1", 1, SIZE, (ReplicaInfo("a", A, 0, SIZE), ReplicaInfo("b", B, 0, SIZE)))]
    first = await client.write(tickets, buffers(1))
    assert isinstance(first[0], StoreIOError) and A in client.suspects
    data.calls.clear()
    second = await client.write([PutTicket("w2", 2, SIZE, tickets[0].replicas)], buffers(1))
    assert isinstance(second[0], StoreIOError) and data.calls == []
    assert await client.write([PutTicket("w3", 3, SIZE, tickets[0].replicas[1:])], buffers(1)) == [None]


def test_suspicion_expires():
    now = [0.0]
    s = SuspectNodes(2.0, clock=lambda: now[0])
    s.mark(A)
    assert A in s and B not in s and len(s) == 1
    now[0] = 2.5
    assert A not in s and len(s) == 0
    with pytest.raises(ValueError):
        SuspectNodes(-1)
