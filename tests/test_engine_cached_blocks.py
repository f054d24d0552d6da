"""Engine paths used by the KV store: prefill over pre-filled prefix blocks, decode over partial prompt KV,
extra block references while a write is in flight. In-process engine, CPU, tiny model."""

import asyncio

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest

B = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
async def engine(lm):
    e = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await e.start()
    yield e
    await e.stop()


async def generate(engine, rid, prompt):
    out = []
    async for o in engine.generate(rid, prompt, GREEDY):
        out += o.token_ids
    return out


async def free(engine):
    await asyncio.sleep(0.05)
    return (await engine.stats())["kv_blocks_free"]


def prompt_of(lm, n):
    ids = lm.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
                              "One day, she saw a big red ball in the park. She ran to get it, but a dog took it first. "
                              "Lily was sad. Her mom came and gave her a hug. They went home and baked a cake together.")
    assert len(ids) >= n
    return ids[:n]


async def copy_blocks(engine, src, n):
    """Fresh blocks holding the KV of ``src``'s first ``n`` blocks (what a store read does)."""
    dst = await engine.allocate_blocks(n)
    for s, d in zip(src[:n], dst):
        engine.kv_cache[d].copy_(engine.kv_cache[s])
    return dst


@pytest.mark.parametrize("length", [B + 1, 2 * B, 2 * B + 7])
async def test_prefill_over_cached_blocks_and_decode_over_partial_kv_equal_cold(engine, lm, length):
    prompt = prompt_of(lm, length)
    cold = await generate(engine, "cold", prompt)
    first = await engine.prefill("p1", prompt, GREEDY)
    assert first.token_ids[0] == cold[0] and first.cached_tokens == 0
    n_full = length // B
    cached = min(n_full * B, length - 1)  # a fully cached prompt still computes its last token
    blocks = await copy_blocks(engine, first.block_ids, n_full)
    warm = await engine.prefill("p2", prompt, GREEDY, cached_block_ids=blocks, num_cached_tokens=cached)
    assert warm.token_ids[0] == cold[0] and warm.cached_tokens == cached
    # decode with only the full blocks' KV: the first step computes the rest of the prompt + the first token
    partial = await copy_blocks(engine, first.block_ids, len(first.block_ids))
    engine.free_blocks(first.block_ids)
    engine.free_blocks(warm.block_ids)
    tokens = [cold[0]]
    async for o in engine.decode_prefilled("d", prompt, GREEDY, cold[0], partial, num_computed_tokens=n_full * B):
        tokens += o.token_ids
    assert tokens == cold
    assert await free(engine) == engine.num_blocks


async def test_bad_cached_arguments_free_the_blocks(engine, lm):
    prompt = prompt_of(lm, 20)
    blocks = await engine.allocate_blocks(1)
    with pytest.raises(InvalidRequest):
        await engine.prefill("x", prompt, GREEDY, cached_block_ids=blocks, num_cached_tokens=20)  # all of it: no logits left
    blocks = await engine.allocate_blocks(1)
    with pytest.raises(InvalidRequest):
        await engine.prefill("x", prompt, GREEDY, cached_block_ids=blocks, num_cached_tokens=17)  # more than 1 block holds
    assert await free(engine) == engine.num_blocks


async def test_incref_keeps_blocks_until_the_last_free(engine):
    blocks = await engine.allocate_blocks(3)
    engine.incref_blocks(blocks)
    engine.free_blocks(blocks)
    assert await free(engine) == engine.num_blocks - 3  # still referenced (a store write in flight)
    engine.free_blocks(blocks)
    assert await free(engine) == engine.num_blocks
