"""Chat tools (splitserve.frontend.tools): validation, the forced-call grammar, Hermes parsing, streamed deltas,
the chat template with tools and tool results, and the HTTP responses in OpenAI's shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

from splitserve.engine.guided import make_matcher
from splitserve.frontend.chat import render_chat
from splitserve.frontend.errors import APIError
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer
from splitserve.frontend.tools import ToolStream, parse_hermes, plan_tools, template_messages
from splitserve.model import load_model
from tests.test_frontend_chat import QWEN_TEMPLATE

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


@pytest.fixture(scope="module")
def gguf():
    return load_model(Path(__file__).resolve().parents[1] / "models/stories260K.gguf", weights=False).tokenizer


@pytest.fixture(scope="module")
def gguf_tok(gguf) -> SimpleTokenizer:
    return SimpleTokenizer(gguf.hf, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("tools, choice, param", [
    (None, "required", "tool_choice"),
    ({"type": "function"}, None, "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([TOOLS[0], {"type": "retrieval"}], None, "tools[1]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, "tools[0].function.extra"),
    ([TOOLS[0], TOOLS[0]], None, "tools"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
])
def test_bad_tools_name_the_param(tools, choice, param):
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice)
    assert e.value.param == param


def test_modes():
    assert plan_tools(None, None) is None and plan_tools([], "none") is None
    assert plan_tools(TOOLS, None).mode == "auto" and plan_tools(TOOLS, None).guided() is None
    assert plan_tools(TOOLS, "none").guided() is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert (named.mode, named.name) == ("named", "add")
    assert json.loads(named.guided().spec)["properties"]["arguments"] == ADD
    assert [o["properties"]["name"] for o in json.loads(plan_tools(TOOLS, "required").guided().spec)["anyOf"]] == \
        [{"const": "get_weather"}, {"const": "add"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_sampled_under_the_grammar_validate(gguf, choice):
    plan = plan_tools(TOOLS, choice)
    for seed in range(4):
        m = make_matcher(plan.guided(), gguf, 512)
        g, out = torch.Generator().manual_seed(seed), []
        for _ in range(300):
            mask = torch.ones(512, dtype=torch.bool)
            m.fill_mask(mask)
            t = int(torch.multinomial(torch.softmax((torch.randn(512, generator=g) * 3).masked_fill(~mask, float("-inf")), -1), 1, generator=g))
            assert m.accept(t)
            if t == 2:
                break
            out.append(t)
        text = gguf.decode(out)
        content, calls, finish = plan.parse(text, "stop")
        assert content is None and finish == "tool_calls" and len(calls) == 1
        fn = calls[0]["function"]
        assert CALL_ID.match(calls[0]["id"]) and calls[0]["type"] == "function"
        if plan.mode == "named":
            assert fn["name"] == "get_weather"
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
        streamed = _stream(plan, [text[i:i + 3] for i in range(0, len(text), 3)], "stop")
        assert streamed[1] == "tool_calls" and streamed[0][0]["tool_calls"][0]["function"] == {"name": fn["name"], "arguments": ""}
        assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in streamed[0][1:]) == fn["arguments"]


def _stream(plan, pieces, finish):
    s, out = ToolStream(plan), []
    for p in pieces:
        out += s.feed(p)
    more, reason = s.finish(finish)
    return out + more, reason


def test_cut_short_forced_call_stays_content():
    plan = plan_tools(TOOLS, "required")
    assert plan.parse('{"name":"add","arguments":{"a":1', "length") == ('{"name":"add","arguments":{"a":1', [], "length")
    assert _stream(plan, ['{"name":"ad'], "length") == ([{"content": '{"name":"ad'}], "length")


def test_parse_hermes():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("add", {"a": 1, "b": 2})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')[1][0]["function"]["name"] == "add"  # unclosed at EOS


def test_auto_mode_streams_content_then_calls():
    plan = plan_tools(TOOLS, "auto")
    text = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and <tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for size in (1, 4, len(text)):
        deltas, reason = _stream(plan, [text[i:i + size] for i in range(0, len(text), size)], "stop")
        assert reason == "tool_calls"
        assert "".join(d.get("content", "") for d in deltas) == "Sure  and "
        calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [c["index"] for c in calls] == [0, 1] and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert _stream(plan, ["a <tool", "_cal"], "length") == ([{"content": "a "}, {"content": "<tool_cal"}], "length")
    assert _stream(plan_tools(TOOLS, "none"), ["<tool_call>{}"], "stop") == ([{"content": "<tool_call>{}"}], "stop")


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_tools_and_results_render_through_templates():
    msgs = template_messages([{**m, "content": m["content"] or ""} for m in CONVERSATION])
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    qwen = render_chat(msgs, QWEN_TEMPLATE, None, "<|im_end|>", tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in qwen
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in qwen
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in qwen and qwen.endswith("<|im_start|>assistant\n")
    plain = render_chat(msgs, None, tools=TOOLS)
    assert plain.splitlines() == [
        f"system: You may call these tools: {json.dumps(TOOLS, ensure_ascii=False)}",
        'To call one, answer with <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.',
        "user: Weather in Paris?",
        'assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>',
        'tool: <tool_response>{"temp": 21}</tool_response>',
        "assistant:",
    ]


def client(tok, backend) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(SimpleModelInfo("m", tok, 2048), backend)), base_url="http://test")


def _ids(tok, text: str) -> list[int]:
    """Token ids of ``text`` as generated output (without SentencePiece's prepended lone "▁")."""
    ids = tok.encode(text, add_special_tokens=False)
    return ids[1:] if tok.hf.id_to_token(ids[0]) == "▁" else ids


async def test_named_tool_call_over_http(gguf_tok):
    out = '{"name":"get_weather","arguments":{"city":"Oslo","days":3}}'
    backend = ScriptedBackend(script=[*_ids(gguf_tok, out), 2])
    body = {"messages": CONVERSATION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    async with client(gguf_tok, backend) as c:
        r = await c.post("/v1/chat/completions", json=body)
        s = await c.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert CALL_ID.match(call["id"]) and call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo","days":3}'}
    params = backend.calls[0][2]
    assert json.loads(params.guided.spec)["properties"]["name"] == {"const": "get_weather"}
    rendered = render_chat(template_messages([{**m, "content": m["content"] or ""} for m in CONVERSATION]), None, tools=TOOLS)
    assert backend.calls[0][1] == gguf_tok.encode(rendered)  # tools and the tool result went through the template
    chunks = [json.loads(line[6:]) for line in s.text.split("\n\n") if line.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and CALL_ID.match(calls[0]["id"]) and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Oslo","days":3}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(d.get("content") for d in deltas)


async def test_auto_mode_over_http(gguf_tok):
    out = 'Ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    backend = ScriptedBackend(script=[*_ids(gguf_tok, out), 2])
    async with client(gguf_tok, backend) as c:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+2?"}], "tools": TOOLS})
        plain = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+2?"}]})
    msg = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == "Ok"
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert backend.calls[0][2].guided is None
    assert "tool_calls" not in plain.json()["choices"][0]["message"]  # no tools: OpenAI's plain message
