"""Structured-output request fields (splitserve.frontend.structured) through the HTTP front door: the GuidedSpec
that reaches the backend, and a 400 naming the field for every malformed or conflicting constraint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from splitserve.engine.guided_spec import GuidedSpec
from splitserve.frontend.errors import APIError
from splitserve.frontend.http_app import build_app
from splitserve.frontend.structured import guided_spec
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer
from splitserve.model import load_model

MODEL = "stories"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


@pytest.fixture(scope="module")
def gguf_tok() -> SimpleTokenizer:
    """stories260K's tokenizer: 256 byte-fallback tokens, so it can write JSON (TinyStories-656K has no '{')."""
    hf = load_model(Path(__file__).resolve().parents[1] / "models/stories260K.gguf", weights=False).tokenizer.hf
    return SimpleTokenizer(hf, bos_token="<s>", eos_token="</s>")


def client(tok, backend) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(SimpleModelInfo(MODEL, tok, 256), backend)),
                             base_url="http://test")


@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GuidedSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     GuidedSpec("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, GuidedSpec("json_object")),
    ({"guided_json": SCHEMA}, GuidedSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, GuidedSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, GuidedSpec("regex", "[0-9]+")),
    ({"guided_choice": ["a", "ü"]}, GuidedSpec("choice", '["a", "ü"]')),
    ({"guided_grammar": 'root ::= "x"'}, GuidedSpec("grammar", 'root ::= "x"')),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, GuidedSpec("regex", "a")),
])
def test_fields_map_to_one_spec(fields, want):
    got = guided_spec(SimpleNamespace(**fields))
    assert (got[0] if got else None) == want


@pytest.mark.parametrize("fields, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": ["x"]}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_malformed_fields_name_the_param(fields, param):
    with pytest.raises(APIError) as e:
        guided_spec(SimpleNamespace(**fields))
    assert e.value.param == param


async def test_spec_reaches_the_backend_on_both_endpoints(gguf_tok):
    backend = ScriptedBackend(script=[*gguf_tok.encode('{"name":"Tom"}', add_special_tokens=False)[1:], 2])
    async with client(gguf_tok, backend) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Name?"}], "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"name": "Tom"}
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "guided_regex": "[a-z]+"})
        assert r.status_code == 200, r.text
    assert backend.calls[0][2].guided == GuidedSpec("json_schema", json.dumps(SCHEMA))
    assert backend.calls[1][2].guided == GuidedSpec("regex", "[a-z]+")


@pytest.mark.parametrize("extra, param, text", [
    ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "Invalid 'guided_json'"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "nothing_here"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "Only one"),
])
async def test_bad_constraints_are_400_before_the_backend(gguf_tok, extra, param, text):
    backend = ScriptedBackend(script=[5, 2])
    async with client(gguf_tok, backend) as c:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"]
    assert backend.calls == []


async def test_vocabulary_that_cannot_write_json_is_a_clear_400(tok):
    async with client(tok, ScriptedBackend(script=[5, 2])) as c:  # TinyStories-656K: no '{' token
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "cannot write" in r.json()["error"]["message"]
