"""--max-model-len: a start-up error above the model's context, InvalidRequest for prompts that reach it,
generation stops ("length") at it, and every engine-bearing command takes the flag."""

from __future__ import annotations

import pytest

from splitserve.colocated.main import parse as parse_colocated
from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.errors import InvalidRequest
from splitserve.model import load_model
from splitserve.services.decode.config import parse as parse_decode
from splitserve.services.prefill.config import parse as parse_prefill

MODEL = "synthetic:llama-tiny"  # context 4096


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


def test_above_the_models_context_is_a_startup_error(lm):
    with pytest.raises(ValueError, match="--max-model-len 4097 exceeds the model's maximum context length 4096"):
        AsyncEngine(lm, EngineConfig(kv_cache_mb=1, max_model_len=4097))
    with pytest.raises(ValueError, match="--max-model-len must be >= 0"):
        EngineConfig(max_model_len=-1)
    for parse in (parse_colocated, parse_prefill, parse_decode):
        with pytest.raises(ValueError, match="exceeds the model's maximum context length 4096"):
            parse(["--model", MODEL, "--max-model-len", "5000"])
        assert parse(["--model", MODEL, "--max-model-len", "64", "--dtype", "bfloat16"]) is not None


async def test_prompts_and_generations_are_bounded(lm):
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=1, max_model_len=24))
    assert engine.max_model_len == 24
    await engine.start()
    try:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        with pytest.raises(InvalidRequest, match="prompt has 24 tokens; the model's context is 24"):
            engine.generate("long", list(range(10, 34)), params)
        with pytest.raises(InvalidRequest):
            await engine.prefill("long-p", list(range(10, 40)), params)
        out, reason = [], None
        async for o in engine.generate("ok", list(range(10, 30)), params):
            out += o.token_ids
            reason = o.finish_reason
        assert len(out) == 4 and reason == "length"  # 20 prompt + 4 output = 24 tokens
    finally:
        await engine.stop()
