"""Decode-side prefix reuse on a real cluster (router + 1 prefill + 1 decode worker, KV over UCX): a chat's later
turns pull only the uncached blocks (the decode worker's ``splitserve:kv_transfer_bytes_total`` shows it), a turn whose
history the decode worker holds skips the prefill worker, and every turn's tokens equal a colocated server's without
a prefix cache."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from splitserve.client import RouterClient
from tests.cluster import Colocated, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.cluster]

B = 16
SKIP = 24  # --skip-prefill-tokens


@pytest.fixture(scope="module")
def setup():
    cluster, _, grpc = start_cluster(store_nodes=0, router_args=["--policy", "prefix_aware", "--skip-prefill-tokens", str(SKIP)])
    ref = Colocated(extra=["--no-enable-prefix-caching"])
    try:
        yield cluster, grpc, ref
    finally:
        ref.stop()
        cluster.stop()


def received(cluster) -> float:
    url = next(c for c in cluster.children if c.name == "decode-0").metrics
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url, timeout=5).text.splitlines()
               if line.startswith("splitserve:kv_transfer_bytes_total{") and 'direction="receive"' in line)


async def complete(address: str, prompt: list[int]) -> tuple[list[int], int]:
    """(token ids, usage cached_tokens) of a greedy request."""
    tokens, cached = [], 0
    async with RouterClient(address) as client:
        async for msg in client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=60):
            tokens += msg.token_ids
            if msg.HasField("usage"):
                cached = msg.usage.cached_tokens
        return tokens, cached


async def router_stats(address: str) -> dict[str, float]:
    async with RouterClient(address) as client:
        return await client.stats()


def test_later_turns_pull_only_the_delta_or_skip_prefill_with_the_same_tokens(setup):
    cluster, grpc, ref = setup
    words = list(range(40, 40 + 3 * B + 5))
    turn1 = [1] + words  # 3B + 6 tokens
    out1, _ = asyncio.run(complete(grpc, turn1))
    assert out1 == asyncio.run(complete(ref.grpc_address, turn1))[0]
    bytes1 = received(cluster)
    token_nbytes = bytes1 / len(turn1)  # a partial last block moves only its used token rows
    assert token_nbytes == int(token_nbytes) > 0 and int(token_nbytes) % 4 == 0
    # turn 2: more new tokens than SKIP: prefilled remotely; decode pulls only the KV beyond its cached history (its
    # full blocks are shared, the rows of the partly held block after them copied from its cache)
    turn2 = turn1 + out1 + list(range(300, 340))
    out2, _ = asyncio.run(complete(grpc, turn2))
    assert out2 == asyncio.run(complete(ref.grpc_address, turn2))[0]
    held = len(turn1) + len(out1) - 1  # tokens whose KV decode has (the last sampled token has none)
    assert received(cluster) - bytes1 == (len(turn2) - held) * token_nbytes  # exactly the new tokens' KV
    # turn 3: a few new tokens: the decode worker prefills them over its prefix cache; no prefill worker, no pull
    skipped = asyncio.run(router_stats(grpc)).get("prefill_skipped", 0)
    turn3 = turn2 + out2 + [500, 501, 502]
    bytes2 = received(cluster)
    out3, cached3 = asyncio.run(complete(grpc, turn3))
    assert out3 == asyncio.run(complete(ref.grpc_address, turn3))[0]
    assert received(cluster) == bytes2
    assert asyncio.run(router_stats(grpc)).get("prefill_skipped", 0) == skipped + 1
    assert cached3 == (len(turn2) + len(out2) - 1) // B * B
