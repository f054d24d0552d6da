"""Decode-side prefix reuse with delta transfer (services/decode/worker.py with a prefix-caching engine): a later
turn of a conversation pulls only the KV blocks beyond what the decode worker's prefix cache holds; the tokens equal
a colocated run without any cache; with the KV store on and off. Two engines in one process, inproc transfer."""

from __future__ import annotations

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.services.decode.worker import DecodeJob
from tests.worker_harness import GREEDY, STORY, assert_no_leak, reference, start_pair, stop_pair, tokens_of

B = 16
LENGTHS = [1, B - 1, B, B + 1, 3 * B + 5]


def prompt_of(lm, n: int) -> list[int]:
    ids = lm.tokenizer.encode(STORY * 3)
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(params=[None, "direct", "store"], ids=["no-store", "store-direct", "store-transfer"])
async def pair(lm, caplog, request):
    p = await start_pair(lm, store_mode=request.param, decode_prefix_caching=True)
    yield p
    await assert_no_leak(p, caplog)
    await stop_pair(p)


def pulled(pair) -> int:
    return pair.decode.receiver.stats.bytes_received


@pytest.mark.parametrize("n", LENGTHS)
async def test_turn_two_pulls_only_the_uncached_blocks_and_decodes_the_same_tokens(pair, lm, n):
    per_token = pair.d_engine.layout.block_nbytes // B  # KV bytes of one token (all layers, K and V)
    direct = pair.store is None or pair.prefill.store.transfer_mode == "direct"
    prompt = prompt_of(lm, n)
    ref = await reference(pair.p_engine, prompt)  # the prefill engine has no prefix cache: a cold colocated run
    before = pulled(pair)
    _, run, tokens = await pair.prefill_then_decode("t1", prompt)
    assert tokens == ref and not run.kv_recomputed
    assert pair.decode.num_prefix_reused_blocks == 0
    if direct:
        assert pulled(pair) - before == n * per_token  # turn 1: the whole prompt, its partial last block's used rows only
    # turn 2: the conversation so far + a new user message
    prompt2 = prompt + tokens + prompt_of(lm, 9)
    ref2 = await reference(pair.p_engine, prompt2)
    held = n + len(tokens) - 1  # tokens whose KV decode computed or pulled (the last sampled token has none)
    reused = min(held // B, len(prompt2) // B)  # every full block of them
    before = pulled(pair)
    _, run, tokens2 = await pair.prefill_then_decode("t2", prompt2)
    assert tokens2 == ref2 and not run.kv_recomputed
    assert pair.decode.num_prefix_reused_blocks == reused and (reused > 0 or n == 1)
    if direct:  # the partly held block after them is copied from the cache: exactly the new tokens' KV moves
        assert pair.decode.num_prefix_reused_tokens == held - reused * B > 0
        assert pulled(pair) - before == (len(prompt2) - held) * per_token
    else:
        assert pulled(pair) == 0  # store transfer mode: nothing pulled from the prefill worker


async def test_a_prompt_held_whole_pulls_nothing_and_says_so(lm, caplog):
    pair = await start_pair(lm, decode_prefix_caching=True)
    try:
        prompt = prompt_of(lm, 2 * B)  # whole blocks only: every block can be cached
        ref = await reference(pair.p_engine, prompt)
        _, _, tokens = await pair.prefill_then_decode("a", prompt)
        before = pulled(pair)
        res = await pair.prefill.prefill("b", prompt, GREEDY)
        run = pair.decode.decode(DecodeJob("b", prompt, GREEDY, res.first_token_id, res.handle))
        assert [res.first_token_id] + await tokens_of(run) == tokens == ref
        assert run.kv_not_pulled and pulled(pair) == before
        assert pair.prefill.release(res.handle.transfer_id)  # what the router does on kv_not_pulled
        await assert_no_leak(pair, caplog)
    finally:
        await stop_pair(pair)


async def test_n_choices_over_a_reused_prefix(lm, caplog):
    pair = await start_pair(lm, decode_prefix_caching=True)
    try:
        prompt = prompt_of(lm, 3 * B + 5)
        await pair.prefill_then_decode("warm", prompt)
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=3, ignore_eos=True)
        ref = await reference(pair.p_engine, prompt, params)
        res = await pair.prefill.prefill("n3", prompt, params)
        run = pair.decode.decode(DecodeJob("n3", prompt, params, handle=res.handle, first_token_ids=res.first_token_ids))
        outs = [o async for o in run]
        got = {i: [res.first_token_ids[i]] + [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}
        assert sorted(t for toks in got.values() for t in toks) == sorted(ref)
        assert pair.decode.num_prefix_reused_blocks == 3
        await assert_no_leak(pair, caplog)
    finally:
        await stop_pair(pair)
