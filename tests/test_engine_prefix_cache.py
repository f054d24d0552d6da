"""Automatic prefix caching in the engine: the same tokens with and without it, cached_tokens, no leaked blocks.
In-process engine, CPU, the embedded tiny model."""

import asyncio

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams

B = 16
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LENGTHS = [1, B - 1, B, B + 1, 3 * B + 5]


async def started(lm, **kw):
    e = AsyncEngine(lm, EngineConfig(kv_cache_mb=4, **kw))
    await e.start()
    return e


@pytest.fixture
async def engines(lm):
    """(engine with a prefix cache, engine without)."""
    on, off = await started(lm, enable_prefix_caching=True), await started(lm)
    yield on, off
    await on.stop()
    await off.stop()


def prompt_of(lm, n, salt=""):
    ids = lm.tokenizer.encode(salt + "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
                              "One day, she saw a big red ball in the park. She ran to get it, but a dog took it first. "
                              "Lily was sad. Her mom came and gave her a hug. They went home and baked a cake together. " * 2)
    assert len(ids) >= n
    return ids[:n]


async def generate(engine, rid, prompt, params=GREEDY):
    tokens, cached = [], None
    async for o in engine.generate(rid, prompt, params):
        tokens += o.token_ids
        cached = o.cached_tokens if cached is None else cached
    return tokens, cached


async def all_free(engine):
    await asyncio.sleep(0.05)
    s = await engine.stats()
    engine.block_manager.check_integrity()
    return s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.parametrize("n", LENGTHS)
async def test_same_tokens_with_and_without_the_cache(engines, lm, n):
    on, off = engines
    prompt = prompt_of(lm, n)
    ref, cached = await generate(off, "ref", prompt)
    assert cached == 0
    cold, cached = await generate(on, "cold", prompt)
    assert cold == ref and cached == 0
    warm, cached = await generate(on, "warm", prompt)
    assert warm == ref and cached == (n - 1) // B * B < max(n, 1) + 1
    assert cached <= n
    # a later turn: prompt + output + new tokens reuses the previous turn's prompt and output blocks
    turn2 = prompt + ref + prompt_of(lm, 7, "And then ")
    ref2, _ = await generate(off, "ref2", turn2)
    got2, cached2 = await generate(on, "turn2", turn2)
    assert got2 == ref2
    assert cached2 == (n + len(ref) - 1) // B * B  # every token whose KV was computed (all but the last output)
    assert await all_free(on) and await all_free(off)


async def test_chunked_prefill_with_the_cache_gives_the_same_tokens(lm):
    on = await started(lm, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=24)
    off = await started(lm, enable_chunked_prefill=True, max_num_batched_tokens=24)
    try:
        prompt = prompt_of(lm, 3 * B + 5)
        ref, _ = await generate(off, "ref", prompt)
        assert (await generate(on, "a", prompt))[0] == ref
        warm, cached = await generate(on, "b", prompt)
        assert warm == ref and cached == 3 * B
        assert await all_free(on)
    finally:
        await on.stop()
        await off.stop()


async def test_prefill_only_and_decode_prefilled_share_the_cache(engines, lm):
    on, off = engines
    prompt = prompt_of(lm, 2 * B + 3)
    ref, _ = await generate(off, "ref", prompt)
    first = await on.prefill("p", prompt, GREEDY)
    assert first.first_token_id == ref[0]
    first.blocks.free()  # the prompt's 2 full blocks stay cached
    held = await on.match_prefix(prompt)
    assert len(held) == 2
    rest = await on.allocate_blocks(1)
    # the partial last block is what a transfer would fill: here, a copy of a fresh prefill's
    again = await on.prefill("p2", prompt, GREEDY)
    assert again.cached_tokens == 2 * B
    on.kv_cache[rest.block_ids[0]].copy_(on.kv_cache[again.blocks.block_ids[2]])
    again.blocks.free()
    from splitserve.engine.owned_blocks import OwnedBlocks

    blocks = OwnedBlocks(held.take() + rest.take(), on.core)
    tokens = [ref[0]]
    async for o in on.decode_prefilled("d", prompt, GREEDY, ref[0], blocks):
        tokens += o.token_ids
    assert tokens == ref
    assert await all_free(on)


async def test_cache_survives_pressure_and_requests_still_fit(lm):
    """A pool smaller than the cached history: allocation evicts cached blocks; every request still runs."""
    e = await started(lm, enable_prefix_caching=True, num_blocks=12)
    off = await started(lm, num_blocks=12)
    try:
        for i in range(6):
            prompt = prompt_of(lm, 3 * B + 5, salt=f"{i} ")
            got, _ = await generate(e, f"r{i}", prompt)
            assert got == (await generate(off, f"o{i}", prompt))[0]
        stats = await e.stats()
        assert stats["prefix_cache_evicted_blocks"] > 0 and stats["kv_blocks_cached"] > 0
        assert await all_free(e)
    finally:
        await e.stop()
        await off.stop()


def counting(preempt, preempted: list[str]):
    def wrapped(seq):
        preempted.append(seq.request_id)
        preempt(seq)
    return wrapped


async def test_preempted_requests_reuse_their_own_blocks_and_give_the_same_tokens(lm):
    """A pool too small for every running request: decode preempts, and a preempted request re-admitted over the
    cache recomputes only what was evicted. Same tokens as without the cache (same pool)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [prompt_of(lm, 40, salt=f"{i} ") for i in range(4)]  # each needs 5 blocks at the end; 4 x 5 > 12
    outs = {}
    for caching in (True, False):
        e = await started(lm, enable_prefix_caching=caching, num_blocks=12)
        preempted: list[str] = []
        e.core.scheduler._preempt = counting(e.core.scheduler._preempt, preempted)
        try:
            got = await asyncio.gather(*(generate(e, f"r{i}", p, params) for i, p in enumerate(prompts)))
            outs[caching] = [tokens for tokens, _ in got]
            assert preempted  # the case under test happened
            assert await all_free(e)
        finally:
            await e.stop()
    assert outs[True] == outs[False] and all(len(t) == 40 for t in outs[True])
