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
    for s, d in zip(src.block_ids[:n], dst.block_ids):
        engine.kv_cache[d].copy_(engine.kv_cache[s])
    return dst


@pytest.mark.parametrize("length", [B + 1, 2 * B, 2 * B + 7])
async def test_prefill_over_cached_blocks_and_decode_over_partial_kv_equal_cold(engine, lm, length):
    prompt = prompt_of(lm, length)
    cold = await generate(engine, "cold", prompt)
    first = await engine.prefill("p1", prompt, GREEDY)
    assert first.first_token_id == cold[0] and first.cached_tokens == 0
    n_full = length // B
    cached = min(n_full * B, length - 1)  # a fully cached prompt still computes its last token
    blocks = await copy_blocks(engine, first.blocks, n_full)
    warm = await engine.prefill("p2", prompt, GREEDY, cached=blocks, num_cached_tokens=cached)
    assert warm.first_token_id == cold[0] and warm.cached_tokens == cached and blocks.consumed
    # decode with only the full blocks' KV: the first step computes the rest of the prompt + the first token
    partial = await copy_blocks(engine, first.blocks, len(first.blocks))
    first.blocks.free()
    warm.blocks.free()
    tokens = [cold[0]]
    async for o in engine.decode_prefilled("d", prompt, GREEDY, cold[0], partial, num_computed_tokens=n_full * B):
        tokens += o.token_ids
    assert tokens == cold
    assert await free(engine) == engine.num_blocks


async def test_bad_cached_arguments_leave_the_blocks_with_the_caller(engine, lm):
    prompt = prompt_of(lm, 20)
    async with await engine.allocate_blocks(1) as blocks:
        with pytest.raises(InvalidRequest):
            await engine.prefill("x", prompt, GREEDY, cached=blocks, num_cached_tokens=20)  # all of it: no logits left
        with pytest.raises(InvalidRequest):
            await engine.prefill("x", prompt, GREEDY, cached=blocks, num_cached_tokens=17)  # more than 1 block holds
        assert blocks.owned
    assert await free(engine) == engine.num_blocks


async def test_a_share_keeps_blocks_until_the_last_owner_frees(engine):
    blocks = await engine.allocate_blocks(3)
    write = blocks.share()
    blocks.free()
    assert await free(engine) == engine.num_blocks - 3  # still referenced (a store write in flight)
    write.free()
    assert await free(engine) == engine.num_blocks
