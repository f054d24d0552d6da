"""A request whose sampling constraints leave no possible token fails alone (InvalidRequest); the requests
batched with it go on, and its KV blocks come back."""

from __future__ import annotations

import asyncio


from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest

PROMPT = [1, 80, 147, 201, 282]


async def test_contradictory_constraints_fail_that_request_only(lm):
    engine = AsyncEngine(lm, EngineConfig(block_size=4, num_blocks=64))
    await engine.start()
    try:
        async def run(rid, params):
            return [t async for out in engine.generate(rid, PROMPT, params) for t in out.token_ids]

        bad = SamplingParams(max_tokens=4, allowed_token_ids=(5,), bad_words_token_ids=((5,),))
        good = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        results = await asyncio.gather(run("bad", bad), run("good", good), return_exceptions=True)
        assert isinstance(results[0], InvalidRequest) and "no possible token" in str(results[0])
        assert results[1] == await run("again", good) and len(results[1]) == 6

        def free():
            engine.block_manager.check_integrity()
            return engine.block_manager.num_free
        assert await asyncio.wrap_future(engine.core.call(free)) == engine.num_blocks
    finally:
        await engine.stop()
