"""Structured outputs and constrained tool calls through the disaggregated cluster: twenty JSON schemas
(tests/json_schemas.py), each sent as
chat ``response_format: {"type": "json_schema"}`` and as completions ``guided_json`` (vLLM's extra), streaming and
not. The first token is sampled on the prefill worker under the grammar, the rest on the decode worker from the
grammar state after it; every output must parse and validate against its schema (Draft 2020-12) and end with
``finish_reason: "stop"`` (the grammar closed the value before the token budget ran out). Most schemas run at
temperature 0; every fourth at temperature 1 with a seed (the grammar, not greedy luck, must keep it valid).
Streaming and non-streaming answers to the same request are the same text (greedy or seeded sampling is
deterministic). ``tool_choice`` ``required`` and a named function constrain the call to the tool's parameter schema.

The model is the GGUF test model (stories260K, vocabulary 512 with byte fallback): the default TinyStories-656K
vocabulary has no token containing ``{``, ``}``, ``[`` or ``]`` (and no byte fallback), so it cannot spell a JSON
object or array at all. One cluster serves the whole module.
"""

import asyncio
import json

import httpx
import pytest
from jsonschema import Draft202012Validator

from splitserve.paths import MODELS_DIR
from tests.cluster import start_cluster
from tests.json_schemas import SCHEMAS, strict_compatible
from tests.sse_events import sse

pytestmark = [pytest.mark.integration, pytest.mark.slow]
GGUF = MODELS_DIR / "stories260K.gguf"
MODEL = "stories260K"
MAX_TOKENS = 256
CHAT = [{"role": "user", "content": "Tell me about a story character. Answer in JSON."}]
PROMPT = "Once upon a time, there was a little girl. Here is her story as JSON: "


@pytest.fixture(scope="module")
def gguf_cluster():
    """Router + prefill + decode serving the GGUF model; yields the HTTP base url."""
    cluster, base_url, _ = start_cluster(model=GGUF, worker_args=["--kv-cache-mb", "16", "--block-size", "8"])
    yield base_url
    cluster.stop()


def sampling(i: int) -> dict:
    """Temperature 0, or for every fourth schema temperature 1 with a seed."""
    return {"temperature": 1.0, "seed": 1000 + i} if i % 4 == 3 else {"temperature": 0}


async def chat_json(http: httpx.AsyncClient, name: str, schema: dict, stream: bool, i: int) -> tuple[str, str]:
    """(content, finish_reason) of a chat completion constrained by ``response_format`` json_schema."""
    json_schema = {"name": name, "schema": schema}
    if strict_compatible(schema):
        json_schema["strict"] = True
    body = {"model": MODEL, "messages": CHAT, "max_tokens": MAX_TOKENS, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": json_schema}, **sampling(i)}
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish = "", None
    async for event in sse(http, "/v1/chat/completions", body):
        for choice in event["choices"]:
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


async def completion_json(http: httpx.AsyncClient, schema: dict, stream: bool, i: int) -> tuple[str, str]:
    """(text, finish_reason) of a completion constrained by vLLM's ``guided_json``."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream, "guided_json": schema, **sampling(i)}
    if not stream:
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"]
    text, finish = "", None
    async for event in sse(http, "/v1/completions", body):
        for choice in event["choices"]:
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def test_twenty_schemas_are_valid_draft_2020_12():
    assert len(SCHEMAS) == 20
    for schema in SCHEMAS.values():
        Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("i,name", list(enumerate(SCHEMAS)))
async def test_schema_output_validates(gguf_cluster, i, name):
    base_url = gguf_cluster
    schema = SCHEMAS[name]
    validator = Draft202012Validator(schema)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        outputs = await asyncio.gather(
            chat_json(http, name, schema, False, i), chat_json(http, name, schema, True, i),
            completion_json(http, schema, False, i), completion_json(http, schema, True, i))
    for how, (text, finish) in zip(["chat", "chat stream", "completions", "completions stream"], outputs):
        assert finish == "stop", (how, text)
        value = json.loads(text)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, (how, text, errors)
    assert outputs[0][0] == outputs[1][0]  # streamed == not streamed
    assert outputs[2][0] == outputs[3][0]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
PARTY = {"type": "function", "function": {"name": "plan_party", "description": "Plan a party", "parameters": {
    "type": "object", "properties": {"guests": {"type": "integer", "minimum": 1, "maximum": 10},
                                     "food": {"type": "array", "items": {"type": "string", "enum": ["cake", "apple", "milk"]},
                                              "minItems": 1, "maxItems": 3}},
    "required": ["guests", "food"], "additionalProperties": False}}}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, PARTY)}


def check_tool_calls(calls: list[dict], name: str | None) -> None:
    """Each call names a known tool (``name`` when given: exactly one call to it) and its arguments parse and
    validate against that tool's parameter schema."""
    assert calls
    if name is not None:
        assert len(calls) == 1 and calls[0]["function"]["name"] == name
    for call in calls:
        assert call["type"] == "function" and call["id"]
        schema = TOOLS[call["function"]["name"]]
        args = json.loads(call["function"]["arguments"])
        assert not [e.message for e in Draft202012Validator(schema).iter_errors(args)], args


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "plan_party"}}])
async def test_tool_choice_arguments_validate(gguf_cluster, tool_choice):
    base_url = gguf_cluster
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Plan a party for my friends."}], "tools": [WEATHER, PARTY],
            "tool_choice": tool_choice, "max_tokens": 200, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        events = [e async for e in sse(http, "/v1/chat/completions", {**body, "stream": True})]
    assert choice["finish_reason"] in ("stop", "tool_calls")
    check_tool_calls(choice["message"]["tool_calls"], name)
    calls: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            for delta in c["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = delta.get("id") or call["id"]
                fn = delta.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
    streamed = [calls[i] for i in sorted(calls)]
    check_tool_calls(streamed, name)
    assert [c["function"] for c in streamed] == [c["function"] for c in choice["message"]["tool_calls"]]
