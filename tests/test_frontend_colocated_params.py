"""The HTTP API over the real colocated engine (TinyStories, in process): the new request fields map to what the
engine does. Tests of features the engine gains on other branches (logit_bias in the sampler, logprobs through
LocalBackend) probe the engine first and skip, saying so, until it has them."""

from __future__ import annotations

import json

import httpx
import pytest

from splitserve.colocated.backend import LocalBackend
from splitserve.engine.async_engine import AsyncEngine, EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import SimpleModelInfo

MODEL = "tinystories"


@pytest.fixture
async def served(lm):
    """(HTTP client, engine) over a fresh colocated engine."""
    engine = AsyncEngine(lm, EngineConfig(kv_cache_mb=4))
    await engine.start()
    app = build_app(SimpleModelInfo(MODEL, lm.tokenizer, engine.max_model_len), LocalBackend(engine))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c, engine
    finally:
        await engine.stop()


async def complete(c: httpx.AsyncClient, **fields) -> dict:
    r = await c.post("/v1/completions", json={"model": MODEL, **fields})
    assert r.status_code == 200, r.text
    return r.json()


async def test_empty_prompt_generates_from_bos_like_the_bos_token_id(served, lm) -> None:
    c, _ = served
    bos = lm.tokenizer.encode("", add_special_tokens=True)
    assert len(bos) == 1  # the model's tokenizer adds BOS
    from_text = await complete(c, prompt="", max_tokens=12, temperature=0)
    from_ids = await complete(c, prompt=bos, max_tokens=12, temperature=0)
    assert from_text["choices"][0]["text"] == from_ids["choices"][0]["text"] != ""
    assert from_text["usage"]["prompt_tokens"] == 1


async def test_seed_stop_token_ids_and_ignore_eos_reach_the_engine(served, lm) -> None:
    c, engine = served
    a = await complete(c, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=11)
    b = await complete(c, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=11)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    # a negative seed is accepted (as OpenAI and vLLM do) and draws as seed mod 2**63
    neg = await complete(c, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=-1)
    top = await complete(c, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=2**63 - 1)
    assert neg["choices"][0]["text"] == top["choices"][0]["text"]
    prompt = lm.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = [t async for o in engine.generate("ref", prompt, params) for t in o.token_ids]
    greedy = await complete(c, prompt="Once upon a time", max_tokens=16, temperature=0, ignore_eos=True)
    assert greedy["usage"]["completion_tokens"] == 16 and greedy["choices"][0]["finish_reason"] == "length"
    stopped = await complete(c, prompt="Once upon a time", max_tokens=16, temperature=0, stop_token_ids=[ids[2]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == ids.index(ids[2]) + 1


async def _engine_honours_logit_bias(engine: AsyncEngine, token: int) -> bool:
    params = SamplingParams(max_tokens=3, temperature=0, logit_bias=((token, 100.0),), ignore_eos=True)
    out = [t async for o in engine.generate("probe-bias", [1, 80], params) for t in o.token_ids]
    return out == [token] * 3


async def test_logit_bias_forces_a_token(served, lm) -> None:
    c, engine = served
    token = lm.tokenizer.encode("dog", add_special_tokens=False)[-1]
    if not await _engine_honours_logit_bias(engine, token):
        pytest.skip("needs the sampler branch (issue 14): this engine ignores SamplingParams.logit_bias")
    r = await complete(c, prompt="Once upon a time", max_tokens=4, temperature=0, ignore_eos=True,
                       logit_bias={str(token): 100})
    assert r["choices"][0]["text"] == lm.tokenizer.decode([token] * 4)


async def test_greedy_logprobs_rank_the_chosen_token_first(served, lm) -> None:
    c, engine = served
    probe = [o async for o in engine.generate("probe-lp", [1, 80], SamplingParams(max_tokens=1, logprobs=1))]
    if probe[0].logprobs is None:
        pytest.skip("needs the engine branch (issue 14): this engine returns no logprobs")
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6,
                                              "temperature": 0, "logprobs": 3})
    if r.status_code == 500:
        pytest.skip("needs the engine branch (issue 14): LocalBackend drops the engine's logprobs")
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == r.json()["usage"]["completion_tokens"]
    for token_lp, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert token_lp <= 0 and token_lp == pytest.approx(max(top.values()))  # greedy: the most likely token


async def test_n_greedy_choices_are_equal_and_stream_with_their_index(served) -> None:
    c, engine = served
    probe = [o.index async for o in engine.generate("probe-n", [1, 80], SamplingParams(max_tokens=2, n=2))]
    if 1 not in probe:
        pytest.skip("needs the engine branch (issue 14): this engine ignores SamplingParams.n")
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "n": 4}
    full = (await c.post("/v1/completions", json=req)).json()
    texts = [ch["text"] for ch in full["choices"]]
    assert [ch["index"] for ch in full["choices"]] == [0, 1, 2, 3] and len(set(texts)) == 1 and texts[0]
    single = await complete(c, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert texts[0] == single["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 4 * single["usage"]["completion_tokens"]
    r = await c.post("/v1/completions", json={**req, "stream": True})
    chunks = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: {")]
    streamed = {i: "" for i in range(4)}
    for chunk in map(json.loads, chunks):
        streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert list(streamed.values()) == texts


async def test_echo_max_tokens_0_reports_the_engines_prompt_logprobs(served, lm) -> None:
    c, engine = served
    prompt = lm.tokenizer.encode("Once upon a time there was")
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = [o async for o in engine.generate("probe-plp", prompt, params)]
    if outs[0].prompt_logprobs is None:
        pytest.skip("needs the engine branch (issue 14): this engine returns no prompt logprobs")
    reference = [None if e is None else e.logprob for e in outs[0].prompt_logprobs]
    r = await complete(c, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = r["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(prompt)
    assert lp["token_logprobs"][1:] == pytest.approx(reference[1:], abs=1e-5)
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["finish_reason"] == "length"
