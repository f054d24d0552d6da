"""Chaos on the KV store, direct transfer mode: storage nodes killed (SIGKILL) or hung (SIGSTOP) while prefill
workers read cached prefixes from them. A router, 2 prefill workers, 1 decode worker, a master and 2 storage
nodes with one replica per object, all real processes (gRPC control, UCX data).

A failed cache read costs recomputation, never a wrong token: every request gives the colocated server's
greedy tokens. After every test each worker's KV pool is back at its baseline and nothing is held or being
written. Each test has a cluster of its own: a storage node restarted on its address costs each prefill worker one
failed write (its endpoint to the old process) and pauses placement there, which would change where the next test's
prefix lands."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.store_chaos import (B, HEARTBEAT_TIMEOUT_S, IO_TIMEOUT_S, StoreCluster, decoding_stream, no_leaks,  # noqa: F401
                               token_pool, tokens, wait_until)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def store():
    c = StoreCluster(num_prefill=2, nodes=2, replicas=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def pool():
    return token_pool()


async def warm(store: StoreCluster, prompt: list[int], reads: int = 0) -> None:
    """One request that writes the prompt's full blocks to the store, then ``reads`` that read them back
    (round robin: one per prefill worker, so each has its connections to the storage nodes open)."""
    await tokens(store.router, prompt)
    await asyncio.to_thread(store.wait_writes)
    for _ in range(reads):
        await tokens(store.router, prompt + [5])
    await asyncio.to_thread(store.wait_writes)


def in_reads(store: StoreCluster, n_requests: int, hits_before: float, blocks: int):
    """True once ``n_requests`` prefills have found their ``blocks`` cached blocks and are still in prefill."""
    def check() -> bool:
        return (store.total("prefill", "kvstore_hit_blocks") - hits_before >= n_requests * blocks
                and store.total("prefill", "prefills_in_flight") >= n_requests)
    return check


async def test_node_killed_mid_prefix_read(store, refs, pool):
    prefix = pool[0:8 * B]  # 8 full blocks, spread over both nodes
    affected = [prefix + pool[200 + 3 * i : 203 + 3 * i] for i in range(6)]
    unrelated = [pool[250 + 40 * i : 280 + 40 * i] for i in range(2)]  # nothing cached: no store read
    want = await refs.many(affected + unrelated)
    long_ref = await refs(pool[340:370], 400)
    await warm(store, prefix, reads=2)
    before = store.master()
    hits = store.total("prefill", "kvstore_hit_blocks")
    long_stream = await decoding_stream(store.router, pool[340:370], 400)  # already decoding: untouched
    store.hang(0)
    store.hang(1)  # every read of the prefix now waits inside a storage node...
    jobs = [asyncio.ensure_future(tokens(store.router, p)) for p in affected + unrelated]
    await wait_until("prefills reading", in_reads(store, len(affected), hits, 8), timeout_s=IO_TIMEOUT_S - 0.5)
    t0 = time.monotonic()
    store.kill(0)  # ...node-0 dies mid-read, node-1 answers
    store.resume(1)
    results = await asyncio.wait_for(asyncio.gather(*jobs), timeout=10)
    elapsed = time.monotonic() - t0
    assert [ids for ids, _ in results] == want  # recomputed where the read failed: the same tokens
    assert all(u.cached_tokens < len(prefix) for _, u in results[: len(affected)])  # the run ends at a lost block
    assert elapsed < 1.0, elapsed  # the killed node's connections reset: its reads fail at once
    assert await long_stream == long_ref
    assert store.total("prefill", "kvstore_read_failed") >= 1

    # the master drops the dead node after its heartbeat timeout; later puts go to the survivor only
    store.wait_segments(1, timeout_s=HEARTBEAT_TIMEOUT_S + 3.0)
    m = store.master()
    assert m["nodes_dropped"] == before["nodes_dropped"] + 1 and m["objects_lost"] > before["objects_lost"]
    n1, save_failed = store.stats("kvstore-node-1"), store.total("prefill", "kvstore_save_failed")
    saved = store.total("prefill", "kvstore_saved_blocks")
    fresh = pool[400:400 + 4 * B + 3]
    assert (await tokens(store.router, fresh))[0] == await refs(fresh)  # the next request succeeds
    await asyncio.to_thread(store.wait_writes)
    assert store.total("prefill", "kvstore_save_failed") == save_failed
    assert store.total("prefill", "kvstore_saved_blocks") == saved + 4
    assert store.stats("kvstore-node-1")["ucx_bytes_written"] - n1["ucx_bytes_written"] == 4 * 16 * 1024
    # the prefix is rewritten (to node-1) and served from the store again
    await warm(store, affected[0])
    ids, usage = await tokens(store.router, affected[1])
    assert ids == want[1] and usage.cached_tokens == len(prefix)


async def deadline_request(address: str, prompt: list[int], timeout_s: float) -> tuple[list[int], float]:
    t0 = time.monotonic()
    ids, _ = await tokens(address, prompt, timeout=timeout_s)
    return ids, time.monotonic() - t0


async def test_node_hung_mid_prefix_read(store, refs, pool):
    prefix = pool[500:500 + 6 * B]  # 6 full blocks, spread over both nodes
    affected = [prefix + pool[600 + 2 * i : 602 + 2 * i] for i in range(4)]
    late = prefix + pool[620:623]  # sent with a deadline shorter than the I/O timeout
    want = await refs.many([*affected, late])
    await warm(store, prefix, reads=2)
    before = store.master()
    hits = store.total("prefill", "kvstore_hit_blocks")
    store.hang(0)  # hung, not dead: its connections stay open and nothing answers
    t0 = time.monotonic()
    jobs = [asyncio.ensure_future(tokens(store.router, p)) for p in affected]
    with_deadline = asyncio.ensure_future(deadline_request(store.router, late, 1.0))
    await wait_until("prefills reading", in_reads(store, len(affected), hits, 6), timeout_s=IO_TIMEOUT_S - 0.5)
    results = await asyncio.wait_for(asyncio.gather(*jobs), timeout=10)
    assert [ids for ids, _ in results] == want[:-1]
    assert time.monotonic() - t0 < IO_TIMEOUT_S + 2.0  # the read gives up at the I/O timeout
    assert store.total("prefill", "kvstore_read_failed") >= 1
    ids, took = await with_deadline  # its read gave up at half its time left, in time to recompute
    assert ids == want[-1] and took < 1.0
    # still hung: the master drops it after the heartbeat timeout; the cluster keeps serving meanwhile
    store.wait_segments(1, timeout_s=HEARTBEAT_TIMEOUT_S + 3.0)
    assert store.master()["nodes_dropped"] == before["nodes_dropped"] + 1
    t2 = time.monotonic()
    assert (await tokens(store.router, affected[0]))[0] == want[0]
    assert time.monotonic() - t2 < 2.0
    store.resume(0)  # it wakes up, finds itself unknown to the master and mounts a fresh segment
    store.wait_segments(2, timeout_s=5.0)
    assert store.master()["nodes_mounted"] == before["nodes_mounted"] + 1
    await warm(store, affected[1])
    ids, usage = await tokens(store.router, affected[1])
    assert ids == want[1] and usage.cached_tokens == len(prefix)
