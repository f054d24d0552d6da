"""Odd text and odd JSON over the HTTP API: each case is a clear 400 (never a 500) or is served, and the
next normal request succeeds. Strict types: strings are not numbers, booleans are not integers."""

from __future__ import annotations

import json

import httpx
import pytest

from splitserve.frontend.http_app import build_app
from splitserve.frontend.json_body import MAX_DEPTH
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo

MODEL = "tinystories"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def raw(body: dict, **replace: str) -> bytes:
    """``body`` as JSON, then each ``"<KEY>"`` placeholder string replaced by raw JSON text (escapes kept)."""
    text = json.dumps(body)
    for key, value in replace.items():
        text = text.replace(f'"<{key}>"', value)
    return text.encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


S = '"a\\ud800b"'  # a JSON string holding an unpaired surrogate
LOW = '"\\udfff"'

# (id, path, raw body, param, message fragment)
BAD = [
    # unpaired surrogates in every text field (and in ignored fields and keys)
    ("surrogate-prompt", COMPLETIONS, raw({**GOOD, "prompt": "<X>"}, X=S), "prompt", "unpaired UTF-16 surrogate (\\ud800)"),
    ("surrogate-prompt-list", COMPLETIONS, raw({**GOOD, "prompt": ["<X>"]}, X=S), "prompt.0", "unpaired"),
    ("surrogate-stop", COMPLETIONS, raw({**GOOD, "stop": "<X>"}, X=LOW), "stop", "(\\udfff)"),
    ("surrogate-stop-list", COMPLETIONS, raw({**GOOD, "stop": ["ok", "<X>"]}, X=LOW), "stop.1", "unpaired"),
    ("surrogate-model", COMPLETIONS, raw({**GOOD, "model": "<X>"}, X=S), "model", "unpaired"),
    ("surrogate-user", COMPLETIONS, raw({**GOOD, "user": "<X>"}, X=S), "user", "unpaired"),
    ("surrogate-key", COMPLETIONS, raw({**GOOD, "<K>": 1}).replace(b'"<K>"', S.encode()), None, "a key of the request body"),
    ("surrogate-chat-content", CHAT, raw({**GOOD_CHAT, "messages": [{"role": "user", "content": "<X>"}]}, X=S),
     "messages.0.content", "unpaired"),
    ("surrogate-chat-part", CHAT, raw({**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "<X>"}]}]}, X=S),
     "messages.0.content.0.text", "unpaired"),
    ("surrogate-chat-name", CHAT, raw({**GOOD_CHAT, "messages": [{"role": "user", "content": "hi", "name": "<X>"}]}, X=S),
     "messages.0.name", "unpaired"),
    ("surrogate-chat-stop", CHAT, raw({**GOOD_CHAT, "stop": ["<X>"]}, X=S), "stop.0", "unpaired"),
    ("surrogate-swapped-pair", COMPLETIONS, raw({**GOOD, "prompt": "<X>"}, X='"\\ude00\\ud83d"'), "prompt", "unpaired"),
    # not JSON numbers, or out of range
    ("nan", COMPLETIONS, raw({**GOOD, "temperature": "<X>"}, X="NaN"), None, "NaN is not a valid JSON number"),
    ("infinity", COMPLETIONS, raw({**GOOD, "top_p": "<X>"}, X="Infinity"), None, "Infinity is not a valid JSON number"),
    ("minus-infinity", COMPLETIONS, raw({**GOOD, "temperature": "<X>"}, X="-Infinity"), None, "-Infinity is not"),
    ("nan-in-ignored-field", COMPLETIONS, raw({**GOOD, "metadata": {"x": "<X>"}}, X="NaN"), None, "NaN"),
    ("1e400", COMPLETIONS, raw({**GOOD, "temperature": "<X>"}, X="1e400"), None, "1e400 is out of range"),
    ("max-tokens-1e400", COMPLETIONS, raw({**GOOD, "max_tokens": "<X>"}, X="-1e400"), None, "out of range"),
    ("5000-digit-integer", COMPLETIONS, raw({**GOOD, "max_tokens": "<X>"}, X="9" * 5000), None, "(5000 digits) is out of range"),
    # duplicate keys, deep nesting, encodings
    ("duplicate-key", COMPLETIONS, b'{"prompt": "a", "max_tokens": 3, "max_tokens": 4}', "max_tokens", "appears more than once"),
    ("duplicate-nested-key", CHAT, b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', "role", "more than once"),
    ("nested-too-deep", COMPLETIONS, raw({**GOOD, "user": "<X>"}, X=nested(MAX_DEPTH)), None, f"more than {MAX_DEPTH} levels"),
    ("nested-past-recursion-limit", COMPLETIONS, raw({**GOOD, "user": "<X>"}, X=nested(100_000)), None, "levels deep"),
    ("nested-objects", CHAT, raw({**GOOD_CHAT, "messages": [{"role": "user", "content": "x", "name": "<X>"}]},
                                  X='{"a":' * 50 + "1" + "}" * 50), None, "levels deep"),
    ("invalid-utf8", COMPLETIONS, b'{"prompt": "a\xff\xfeb", "max_tokens": 3}', None, "not valid UTF-8 (byte 0xff at position 13)"),
    ("utf8-encoded-surrogate", COMPLETIONS, b'{"prompt": "a\xed\xa0\x80", "max_tokens": 3}', None, "not valid UTF-8"),
    ("overlong-utf8", COMPLETIONS, b'{"prompt": "\xc0\xaf", "max_tokens": 3}', None, "not valid UTF-8"),
    ("utf16-body", COMPLETIONS, json.dumps(GOOD).encode("utf-16"), None, "not valid UTF-8"),
    ("latin1-body", COMPLETIONS, json.dumps({**GOOD, "prompt": "café"}, ensure_ascii=False).encode("latin-1"), None, "not valid UTF-8"),
    ("empty-body", COMPLETIONS, b"", None, "could not parse"),
]


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def post(c: httpx.AsyncClient, path: str, body: bytes, content_type: str = "application/json") -> httpx.Response:
    return await c.post(path, content=body, headers={"content-type": content_type})


@pytest.mark.parametrize(("path", "body", "param", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
async def test_odd_body_is_a_400_then_a_good_request_succeeds(tok, path, body, param, fragment) -> None:
    backend = ScriptedBackend(script=tok.encode(" upon a time there", add_special_tokens=False))
    async with client(build_app(SimpleModelInfo(MODEL, tok, 64), backend)) as c:
        r = await post(c, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert fragment in err["message"], err["message"]
        r.content.decode("utf-8")  # the error body itself is valid UTF-8 JSON
        assert backend.calls == []
        good = await c.post(COMPLETIONS, json=GOOD)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


SERVED = [
    # (id, path, raw body, content type): odd but valid -> 200
    ("nul-in-prompt", COMPLETIONS, raw({**GOOD, "prompt": "<X>"}, X='"a\\u0000b"'), "application/json"),
    ("nul-in-stop", COMPLETIONS, raw({**GOOD, "stop": ["<X>"]}, X='"\\u0000"'), "application/json"),
    ("nul-in-chat", CHAT, raw({**GOOD_CHAT, "messages": [{"role": "user", "content": "<X>"}]}, X='"\\u0000"'), "application/json"),
    ("escaped-surrogate-pair", COMPLETIONS, raw({**GOOD, "prompt": "<X>"}, X='"hi \\ud83d\\ude00"'), "application/json"),
    ("raw-utf8-emoji", COMPLETIONS, json.dumps({**GOOD, "prompt": "hi 😀 é"}, ensure_ascii=False).encode(), "application/json"),
    ("escaped-backslash-u", COMPLETIONS, raw({**GOOD, "prompt": "<X>"}, X='"\\\\ud800"'), "application/json"),
    ("utf8-bom", COMPLETIONS, b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), "application/json"),
    ("charset-latin1-header", COMPLETIONS, json.dumps(GOOD).encode(), "application/json; charset=latin-1"),
    ("charset-utf16-header", COMPLETIONS, json.dumps(GOOD).encode(), "application/json; charset=utf-16"),
    ("no-content-type", COMPLETIONS, json.dumps(GOOD).encode(), ""),
    ("nesting-at-the-limit", COMPLETIONS, raw({**GOOD, "metadata": "<X>"}, X=nested(MAX_DEPTH - 1)), "application/json"),
    ("many-messages", CHAT, json.dumps({**GOOD_CHAT, "max_tokens": 1, "messages": [{"role": "user", "content": "a"}] * 40}).encode(),
     "application/json"),
    ("big-valid-integer", COMPLETIONS, raw({**GOOD, "seed": "<X>"}, X=str(2**63 - 1)), "application/json"),
]


@pytest.mark.parametrize(("path", "body", "content_type"), [c[1:] for c in SERVED], ids=[c[0] for c in SERVED])
async def test_odd_but_valid_body_is_served(tok, path, body, content_type) -> None:
    backend = ScriptedBackend(script=tok.encode(" upon a time there", add_special_tokens=False))
    async with client(build_app(SimpleModelInfo(MODEL, tok, 256), backend)) as c:
        r = await post(c, path, body, content_type)
        assert r.status_code == 200, r.text
        assert len(backend.calls) == 1


async def test_nul_and_surrogate_pair_reach_the_tokenizer_intact(tok) -> None:
    backend = ScriptedBackend(script=[5, 6, 7])
    async with client(build_app(SimpleModelInfo(MODEL, tok, 256), backend)) as c:
        r = await post(c, COMPLETIONS, raw({**GOOD, "prompt": "<X>"}, X='"a\\u0000b \\ud83d\\ude00"'))
    assert r.status_code == 200
    assert backend.calls[0][1] == tok.encode("a\x00b 😀")


async def test_an_error_echoing_a_surrogate_is_still_valid_utf8(tok) -> None:
    """Defence in depth: an APIError whose message holds an unpaired surrogate renders (escaped), not a 500."""
    from splitserve.frontend.errors import APIError, error_response

    r = error_response(APIError("model `\ud800` not found", param="model\udfff"))
    body = json.loads(r.body)
    assert body["error"]["message"] == "model `\\ud800` not found" and body["error"]["param"] == "model\\udfff"


# ------------------------------------------------------------------------------------------- strict types

TYPE_ERRORS = [
    # (id, path, body, param, expected message)
    ("max-tokens-string", COMPLETIONS, {**GOOD, "max_tokens": "8"}, "max_tokens",
     "Invalid type for 'max_tokens': expected an integer, but got a string instead."),
    ("max-tokens-bool", COMPLETIONS, {**GOOD, "max_tokens": True}, "max_tokens",
     "Invalid type for 'max_tokens': expected an integer, but got a boolean instead."),
    ("max-tokens-fraction", COMPLETIONS, {**GOOD, "max_tokens": 8.5}, "max_tokens",
     "Invalid type for 'max_tokens': expected an integer, but got a decimal number instead."),
    ("max-tokens-list", COMPLETIONS, {**GOOD, "max_tokens": [8]}, "max_tokens",
     "Invalid type for 'max_tokens': expected an integer, but got an array instead."),
    ("max-completion-tokens-string", CHAT, {**GOOD_CHAT, "max_completion_tokens": "5"}, "max_completion_tokens",
     "expected an integer, but got a string"),
    ("temperature-string", COMPLETIONS, {**GOOD, "temperature": "0.5"}, "temperature",
     "Invalid type for 'temperature': expected a number, but got a string instead."),
    ("temperature-bool", COMPLETIONS, {**GOOD, "temperature": False}, "temperature", "expected a number, but got a boolean"),
    ("top-p-string", COMPLETIONS, {**GOOD, "top_p": "1"}, "top_p", "expected a number, but got a string"),
    ("top-k-string", COMPLETIONS, {**GOOD, "top_k": "5"}, "top_k", "expected an integer, but got a string"),
    ("top-k-fraction", COMPLETIONS, {**GOOD, "top_k": 1.5}, "top_k", "expected an integer, but got a decimal number"),
    ("seed-string", COMPLETIONS, {**GOOD, "seed": "7"}, "seed", "expected an integer, but got a string"),
    ("n-string", COMPLETIONS, {**GOOD, "n": "1"}, "n", "expected an integer, but got a string"),
    ("n-bool", COMPLETIONS, {**GOOD, "n": True}, "n", "expected an integer, but got a boolean"),
    ("stream-string", COMPLETIONS, {**GOOD, "stream": "true"}, "stream",
     "Invalid type for 'stream': expected a boolean, but got a string instead."),
    ("stream-integer", COMPLETIONS, {**GOOD, "stream": 1}, "stream", "expected a boolean, but got an integer"),
    ("stream-null", COMPLETIONS, {**GOOD, "stream": None}, "stream", "expected a boolean, but got null"),
    ("ignore-eos-string", COMPLETIONS, {**GOOD, "ignore_eos": "yes"}, "ignore_eos", "expected a boolean, but got a string"),
    ("include-usage-string", COMPLETIONS, {**GOOD, "stream": True, "stream_options": {"include_usage": "true"}},
     "stream_options.include_usage", "expected a boolean, but got a string"),
    ("stream-options-string", COMPLETIONS, {**GOOD, "stream": True, "stream_options": "usage"}, "stream_options",
     "expected an object, but got a string"),
    ("stop-token-ids-strings", COMPLETIONS, {**GOOD, "stop_token_ids": ["2"]}, "stop_token_ids.0",
     "expected an integer, but got a string"),
    ("stop-token-ids-bools", COMPLETIONS, {**GOOD, "stop_token_ids": [True]}, "stop_token_ids.0", "expected an integer"),
    ("model-integer", COMPLETIONS, {**GOOD, "model": 7}, "model", "expected a string, but got an integer"),
    ("prompt-ids-bools", COMPLETIONS, {**GOOD, "prompt": [True, 2]}, "prompt", "string or a list of token ids"),
    ("prompt-ids-strings", COMPLETIONS, {**GOOD, "prompt": [["1"]]}, "prompt", "string or a list of token ids"),
    ("chat-role-integer", CHAT, {**GOOD_CHAT, "messages": [{"role": 1, "content": "x"}]}, "messages.0.role", None),
    ("chat-content-integer", CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "string or a list of text content parts"),
    ("chat-part-text-integer", CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content", "string or a list of text content parts"),
    ("chat-messages-object", CHAT, {**GOOD_CHAT, "messages": {"role": "user"}}, "messages", "expected an array, but got an object"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), [c[1:] for c in TYPE_ERRORS], ids=[c[0] for c in TYPE_ERRORS])
async def test_wrong_json_type_is_a_400_naming_the_field(tok, path, body, param, message) -> None:
    backend = ScriptedBackend(script=tok.encode(" upon a time there", add_special_tokens=False))
    async with client(build_app(SimpleModelInfo(MODEL, tok, 64), backend)) as c:
        r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        if message:
            assert message in err["message"], err["message"]
        assert backend.calls == []
        assert (await c.post(COMPLETIONS, json=GOOD)).status_code == 200


@pytest.mark.parametrize(("field", "value", "seen"), [
    ("max_tokens", 3.0, ("max_tokens", 3)),  # an integral JSON number is an integer
    ("temperature", 1, ("temperature", 1.0)),  # an integer is a number
    ("top_p", 1, ("top_p", 1.0)),
    ("seed", 7.0, ("seed", 7)),
    ("top_k", 5.0, ("top_k", 5)),
])
async def test_numbers_that_are_the_right_json_type_are_accepted(tok, field, value, seen) -> None:
    backend = ScriptedBackend(script=tok.encode(" upon a time there", add_special_tokens=False))
    async with client(build_app(SimpleModelInfo(MODEL, tok, 64), backend)) as c:
        r = await c.post(COMPLETIONS, json={**GOOD, field: value})
    assert r.status_code == 200, r.text
    params = backend.calls[0][2]
    name, expected = seen
    got = getattr(params, name)
    assert got == expected and type(got) is type(expected)
