"""HTTP API, failure paths: 4xx bodies, backend errors before/after the first byte, disconnects."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from splitserve import errors as pd
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer

MODEL = "tinystories"
GOOD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5}


@pytest.fixture
def story(tok: SimpleTokenizer) -> list[int]:
    return tok.encode("Once upon a time, there was a little girl named Lily. She liked to play.", add_special_tokens=False)


def make_app(tok: SimpleTokenizer, backend: ScriptedBackend, max_model_len: int = 64):
    return build_app(SimpleModelInfo(MODEL, tok, max_model_len), backend)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def assert_error(r: httpx.Response, status: int, *, param=None, code=None, type_=None, message=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["param"] == param and err["code"] == code and err["message"]
    if type_ is not None:
        assert err["type"] == type_
    if message is not None:
        assert message in err["message"], err["message"]
    return err


CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _call_with(arguments) -> dict:
    """An assistant message calling ``add`` with ``arguments``."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}


TOOL_CALL = _call_with('{"a": 2, "b": 2}')
TOOL_REPLY = {"role": "tool", "tool_call_id": "call_1", "content": "4"}

BAD_REQUESTS = [
    # (path, body, status, param, code, message fragment)
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found", "`gpt-4` does not exist"),
    ("/v1/completions", {**GOOD, "prompt": ["one", "two"]}, 400, "prompt", None, "Batched prompts"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], [3]]}, 400, "prompt", None, "holds 2 prompts"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", None, "must not be empty"),
    ("/v1/completions", {**GOOD, "prompt": 7}, 400, "prompt", None, "string or a list of token ids"),
    ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt", None, "out of range"),
    ("/v1/completions", {k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt", None, "Missing required"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", None, "greater than or equal to 1"),
    ("/v1/completions", {**GOOD, "n": 129}, 400, "n", None, "less than or equal to 128"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs", None, "less than or equal to 20"),
    ("/v1/completions", {**GOOD, "logprobs": True}, 400, "logprobs", None, "expected an integer"),
    ("/v1/completions", {**GOOD, "n": 2, "best_of": 1}, 400, "best_of", None, "at least n (2)"),
    ("/v1/completions", {**GOOD, "best_of": 2, "stream": True}, 400, "best_of", None, "cannot be used with stream"),
    ("/v1/completions", {**GOOD, "suffix": "x"}, 400, "suffix", None, "no fill-in-the-middle (FIM) support"),
    ("/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty", None, "less than or equal to 2"),
    ("/v1/completions", {**GOOD, "frequency_penalty": -3}, 400, "frequency_penalty", None, "greater than or equal to -2"),
    ("/v1/completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty", None, "greater than 0"),
    ("/v1/completions", {**GOOD, "min_p": 1.5}, 400, "min_p", None, "less than or equal to 1"),
    ("/v1/completions", {**GOOD, "min_tokens": 6}, 400, "min_tokens", None, "min_tokens must be in [0, max_tokens=5]"),
    ("/v1/completions", {**GOOD, "logit_bias": {"abc": 1}}, 400, "logit_bias", None, "strings of digits"),
    ("/v1/completions", {**GOOD, "logit_bias": {"-5": 1}}, 400, "logit_bias", None, "strings of digits"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias", None, "must be in [-100, 100]"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": "x"}}, 400, "logit_bias", None, "must be a number"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": True}}, 400, "logit_bias", None, "must be a number"),
    ("/v1/completions", {**GOOD, "logit_bias": {"99999": 1}}, 400, "logit_bias", None, "out of range"),
    ("/v1/completions", {**GOOD, "logit_bias": [5]}, 400, "logit_bias", None, "expected an object"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": []}, 400, "allowed_token_ids", None, "at least 1"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": [99999]}, 400, "allowed_token_ids", None, "out of range"),
    ("/v1/completions", {**GOOD, "bad_words": [" "]}, 400, "bad_words", None, "encodes to no tokens"),
    ("/v1/completions", {**GOOD, "prompt_logprobs": 21}, 400, "prompt_logprobs", None, "less than or equal to 20"),
    ("/v1/completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate", None, "Unrecognized request argument"),
    ("/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature", None, "less than or equal to 2"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", None, "greater than 0"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", None, "only allowed with echo"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", None, "greater than or equal to 0"),
    ("/v1/completions", {**GOOD, "max_tokens": 500}, 400, "max_tokens", "context_length_exceeded", "maximum context length is 64"),
    ("/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded", "maximum context length"),
    ("/v1/completions", {**GOOD, "prompt": list(range(3, 67)), "max_tokens": 1}, 400, "prompt", "context_length_exceeded",
     "(64 in the prompt, 1 in the completion)"),
    ("/v1/completions", {**GOOD, "prompt": "Once upon a time " * 40}, 400, "prompt", "context_length_exceeded", None),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded", None),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None, "at most 4"),
    ("/v1/completions", {**GOOD, "stop": [""]}, 400, "stop", None, "must not be empty"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [5000]}, 400, "stop_token_ids", None, "out of range"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", None,
     "only allowed when stream"),
    ("/v1/chat/completions", {**CHAT_OK, "stream_options": {"include_usage": True}}, 400, "stream_options", None,
     "only allowed when stream"),
    ("/v1/completions", {**GOOD, "seed": -(2**63) - 1}, 400, "seed", None, "signed 64-bit"),
    ("/v1/completions", {**GOOD, "seed": 2**63}, 400, "seed", None, "signed 64-bit"),
    ("/v1/completions", [GOOD], 400, None, None, "JSON object"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, 400, "messages", None, "at least 1"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", None, None),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content", None, "text content parts"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "system", "content": "s"}, {"role": "user"}]}, 400,
     "messages[1].content", None, "Missing required parameter: 'messages[1].content'"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content",
     None, "Missing required parameter"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [*CHAT_OK["messages"], {"role": "assistant"}]}, 400,
     "messages[1].content", None, "Missing required parameter"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [*CHAT_OK["messages"], TOOL_CALL, {"role": "tool", "content": "4"}]},
     400, "messages[2].tool_call_id", None, "Missing required parameter: 'messages[2].tool_call_id'"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [*CHAT_OK["messages"], TOOL_CALL, {**TOOL_REPLY, "tool_call_id": 7}]},
     400, "messages[2].tool_call_id", None, "needs the id of the tool call"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [*CHAT_OK["messages"], _call_with("{not json"), TOOL_REPLY]}, 400,
     "messages[1].tool_calls[0].function.arguments", None, "is not valid JSON"),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [*CHAT_OK["messages"], _call_with({"a": 1}), TOOL_REPLY]}, 400,
     "messages[1].tool_calls[0].function.arguments", None, "must be a JSON string"),
    ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs", None, "requires logprobs to be true"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None, "less than or equal to 20"),
    ("/v1/chat/completions", {**CHAT_OK, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None, "stream"),
    ("/v1/chat/completions", {**CHAT_OK, "echo": True}, 400, "echo", None, "Unrecognized request argument"),
    ("/v1/chat/completions", {**CHAT_OK, "best_of": 2}, 400, "best_of", None, "Unrecognized request argument"),
    ("/v1/chat/completions", {**CHAT_OK, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "tools[0].function.name", None,
     "letters, digits"),
    # TinyStories-656K's vocabulary has no '{': JSON output is impossible (stories260K.gguf can)
    ("/v1/chat/completions", {**CHAT_OK, "response_format": {"type": "json_object"}}, 400, "response_format", None, "cannot write"),
    ("/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 100}, 400, "max_completion_tokens",
     "context_length_exceeded", None),
    ("/v1/chat/completions", {**CHAT_OK, "max_tokens": 5, "max_completion_tokens": 10**9}, 400, "max_completion_tokens",
     "context_length_exceeded", None),
    ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": "Once upon a time " * 40}]}, 400,
     "messages", "context_length_exceeded", None),
    ("/v1/chat/completions", {**CHAT_OK, "model": "other"}, 404, "model", "model_not_found", None),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code", "fragment"), BAD_REQUESTS)
async def test_bad_request_then_good_request(tok, story, path, body, status, param, code, fragment) -> None:
    backend = ScriptedBackend(script=story)
    async with client(make_app(tok, backend)) as c:
        assert_error(await c.post(path, json=body), status, param=param, code=code, message=fragment,
                     type_="invalid_request_error")
        assert backend.calls == []
        good = await c.post("/v1/completions", json=GOOD)
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"


async def test_a_tool_conversation_that_follows_the_rules_is_accepted(tok, story) -> None:
    backend = ScriptedBackend(script=story)
    body = {**CHAT_OK, "max_tokens": 2, "messages": [*CHAT_OK["messages"], TOOL_CALL, TOOL_REPLY,
                                                     {"role": "assistant", "content": ""}, {"role": "user", "content": "ok"}]}
    async with client(make_app(tok, backend, max_model_len=512)) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


async def test_tokenize_checks_messages_as_chat_does(tok, story) -> None:
    async with client(make_app(tok, ScriptedBackend(script=story))) as c:
        r = await c.post("/tokenize", json={"messages": [{"role": "user"}]})
    assert_error(r, 400, param="messages[0].content", message="Missing required parameter")


async def test_malformed_json_and_unknown_routes(tok, story) -> None:
    async with client(make_app(tok, ScriptedBackend(script=story))) as c:
        assert_error(await c.post("/v1/completions", content=b"{not json"), 400, message="could not parse the JSON")
        assert_error(await c.post("/v1/chat/completions", content=b"\xff\xfe"), 400, message="could not parse")
        assert_error(await c.get("/v1/nothing"), 404)
        assert_error(await c.get("/v1/completions"), 405)
        assert (await c.post("/v1/completions", json=GOOD)).status_code == 200


async def test_ignored_fields_are_accepted(tok, story) -> None:
    req = {**GOOD, "user": "me", "logprobs": None, "echo": False, "best_of": 1, "frequency_penalty": 0}
    chat = {**CHAT_OK, "max_tokens": 3, "store": False, "metadata": {"a": "b"}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": True, "logprobs": False}
    async with client(make_app(tok, ScriptedBackend(script=story))) as c:
        assert (await c.post("/v1/completions", json=req)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200


BACKEND_ERRORS = [
    (pd.InvalidRequest("prompt too long for KV cache"), 400, "invalid_request_error", None),
    (pd.CapacityExhausted("no free KV blocks"), 503, "server_error", "capacity_exhausted"),
    (pd.WorkerUnavailable("no decode worker"), 503, "server_error", "worker_unavailable"),
    (pd.KVTransferError("UCX timeout"), 503, "server_error", "kv_transfer_failed"),
    (pd.KVLayoutMismatch("block_size 16 vs 32"), 500, "server_error", "kv_layout_mismatch"),
    (RuntimeError("secret internals"), 500, "server_error", "internal_error"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("exc", "status", "type_", "code"), BACKEND_ERRORS)
async def test_backend_error_before_first_byte(tok, story, exc, status, type_, code, stream) -> None:
    backend = ScriptedBackend(script=story, error_before_first=exc)
    async with client(make_app(tok, backend)) as c:
        r = await c.post("/v1/completions", json={**GOOD, "stream": stream})
        err = assert_error(r, status, code=code, type_=type_)
        assert "secret" not in err["message"]
        if status == 503:
            assert r.headers["retry-after"] == "1"
        backend.error_before_first = None
        assert (await c.post("/v1/completions", json={**GOOD, "stream": stream})).status_code == 200
    assert len(backend.aborted) == 1


async def test_backend_error_mid_stream_is_an_sse_error_event(tok, story) -> None:
    backend = ScriptedBackend(script=story, error_after=(3, pd.KVTransferError("peer vanished")))
    async with client(make_app(tok, backend)) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT_OK, "stream": True, "max_tokens": 20})
        non_stream = await c.post("/v1/chat/completions", json={**CHAT_OK, "max_tokens": 20})
    assert r.status_code == 200
    events = [b[len("data: "):] for b in r.text.split("\n\n") if b]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert err == {"error": {"message": "peer vanished", "type": "server_error", "param": None, "code": "kv_transfer_failed"}}
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert_error(non_stream, 503, code="kv_transfer_failed")
    assert len(backend.aborted) == 2


# ---------------------------------------------------------------- disconnects (raw ASGI)


async def call_asgi(app, path: str, body: dict, disconnect_after) -> list[dict]:
    """Drive the ASGI app directly; the client 'disconnects' once disconnect_after(sent) is true."""
    gone = asyncio.Event()
    sent: list[dict] = []
    first = True
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("c", 1),
             "server": ("s", 80)}

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if disconnect_after(sent):
            gone.set()

    async def watch_backend_start() -> None:
        while not disconnect_after(sent):
            await asyncio.sleep(0.01)
        gone.set()

    watcher = asyncio.ensure_future(watch_backend_start())
    try:
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
    finally:
        watcher.cancel()
    return sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_while_streaming_aborts_backend(tok, story, path) -> None:
    backend = ScriptedBackend(script=story * 20, delay=0.01)
    body = {**(GOOD if "chat" not in path else CHAT_OK), "max_tokens": 50, "stream": True}
    sent = await call_asgi(make_app(tok, backend, 512), path, body,
                           lambda s: sum(m["type"] == "http.response.body" for m in s) >= 3)
    assert len(backend.aborted) == 1 and not backend.finished
    assert sent[0]["status"] == 200
    assert not any(m.get("more_body") is False for m in sent)  # the stream was cut, never completed


async def test_disconnect_before_first_token_and_non_streaming_aborts_backend(tok, story) -> None:
    for stream in (True, False):
        backend = ScriptedBackend(script=story * 20, delay=0.05)
        body = {**GOOD, "max_tokens": 100, "stream": stream}
        await call_asgi(make_app(tok, backend, 512), "/v1/completions", body, lambda s, backend=backend: backend.started.is_set())
        assert len(backend.aborted) == 1 and not backend.finished, stream
