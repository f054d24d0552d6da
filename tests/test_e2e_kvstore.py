"""Prefix reuse through the KV store in a real cluster: router, 2 prefill workers, 1 decode worker, a store
master and 2 storage nodes (2 replicas), all separate processes (gRPC control, UCX data).

Every output is compared token for token with the colocated server (no store: the cold run)."""

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, kvstore_pb2_grpc, prefill_pb2_grpc

from splitserve.model import load_model
from splitserve.paths import default_model_path
from tests.cluster import grpc_address, restore, snapshot, start_cluster
from tests.test_e2e_disaggregated import grpc_tokens

pytestmark = [pytest.mark.integration, pytest.mark.slow]

B = 16
STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    "One day, she saw a big red ball in the park. She ran to get it, but a dog took it first. "
    "Lily was sad. Her mom came and gave her a hug. They went home and baked a cake together.",
    "Tom had a small boat. He liked to sail on the lake with his dad. One morning the wind was strong "
    "and the boat went fast. Tom laughed and held on tight. Then it began to rain, so they went back home.",
    "Sue found a shiny stone in the garden. She showed it to her brother Max. Max said it was magic. "
    "They put the stone under a tree and made a wish. The next day a little bird sang for them.",
    "Ben and his cat lived in a blue house by the sea. Every evening they watched the boats come in. "
    "One night a big storm came, and Ben was scared. His cat sat on his lap and purred until he fell asleep.",
]


@pytest.fixture(scope="module")
def pool():
    tok = load_model(default_model_path(), weights=False).tokenizer
    ids = []
    for text in STORIES:
        ids += tok.encode(text)
    assert len(ids) >= 150
    return ids


def start_store_cluster():
    return start_cluster(
        num_prefill=2, num_decode=1, store_nodes=2,
        master_args=["--replicas", "2", "--lease-s", "3", "--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "6"],
        node_args=["--segment-mb", "16"],
    )


@pytest.fixture(scope="module")
def shared_store_cluster():
    c, base_url, router = start_store_cluster()
    yield c, base_url, router, snapshot(c)
    for child in c.children:  # never leave a stopped process behind
        if child.proc.poll() is None:
            os.kill(child.proc.pid, signal.SIGCONT)
    c.stop()


@pytest.fixture
def store_cluster(shared_store_cluster):
    """(cluster, base url, router gRPC address): the module's cluster, every process running (a test SIGSTOPs
    the storage nodes for a while) and both storage nodes mounted."""
    c, base_url, router, argv = shared_store_cluster
    restore(c, argv)
    return c, base_url, router


@pytest.fixture
def own_store_cluster():
    """A cluster like the module's, for one test that kills a storage node: a node restarted on the same address
    costs each prefill worker one failed write (its endpoint to the old process) and the master then places
    nothing there for the heartbeat timeout, which would change what the next test finds cached."""
    c, base_url, router = start_store_cluster()
    yield c, base_url, router
    c.stop()


def stats(address, stub_cls=prefill_pb2_grpc.PrefillServiceStub) -> dict:
    with grpc.insecure_channel(address) as ch:
        return dict(stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=5).counters)


def prefill_stats(cluster) -> list[dict]:
    return [stats(grpc_address(cluster, f"prefill-{i}")) for i in (0, 1)]


def master_stats(cluster) -> dict:
    return stats(grpc_address(cluster, "kvstore-master"), kvstore_pb2_grpc.KVStoreMasterServiceStub)


def total(rows, key):
    return sum(r.get(key, 0) for r in rows)


def wait_for_writes(cluster, timeout_s=10.0):
    """Block until no prefill worker has a KV store write in flight (writes run after the response)."""
    deadline = time.monotonic() + timeout_s
    while total(prefill_stats(cluster), "kvstore_writes_in_flight"):
        assert time.monotonic() < deadline, "KV store writes did not finish"
        time.sleep(0.05)


async def both(router, colocated, prompt, max_tokens=12):
    got = await grpc_tokens(router, prompt, max_tokens, ignore_eos=True)
    ref = await grpc_tokens(colocated.grpc_address, prompt, max_tokens, ignore_eos=True)
    assert got[0] == ref[0] and got[1] == ref[1]
    return got


@pytest.mark.parametrize("length,start", [(B - 1, 0), (B, 2), (B + 1, 4), (2 * B, 6)])
async def test_reused_prefix_gives_the_cold_output(store_cluster, colocated, pool, length, start):
    cluster, _, router = store_cluster
    prefix = pool[start : start + length]  # each case starts elsewhere: its own hash chain
    first = await both(router, colocated, prefix)
    assert first[2].cached_tokens == 0
    wait_for_writes(cluster)
    prompt = prefix + pool[100:110]  # the cached prefix followed by new tokens
    unrelated = [pool[120 + 3 * i : 140 + 5 * i] for i in range(3)]
    results = await asyncio.gather(both(router, colocated, prompt, 16), *(both(router, colocated, u, 8) for u in unrelated))
    assert results[0][2].cached_tokens == (length // B) * B
    assert results[0][2].prompt_tokens == len(prompt)


async def test_cached_tokens_skip_prefill_work_and_show_in_usage(store_cluster, pool):
    cluster, base_url, _ = store_cluster
    prompt = pool[30:83]  # 53 tokens: 3 full blocks
    before = prefill_stats(cluster)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        body = {"model": "TinyStories-656K", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        cold = (await http.post("/v1/completions", json=body)).json()
        wait_for_writes(cluster)
        middle = prefill_stats(cluster)
        warm = (await http.post("/v1/completions", json=body)).json()
    after = prefill_stats(cluster)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert total(middle, "prefill_tokens") - total(before, "prefill_tokens") == 53  # cold: every prompt token
    assert total(after, "prefill_tokens") - total(middle, "prefill_tokens") == 53 - 48  # warm: only the rest
    assert total(after, "kvstore_cached_tokens") - total(middle, "kvstore_cached_tokens") == 48


async def test_concurrent_same_prefix_on_two_workers_writes_once(store_cluster, colocated, pool):
    cluster, _, router = store_cluster
    prefix = pool[40:104]  # 64 tokens = 4 full blocks
    tails = [pool[130:135], pool[140:145], pool[150:155]]  # 5 tokens each: no further full block
    before_p, before_m = prefill_stats(cluster), master_stats(cluster)
    await asyncio.gather(*(both(router, colocated, prefix + t) for t in tails[:2]))
    wait_for_writes(cluster)
    after_p, after_m = prefill_stats(cluster), master_stats(cluster)
    assert [a["requests"] - b["requests"] for a, b in zip(after_p, before_p)] == [1, 1]  # one on each prefill worker
    assert after_m["puts_completed"] - before_m["puts_completed"] == 4  # one clean write of the 4 blocks
    assert after_m["objects"] - before_m["objects"] == 4
    assert total(after_p, "kvstore_saved_blocks") - total(before_p, "kvstore_saved_blocks") == 4
    third = await both(router, colocated, prefix + tails[2])  # reads what was written: cold output
    assert third[2].cached_tokens == 64


async def test_master_never_moves_kv_bytes(store_cluster, pool):
    cluster, _, router = store_cluster
    await grpc_tokens(router, pool[10:90], 4, ignore_eos=True)
    wait_for_writes(cluster)
    await grpc_tokens(router, pool[10:90] + [5], 4, ignore_eos=True)  # a reuse: reads blocks back
    m = master_stats(cluster)
    nodes = [stats(grpc_address(cluster, f"kvstore-node-{i}"), kvstore_pb2_grpc.KVStoreNodeServiceStub) for i in (0, 1)]
    moved = total(nodes, "ucx_bytes_written") + total(nodes, "ucx_bytes_read")
    assert total(nodes, "ucx_bytes_read") > 0 and moved > 0
    assert m["grpc_bytes_received"] + m["grpc_bytes_sent"] < moved / 10


async def test_read_outliving_its_lease_is_recomputed(own_store_cluster, colocated, pool):
    """A cluster of its own: the stopped nodes may be marked as failed on the prefill workers, which would change
    what later tests find cached. Both prefill workers first write to the store, so each holds its connections to the
    nodes: the read then outlives its lease (a first connection to a stopped node would time out instead; a CI run in
    random order failed on that)."""
    cluster, _, router = own_store_cluster
    prefix = pool[12:60]  # 3 full blocks
    await both(router, colocated, prefix)
    for start in range(60, 140, 16):  # other prompts until both prefill workers have written
        if all(r.get("kvstore_bytes_written", 0) > 0 for r in prefill_stats(cluster)):
            break
        await asyncio.gather(*(both(router, colocated, pool[s:s + 40]) for s in (start, start + 3)))
        wait_for_writes(cluster)
    assert all(r.get("kvstore_bytes_written", 0) > 0 for r in prefill_stats(cluster))
    wait_for_writes(cluster)
    before = prefill_stats(cluster)
    nodes = [c.proc for c in cluster.children if c.name.startswith("kvstore-node")]
    for p in nodes:
        os.kill(p.pid, signal.SIGSTOP)  # slow storage nodes: the read takes longer than the 3 s lease
    try:
        request = asyncio.create_task(both(router, colocated, prefix + pool[131:140]))
        await asyncio.sleep(4.0)
    finally:
        for p in nodes:
            os.kill(p.pid, signal.SIGCONT)
    got = await request  # same tokens as the cold run
    assert got[2].cached_tokens == 0
    assert total(prefill_stats(cluster), "kvstore_lease_expired") > total(before, "kvstore_lease_expired")


async def test_reads_use_the_surviving_replica_when_a_storage_node_dies(own_store_cluster, colocated, pool):
    """Kills a storage node (of a cluster of its own)."""
    cluster, _, router = own_store_cluster
    prefix = pool[70:118]  # 3 full blocks, on both nodes
    await both(router, colocated, prefix)
    wait_for_writes(cluster)
    victim = next(c for c in cluster.children if c.name == "kvstore-node-0")
    victim.proc.kill()
    victim.proc.wait()
    for i in range(2):  # both prefill workers (round robin) read with one replica gone
        got = await both(router, colocated, prefix + pool[100 + i : 104 + i])
        assert got[2].cached_tokens == 48
    deadline = time.monotonic() + 15
    while master_stats(cluster)["segments"] != 1:  # heartbeat timeout: the master drops node-0's replicas
        assert time.monotonic() < deadline
        time.sleep(0.2)
    got = await both(router, colocated, prefix + pool[110:113])
    assert got[2].cached_tokens == 48
