"""The official openai SDK against the disaggregated cluster; output equals Hugging Face transformers."""

import pytest
import torch
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from splitserve.paths import default_model_path

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "TinyStories-656K"


@pytest.fixture(scope="module")
def hf_reference():
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = default_model_path()
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def complete(prompt: str, max_tokens: int) -> str:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return complete


async def test_streamed_completion_matches_transformers(cluster, hf_reference):
    base_url, _, _ = cluster
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused")
    stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0, stream=True)
    text = ""
    finish = None
    async for chunk in stream:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    expected = hf_reference("Once upon a time", 48)
    assert text == expected
    assert text.startswith(", a little girl named Lily")
    assert finish in ("length", "stop")


async def test_chat_completion_streaming_and_not(cluster):
    base_url, _, _ = cluster
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 24 or full.choices[0].finish_reason == "stop"
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_sdk_errors_are_openai_shaped_and_server_keeps_serving(cluster):
    base_url, _, _ = cluster
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError):
        await client.completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(BadRequestError) as err:
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert err.value.body is not None
    ok = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
