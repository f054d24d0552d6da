"""--dtype: the float32 / bfloat16 / float16 matrix loads and generates, "auto" takes the checkpoint's dtype,
and bf16 disaggregated (in-process prefill + decode servicers, inproc KV transport) equals bf16 colocated."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pd.v1 import decode_pb2, prefill_pb2

from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.model import load_model
from splitserve.paths import default_model_path
from tests.test_services_inproc import sampling, workers  # noqa: F401  (the workers fixture, over the lm below)

DTYPES = ["float32", "bfloat16", "float16"]


async def generate(engine: AsyncEngine, prompt: list[int], n: int) -> list[int]:
    out = []
    async for o in engine.generate(f"g{len(prompt)}-{n}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)):
        out += o.token_ids
    return out


@pytest.mark.parametrize("dtype", DTYPES)
async def test_dtype_matrix_loads_and_generates(dtype):
    lm = load_model("synthetic:llama-tiny", dtype=dtype)
    want = getattr(torch, dtype)
    matrices = {n: p.dtype for n, p in lm.model.named_parameters() if p.dim() >= 2}  # projections, embedding
    assert lm.config.dtype == dtype and set(matrices.values()) == {want}, matrices  # (norms may be widened)
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=1, dtype=dtype))
    assert engine.kv_cache.dtype == want and engine.layout.dtype == dtype
    await engine.start()
    try:
        prompt = list(range(10, 30))
        toks = await generate(engine, prompt, 6)
        assert len(toks) == 6 and all(0 <= t < lm.config.vocab_size for t in toks)
        assert toks == await generate(engine, prompt, 6)  # deterministic in every dtype
    finally:
        await engine.stop()


@pytest.mark.parametrize("declared, requested, expected", [
    ("bfloat16", "auto", "bfloat16"), ("float16", "auto", "float16"), (None, "auto", "float32"),
    ("bfloat16", "float32", "float32"), ("float32", "bfloat16", "bfloat16"),
])
def test_auto_dtype_is_the_checkpoints(tmp_path, declared, requested, expected):
    shutil.copytree(default_model_path(), tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    if declared:
        cfg["torch_dtype"] = declared
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm = load_model(tmp_path, dtype=requested)
    assert lm.config.dtype == expected and lm.model.lm_head.weight.dtype == getattr(torch, expected)
    assert load_model("synthetic:llama-tiny", dtype="auto", weights=False).config.dtype == "float32"


def test_bad_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        load_model("synthetic:llama-tiny", dtype="float64", weights=False)
    with pytest.raises(ValueError, match="--dtype"):
        EngineConfig(dtype="int8")


@pytest.fixture(scope="module")
def lm():
    """bf16 weights and KV cache for the ``workers`` fixture of test_services_inproc."""
    return load_model(default_model_path(), dtype="bfloat16")


async def test_bf16_disaggregated_equals_bf16_colocated(workers, lm):  # noqa: F811
    prefill, decode, _, p_engine, d_engine = workers
    assert p_engine.kv_cache.dtype == d_engine.kv_cache.dtype == torch.bfloat16
    colocated = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await colocated.start()
    try:
        for i, text in enumerate(["Once upon a time, in a small town", "Tom and Sue went to the park. They saw a big"]):
            prompt = lm.tokenizer.encode(text)
            resp = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=f"p{i}", prompt_token_ids=prompt, sampling=sampling(12)))
            tokens = [resp.first_token_id]
            async for msg in decode.Decode(decode_pb2.DecodeRequest(request_id=f"p{i}", prompt_token_ids=prompt, sampling=sampling(12),
                                                                    kv_handle=resp.kv_handle, first_token_id=resp.first_token_id)):
                tokens += msg.token_ids
            assert tokens == await generate(colocated, prompt, 12)
    finally:
        await colocated.stop()
