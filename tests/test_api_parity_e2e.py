"""OpenAI/vLLM API parity through the disaggregated cluster and the colocated server, against transformers (fp32).

Logprobs are compared within 1e-4 nats: the same fp32 weights on the same token ids differ only in kernel order
(~1e-6 here). At temperature 0 without penalties the processed logits equal the raw ones, so the served logprobs
must equal plain log_softmax. The first token's logprob is sampled on the prefill worker and must be present.
"""

import httpx
import pytest

from splitserve.paths import default_model_path
from tests.hf_reference import HFReference
from tests.sse_events import sse

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "TinyStories-656K"
TOL = 1e-4
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def hf():
    return HFReference(default_model_path())


@pytest.fixture(params=["disaggregated", "colocated"])
def base_url(request):
    if request.param == "disaggregated":
        return request.getfixturevalue("cluster")[0]
    return request.getfixturevalue("colocated").base_url


def metric_values(url: str) -> dict:
    """Prometheus samples of one process: (name, sorted label items) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def approx(values):
    return pytest.approx(values, abs=TOL)


async def post(base_url: str, path: str, body: dict) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream_events(base_url: str, path: str, body: dict) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        return [e async for e in sse(http, path, {**body, "stream": True})]


def check_completion_logprobs(lp: dict, text: str, steps, k: int) -> None:
    """Completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset) against greedy ``steps``."""
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(steps)
    assert "".join(lp["tokens"]) == text
    assert lp["token_logprobs"] == approx([s.logprob for s in steps])
    for top, step in zip(lp["top_logprobs"], steps):
        assert sorted(top.values(), reverse=True) == approx(step.top)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(steps))]


async def test_completion_logprobs_equal_transformers(base_url, hf):
    k, n_tokens = 3, 12
    steps = hf.greedy(hf.encode(PROMPT), n_tokens, k)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": n_tokens, "temperature": 0, "logprobs": k}
    choice = (await post(base_url, "/v1/completions", body))["choices"][0]
    assert choice["text"] == hf.decode([s.token_id for s in steps])
    check_completion_logprobs(choice["logprobs"], choice["text"], steps, k)

    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for event in await stream_events(base_url, "/v1/completions", body):
        for c in event["choices"]:
            text += c["text"]
            if c.get("logprobs"):
                for key in merged:
                    merged[key] += c["logprobs"][key]
    assert text == choice["text"]
    assert merged["token_logprobs"][0] is not None  # the first token (prefill worker) carries its logprob
    check_completion_logprobs(merged, text, steps, k)


async def test_chat_logprobs_equal_transformers(base_url, hf):
    k, n_tokens = 2, 10
    prompt_ids = (await post(base_url, "/tokenize", {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True}))["tokens"]
    steps = hf.greedy(prompt_ids, n_tokens, k)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": n_tokens, "temperature": 0, "logprobs": True, "top_logprobs": k}
    choice = (await post(base_url, "/v1/chat/completions", body))["choices"][0]
    streamed = []
    for event in await stream_events(base_url, "/v1/chat/completions", body):
        for c in event["choices"]:
            streamed += (c.get("logprobs") or {}).get("content") or []
    for content in (choice["logprobs"]["content"], streamed):
        assert len(content) == len(steps)
        assert [t["logprob"] for t in content] == approx([s.logprob for s in steps])
        for entry, step in zip(content, steps):
            assert [t["logprob"] for t in entry["top_logprobs"]] == approx(step.top)  # descending, as OpenAI
            assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the chosen token is the top one
            assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"] or "\ufffd" in entry["token"]
        assert "".join(t["token"] for t in content) == choice["message"]["content"]


async def test_echo_prompt_logprobs_equal_transformers(base_url, hf):
    ids = hf.encode("The little dog ran to the park and saw a big red ball.")
    expected = hf.prompt_logprobs(ids)
    echo0 = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}
    lp = (await post(base_url, "/v1/completions", echo0))["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI: the first prompt token
    assert lp["token_logprobs"] == approx(expected)
    assert len(lp["tokens"]) == len(ids)
    # lm-eval's request: echo + max_tokens 1; the prompt's entries come first, then the generated token's. lm-eval
    # calls a continuation greedy when each token's logprob is the largest value of its top_logprobs dict.
    step = hf.greedy(ids, 1)[0]
    lp1 = (await post(base_url, "/v1/completions", {**echo0, "max_tokens": 1, "temperature": 0}))["choices"][0]["logprobs"]
    assert lp1["token_logprobs"] == approx([*expected, step.logprob])
    rows = hf.log_softmax([*ids, step.token_id])
    assert [max(top.values()) for top in lp1["top_logprobs"][1:]] == approx(rows[:-1].max(dim=-1).values.tolist())
    # a text prompt: the server adds BOS, echoed like any prompt token
    text_lp = (await post(base_url, "/v1/completions", {**echo0, "prompt": PROMPT}))["choices"][0]
    assert text_lp["logprobs"]["token_logprobs"] == approx(hf.prompt_logprobs(hf.encode(PROMPT)))
    # echoed as its tokens' text, BOS kept, so each text_offset points at its token
    assert text_lp["text"] == "".join(text_lp["logprobs"]["tokens"]) and text_lp["text"].endswith(PROMPT)
    assert text_lp["text"].startswith(text_lp["logprobs"]["tokens"][0]) and text_lp["logprobs"]["tokens"][0] != PROMPT[:1]


async def test_vllm_prompt_logprobs_equal_transformers(base_url, hf):
    ids = hf.encode("Lily and Tom played with a ball in the garden.")
    expected = hf.prompt_logprobs(ids)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    got = (await post(base_url, "/v1/completions", body))["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        assert got[i][str(ids[i])]["logprob"] == pytest.approx(expected[i], abs=TOL)  # keyed by token id, as vLLM
        assert len(got[i]) in (2, 3)  # the top 2, plus the prompt token when it is not among them


async def test_empty_prompt_generates_from_bos_alone(base_url, hf):
    steps = hf.greedy([hf.tok.bos_token_id], 24)
    body = {"model": MODEL, "prompt": "", "max_tokens": 24, "temperature": 0}
    choice = (await post(base_url, "/v1/completions", body))["choices"][0]
    assert choice["text"] == hf.decode([s.token_id for s in steps])
    assert choice["text"].strip()


async def test_n4_temperature_0_gives_four_equal_greedy_choices(base_url, hf):
    expected = hf.decode([s.token_id for s in hf.greedy(hf.encode(PROMPT), 16)])
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "n": 4}
    choices = (await post(base_url, "/v1/completions", body))["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [expected] * 4
    texts = ["", "", "", ""]
    for event in await stream_events(base_url, "/v1/completions", body):
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [expected] * 4


async def test_n4_with_seed_is_reproducible_and_equal_across_deployments(cluster, colocated):
    """n=4 with a seed: one prefill, one KV transfer; the same four texts again, colocated and streamed."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 7, "n": 4}

    async def texts(url):
        choices = (await post(url, "/v1/completions", body))["choices"]
        return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]

    workers = {c.name: c.metrics for c in cluster[2].children if c.name in ("prefill-0", "decode-0", "router")}
    before = {name: metric_values(url) for name, url in workers.items()}
    first = await texts(cluster[0])
    after = {name: metric_values(url) for name, url in workers.items()}

    def moved(service, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[service].get(key, 0.0) - before[service].get(key, 0.0)

    # four choices, one prefill and one KV transfer
    assert moved("router", "splitserve:disagg_decisions_total", decision="remote_prefill") == 1
    assert moved("prefill-0", "splitserve:request_prefill_time_seconds_count") == 1
    assert moved("decode-0", "splitserve:kv_transfer_seconds_count", direction="receive", transport="ucx", path="host") == 1
    assert await texts(cluster[0]) == first
    assert len(set(first)) > 1  # per-choice seeds (seed + index) sample different stories
    assert await texts(colocated.base_url) == first  # the prefill->decode handoff samples like one engine
    streamed = ["", "", "", ""]
    for event in await stream_events(cluster[0], "/v1/completions", body):
        for c in event["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == first


async def test_tokenize_detokenize_version_models(base_url, hf):
    ids = hf.encode(PROMPT)
    tok = await post(base_url, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert tok["tokens"] == ids and tok["count"] == len(ids)
    assert tok["max_model_len"] == 512
    no_bos = await post(base_url, "/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": False})
    assert no_bos["tokens"] == ids[1:]
    detok = await post(base_url, "/detokenize", {"model": MODEL, "tokens": ids[1:]})
    assert detok["prompt"] == PROMPT
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        version = (await http.get("/version")).json()
        models = (await http.get("/v1/models")).json()
    assert isinstance(version["version"], str) and version["version"]
    assert models["data"][0]["max_model_len"] == 512


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}


async def test_tool_result_renders_and_conversation_continues(cluster):
    """A conversation with an assistant tool call and its result renders through the model's template (here the
    plain-text fallback) and the model continues it (tool_choice auto)."""
    base_url = cluster[0]
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and 21 degrees"},
    ]
    ids = (await post(base_url, "/tokenize", {"model": MODEL, "messages": messages}))["tokens"]
    rendered = (await post(base_url, "/detokenize", {"model": MODEL, "tokens": ids}))["prompt"]
    assert "sunny and 21 degrees" in rendered
    body = {"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 16, "temperature": 0}
    choice = (await post(base_url, "/v1/chat/completions", body))["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["content"]
