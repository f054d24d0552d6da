"""The router hashes a prompt's KV blocks once per request (prefix_aware policy): the decode and prefill picks, the
prefill skip and uncached counts, and the records at the first message and at the finish all share one
:class:`PromptBlocks`; the record at the finish hashes only the blocks the generated tokens complete."""

from __future__ import annotations

import pytest
from pd.v1 import prefill_pb2

import splitserve.services.router.prompt_blocks as prompt_blocks
from splitserve.engine.sampling import SamplingParams
from splitserve.kvstore.block_hash import chain_hashes
from splitserve.services.router.policies import PrefixAware
from splitserve.services.router.prompt_blocks import ROOT, PromptBlocks
from splitserve.services.router.registry import DECODE, PREFILL
from tests.test_router_migration import LENGTH, NONE, FakeDecode, backend_of, remote, servers  # noqa: F401  (fixture)

B = 16


def test_hashes_match_chain_hashes_and_extension_reuses_them():
    tokens = list(range(100, 100 + 3 * B + 5))
    p = PromptBlocks(tokens)
    assert p.hashes(B) == chain_hashes(ROOT, tokens, B) and len(p) == len(tokens)
    assert p.hashes(8) == chain_hashes(ROOT, tokens, 8)  # another block_size: recomputed, not the stale list
    more = list(range(7, 7 + 2 * B))
    assert p.extended(more).hashes(8) == chain_hashes(ROOT, tokens + more, 8)
    assert p.extended(more).token_ids == tokens + more and p.token_ids == tokens
    assert PromptBlocks.of(p) is p and PromptBlocks.of(tokens).token_ids == tokens


@pytest.fixture
def hashed_blocks(monkeypatch) -> list[int]:
    """The number of blocks each call of ``chain_hashes`` (the router's) hashed, in call order."""
    calls: list[int] = []

    def counting(root, token_ids, block_size):
        calls.append(len(token_ids) // block_size)
        return chain_hashes(root, token_ids, block_size)

    monkeypatch.setattr(prompt_blocks, "chain_hashes", counting)
    return calls


@pytest.mark.parametrize("mode", ["direct", "push"])
async def test_each_block_is_hashed_once_per_request(servers, hashed_blocks, mode):  # noqa: F811
    prompt = list(range(100, 100 + 3 * B + 4))
    out = list(range(500, 500 + 2 * B))  # the first token (from prefill), then the decode stream's
    decode = FakeDecode([(0, t, NONE) for t in out[1:-1]] + [(0, out[-1], LENGTH)])
    first = remote([out[0]]) if mode == "direct" else prefill_pb2.PrefillResponse(first_token_ids=[out[0]], kv_pushed=True)
    backend = await backend_of(servers, first, [decode], policy=PrefixAware(block_size=B), kv_transfer_mode=mode)
    backend.registry.workers[PREFILL][0].kv_endpoint = "127.0.0.1:9"  # push: a sender to subscribe on (never dialled)
    try:
        events = [ev async for ev in backend.generate("req-1", prompt, SamplingParams(max_tokens=len(out)))]
    finally:
        await backend.close()
    assert [t for ev in events for t in ev.token_ids] == out
    if mode == "push":
        assert backend.counters["kv_pushed"] == 1 and decode.requests[0].push_bootstrap_id
    held = prompt + out[:-1]  # recorded at the finish: the prompt and every generated token but the last
    assert hashed_blocks == [len(prompt) // B, len(held) // B - len(prompt) // B]  # the prompt once, then only the rest
    d0, p0 = backend.registry.workers[DECODE][0], backend.registry.workers[PREFILL][0]
    assert backend.policy.matched_tokens(d0, held) == len(held) // B * B
    assert backend.policy.matched_tokens(p0, prompt) == len(prompt) // B * B
