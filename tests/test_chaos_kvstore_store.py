"""Chaos on the KV store in store transfer mode (the decode worker reads the prompt's KV from the store) with
two replicas per object: storage nodes killed (SIGKILL) or hung (SIGSTOP) while decode and prefill workers
read from them. A router, 1 prefill worker (--kv-transfer-mode store), 1 decode worker, a master and 2
storage nodes, all real processes.

Reads go to the surviving replica; when no replica survives the decode worker recomputes. Every request
gives the colocated server's greedy tokens; after every test the KV pools are back at their baseline and
the nodes are restored."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from tests.store_chaos import (B, HEARTBEAT_TIMEOUT_S, IO_TIMEOUT_S, StoreCluster, decoding_stream, no_leaks,  # noqa: F401
                               token_pool, tokens, wait_until)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def store():
    c = StoreCluster(num_prefill=1, nodes=2, replicas=2, worker_args=["--kv-transfer-mode", "store"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def pool():
    return token_pool(seed=7)


class Legs:
    """The router's two calls made by hand, so that a fault can strike between them: Prefill (the KV goes
    to the store), then Decode (the decode worker reads it back)."""

    def __init__(self, store: StoreCluster) -> None:
        self.store = store

    async def prefill(self, request_id: str, prompt: list[int], max_tokens: int) -> prefill_pb2.PrefillResponse:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async with grpc.aio.insecure_channel(self.store.address("prefill-0")) as ch:
            resp = await prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(
                prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling), timeout=30)
        assert resp.kv_handle.via_store
        await asyncio.to_thread(self.store.wait_writes)
        return resp

    async def decode(self, request_id: str, prompt: list[int], max_tokens: int, resp) -> list[int]:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async with grpc.aio.insecure_channel(self.store.address("decode-0")) as ch:
            msgs = [m async for m in decode_pb2_grpc.DecodeServiceStub(ch).Decode(decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling, kv_handle=resp.kv_handle,
                first_token_id=resp.first_token_id), timeout=30)]
        return [resp.first_token_id] + [t for m in msgs for t in m.token_ids]


async def kill_mid_decode_read(store: StoreCluster, prompt: list[int], max_tokens: int, kill: list[int]) -> list[int]:
    """Prefill ``prompt`` into the store, hang both nodes, start its decode (which then waits inside a
    read), kill the nodes in ``kill`` and resume the others; returns the request's tokens."""
    legs = Legs(store)
    resp = await legs.prefill("store-chaos", prompt, max_tokens)
    hits = store.total("decode", "kvstore_hit_blocks")
    store.hang(0)
    store.hang(1)
    decoding = asyncio.ensure_future(legs.decode("store-chaos", prompt, max_tokens, resp))
    n_objects = -(-len(prompt) // B)
    await wait_until("decode reading", lambda: store.total("decode", "kvstore_hit_blocks") - hits >= n_objects, IO_TIMEOUT_S)
    t0 = time.monotonic()
    for i in (0, 1):
        if i in kill:
            store.kill(i)
        else:
            store.resume(i)
    ids = await asyncio.wait_for(decoding, timeout=10)
    assert time.monotonic() - t0 < IO_TIMEOUT_S + 2.0
    return ids


async def test_node_killed_mid_decode_read_uses_the_surviving_replica(store, refs, pool):
    prompt = pool[200:200 + 5 * B + 7]  # 5 full blocks and a tail object
    want = await refs(prompt, 16)
    before = store.stats("decode-0")
    assert await kill_mid_decode_read(store, prompt, 16, kill=[0]) == want
    after = store.stats("decode-0")
    assert after["kvstore_loaded_tokens"] - before["kvstore_loaded_tokens"] == len(prompt)  # all from node-1
    assert after["kvstore_recomputed_tokens"] == before["kvstore_recomputed_tokens"]
    assert after["kv_bytes_received"] == before["kv_bytes_received"]  # nothing pulled from the prefill worker
    # the master drops node-0; later puts go to node-1 only, and the next requests are served as before
    store.wait_segments(1, timeout_s=HEARTBEAT_TIMEOUT_S + 3.0)
    failed = store.total("prefill", "kvstore_save_failed")
    for p in (pool[300:300 + 3 * B + 2], prompt + pool[400:404]):
        assert (await tokens(store.router, p, 16))[0] == await refs(p, 16)
    await asyncio.to_thread(store.wait_writes)
    assert store.total("prefill", "kvstore_save_failed") == failed
    assert store.stats("decode-0")["kvstore_recomputed_tokens"] == before["kvstore_recomputed_tokens"]


async def test_every_replica_killed_mid_decode_read_recomputes(store, refs, pool):
    prompt = pool[500:500 + 4 * B + 3]
    want = await refs(prompt, 16)
    before = store.stats("decode-0")
    assert await kill_mid_decode_read(store, prompt, 16, kill=[0, 1]) == want  # recomputed: the same tokens
    after = store.stats("decode-0")
    assert after["kvstore_recomputed_tokens"] - before["kvstore_recomputed_tokens"] == len(prompt)
    assert after.get("kvstore_read_failed", 0) > before.get("kvstore_read_failed", 0)
    # no storage node left: the prefill worker falls back to a direct pull
    store.wait_segments(0, timeout_s=HEARTBEAT_TIMEOUT_S + 3.0)
    p = pool[600:600 + 2 * B + 5]
    assert (await tokens(store.router, p, 16))[0] == await refs(p, 16)


async def test_node_hung_mid_read_fails_over_to_the_other_replica(store, refs, pool):
    prefix = pool[700:700 + 6 * B]
    affected = [prefix + pool[800 + 5 * i : 805 + 5 * i] for i in range(4)]
    want = await refs.many(affected, 16)
    long_ref = await refs(pool[900:930], 400)
    await tokens(store.router, prefix, 16)
    await asyncio.to_thread(store.wait_writes)
    before = store.master()
    long_stream = await decoding_stream(store.router, pool[900:930], 400)  # already decoding: untouched
    store.hang(0)
    t0 = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(tokens(store.router, p, 16) for p in affected)), timeout=15)
    assert [ids for ids, _ in results] == want
    assert all(u.cached_tokens == len(prefix) for _, u in results)  # read from node-1 after node-0 timed out
    assert time.monotonic() - t0 < IO_TIMEOUT_S + 3.0
    assert await long_stream == long_ref
    store.wait_segments(1, timeout_s=HEARTBEAT_TIMEOUT_S + 3.0)
    assert store.master()["nodes_dropped"] == before["nodes_dropped"] + 1
    store.resume(0)
    store.wait_segments(2, timeout_s=5.0)
    p = prefix + pool[950:960]
    ids, usage = await tokens(store.router, p, 16)
    assert ids == await refs(p, 16) and usage.cached_tokens == len(prefix)
