"""Engine robustness: a cancelled block allocation neither leaks blocks nor disturbs running requests."""

import asyncio

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.model import load_model
from splitserve.paths import default_model_path


async def test_cancelled_allocations_free_their_blocks_and_running_requests_continue():
    lm = load_model(default_model_path())
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await engine.start()
    try:
        prompt = lm.tokenizer.encode("Once upon a time")
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)

        async def generate():
            out = []
            async for o in engine.generate("long", prompt, params):
                out += o.token_ids
            return out

        running = asyncio.create_task(generate())
        for _ in range(200):  # callers that give up while (or before) the engine allocates for them
            task = asyncio.create_task(engine.allocate_blocks(3))
            await asyncio.sleep(0)
            task.cancel()
        tokens = await running
        assert len(tokens) == 120
        await asyncio.sleep(0.05)
        stats = await engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        await engine.stop()
