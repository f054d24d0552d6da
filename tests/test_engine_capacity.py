"""AsyncEngine with the real (tiny) model and a small KV pool: requests and block allocations that fit the
pool wait for blocks held elsewhere and then produce the same tokens; requests that can never fit are
refused at once; nothing leaks."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest

PROMPTS = ["Once upon a time", "The cat sat on the mat and", "Lily and Ben went to the park.", "One day, a big dog",
           "Tom had a red ball", "The sun was hot", "Mom said no", "A little bird sang a song"]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


async def started(lm, **kw) -> AsyncEngine:
    engine = AsyncEngine(lm, EngineConfig(**kw))
    await engine.start()
    return engine


async def collect(engine, rid, prompt, params=PARAMS) -> list[int]:
    return [t async for out in engine.generate(rid, prompt, params) for t in out.token_ids]


async def until(engine, key, value, timeout_s: float = 30.0) -> dict:
    """Poll the engine's stats until ``key`` equals ``value`` (each call is answered after the engine's current turn)."""
    t0 = asyncio.get_running_loop().time()
    while True:
        stats = await engine.stats()
        if stats[key] == value:
            return stats
        if asyncio.get_running_loop().time() - t0 > timeout_s:
            raise AssertionError(f"{key} never became {value}: {stats}")
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def references(lm):
    async def run():
        engine = await started(lm, kv_cache_mb=4)
        try:
            return [await collect(engine, f"ref{i}", lm.tokenizer.encode(p)) for i, p in enumerate(PROMPTS)]
        finally:
            await engine.stop()

    return asyncio.run(run())


async def test_burst_beyond_the_free_blocks_waits_and_gives_the_reference_tokens(lm, references):
    engine = await started(lm, num_blocks=8)  # 2 blocks per request at most: 4 run at once when the pool is free
    try:
        held = await engine.allocate_blocks(7)  # e.g. KV under leases waiting for decode pulls
        tasks = [asyncio.create_task(collect(engine, f"r{i}", lm.tokenizer.encode(p))) for i, p in enumerate(PROMPTS)]
        stats = await until(engine, "requests_waiting", len(PROMPTS))
        assert stats["requests_running"] == 0  # none could start, none failed
        held.free()  # the leases are released
        assert await asyncio.gather(*tasks) == references
        stats = await engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 8 and stats["kv_block_waits"] >= 1
        assert stats["queue_timeouts"] == stats["queue_refused"] == 0
    finally:
        await engine.stop()


async def test_allocations_wait_for_free_blocks_and_a_cancelled_one_leaks_nothing(lm):
    engine = await started(lm, num_blocks=8)
    try:
        held = await engine.allocate_blocks(8)
        incoming = asyncio.create_task(engine.allocate_blocks(3))  # a decode worker's blocks for incoming KV
        await until(engine, "kv_allocations_waiting", 1)
        gone = asyncio.create_task(engine.allocate_blocks(4))  # its caller will go away while it waits
        await until(engine, "kv_allocations_waiting", 2)
        gone.cancel()
        await until(engine, "kv_allocations_waiting", 1)
        held.truncate(5)
        got = await incoming
        assert len(got) == 3
        with pytest.raises(asyncio.CancelledError):
            await gone
        got.free()
        held.free()
        stats = await until(engine, "kv_blocks_free", 8)
        assert stats["kv_allocations_waiting"] == 0
        with pytest.raises(InvalidRequest, match="whole KV pool has 8"):
            await engine.allocate_blocks(9)
    finally:
        await engine.stop()


async def test_requests_that_can_never_fit_are_refused_at_once(lm):
    engine = await started(lm, num_blocks=4)  # 64 tokens of KV
    try:
        prompt = lm.tokenizer.encode("Once upon a time")
        with pytest.raises(InvalidRequest, match="whole KV pool has 4"):
            engine.generate("g", prompt, SamplingParams(max_tokens=70, temperature=0))
        with pytest.raises(InvalidRequest, match="whole KV pool has 4"):
            await engine.prefill("p", list(range(3, 3 + 65)), PARAMS)
        async with await engine.allocate_blocks(1) as cached:
            with pytest.raises(InvalidRequest):  # refused before the engine took them: still the caller's
                await engine.prefill("p", list(range(3, 3 + 65)), PARAMS, cached=cached, num_cached_tokens=16)
            assert cached.owned
        edge = SamplingParams(max_tokens=65 - len(prompt), temperature=0, ignore_eos=True)  # 64 tokens fed: the whole pool
        assert len(await collect(engine, "edge", prompt, edge)) == edge.max_tokens
        stats = await engine.stats()
        assert stats["kv_blocks_free"] == 4
    finally:
        await engine.stop()


async def test_a_request_cancelled_while_waiting_leaves_the_pool_at_baseline(lm):
    engine = await started(lm, num_blocks=8)
    try:
        held = await engine.allocate_blocks(8)
        task = asyncio.create_task(engine.prefill("p", lm.tokenizer.encode("Once upon a time"), PARAMS))
        await until(engine, "requests_waiting", 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await until(engine, "requests_waiting", 0)
        held.free()
        stats = await until(engine, "kv_blocks_free", 8)
        assert stats["requests_running"] == 0
    finally:
        await engine.stop()
