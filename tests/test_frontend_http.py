"""HTTP API, success paths: response shapes, SSE framing, deltas, usage, parameters."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from splitserve.frontend.chat import encode_chat
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer

STORY = "Once upon a time, there was a little girl named Lily. She liked to play outside with her dog."
MODEL = "tinystories"


@pytest.fixture
def story(tok: SimpleTokenizer) -> list[int]:
    return tok.encode(STORY, add_special_tokens=False)


def make_client(tok: SimpleTokenizer, backend: ScriptedBackend, max_model_len: int = 512) -> httpx.AsyncClient:
    app = build_app(SimpleModelInfo(MODEL, tok, max_model_len), backend)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def parse_sse(resp: httpx.Response) -> list:
    """Check SSE framing and return the payloads (dicts, then the string "[DONE]")."""
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    body = resp.text
    assert body.endswith("data: [DONE]\n\n")
    blocks = body.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    assert out.count("[DONE]") == 1 and out[-1] == "[DONE]"
    return out[:-1]


async def test_completion_non_streaming(tok: SimpleTokenizer, story: list[int]) -> None:
    backend = ScriptedBackend(script=[*story, 2], cached_tokens=2)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 100, "user": "u1"})
    assert r.status_code == 200
    body = r.json()
    rid, prompt_ids, params = backend.calls[0]
    assert body["id"] == rid == r.headers["x-request-id"] and rid.startswith("cmpl-") and len(rid) == 37
    assert prompt_ids == tok.encode("Hello") and params.max_tokens == 100
    assert body["object"] == "text_completion" and body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": " " + STORY, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(story) + 1,
        "total_tokens": len(prompt_ids) + len(story) + 1,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


async def test_completion_streaming_framing_deltas_and_usage(tok: SimpleTokenizer, story: list[int]) -> None:
    backend = ScriptedBackend(script=[*story, 2])
    req = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "stream": True}
    async with make_client(tok, backend) as c:
        plain = parse_sse(await c.post("/v1/completions", json=req))
        with_usage = parse_sse(
            await c.post("/v1/completions", json={**req, "stream_options": {"include_usage": True}})
        )
    assert len({chunk["id"] for chunk in plain}) == 1
    assert all(ch["object"] == "text_completion" and ch["usage"] is None for ch in plain)
    assert "".join(ch["choices"][0]["text"] for ch in plain) == " " + STORY
    assert [ch["choices"][0]["finish_reason"] for ch in plain][-1] == "stop"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in plain[:-1])
    assert len(plain) > 5  # really incremental
    *chunks, last = with_usage
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == " " + STORY
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(story) + 1
    n_prompt = len(tok.encode("Hello"))
    assert last["usage"]["prompt_tokens"] == n_prompt and last["usage"]["total_tokens"] == len(story) + 1 + n_prompt


async def test_stop_string_across_tokens_never_streamed(tok: SimpleTokenizer, story: list[int]) -> None:
    stop = "little girl"
    backend = ScriptedBackend(script=[*story, 2])
    req = {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stream": True, "stop": [stop, "zebra"],
           "stream_options": {"include_usage": True}}
    async with make_client(tok, backend) as c:
        *chunks, usage = parse_sse(await c.post("/v1/completions", json=req))
        full = (await c.post("/v1/completions", json={**req, "stream": False, "stream_options": None})).json()
    expected = " " + STORY[: STORY.index(stop)]
    streamed = ""
    for ch in chunks:
        streamed += ch["choices"][0]["text"]
        assert expected.startswith(streamed)  # nothing past the cut, ever
        assert "lit" not in ch["choices"][0]["text"]
    assert streamed == expected == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" == full["choices"][0]["finish_reason"]
    n_stop = next(n for n in range(1, len(story)) if stop in tok.decode(story[:n]))
    assert usage["usage"]["completion_tokens"] == n_stop == full["usage"]["completion_tokens"]
    assert len(backend.aborted) == 2 and not backend.finished


async def test_chat_non_streaming_and_streaming(tok: SimpleTokenizer, story: list[int]) -> None:
    backend = ScriptedBackend(script=[*story[:8], 2])
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": [{"type": "text", "text": "Go"}]}]
    flat = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "Go"}]
    req = {"model": MODEL, "messages": messages}
    async with make_client(tok, backend) as c:
        body = (await c.post("/v1/chat/completions", json=req)).json()
        chunks = parse_sse(await c.post("/v1/chat/completions", json={**req, "stream": True}))
    prompt_ids = encode_chat(tok, flat)
    assert backend.calls[0][1] == prompt_ids
    text = tok.decode(prompt_ids + story[:8])[len(tok.decode(prompt_ids)) :]
    assert text.startswith(" Once")  # the first token keeps its space after "assistant:"
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 9
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == text


async def test_max_tokens_defaults_and_limits(tok: SimpleTokenizer, story: list[int]) -> None:
    backend = ScriptedBackend(script=story)
    async with make_client(tok, backend, max_model_len=64) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 9, "max_completion_tokens": 5,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    chat_prompt = encode_chat(tok, [{"role": "user", "content": "Hi"}])
    assert [p.max_tokens for _, _, p in backend.calls] == [16, 64 - len(chat_prompt), 5]


async def test_sampling_fields_and_token_prompt(tok: SimpleTokenizer, story: list[int]) -> None:
    backend = ScriptedBackend(script=story)
    req = {"model": MODEL, "prompt": [[1, 80, 147]], "max_tokens": 3, "temperature": 0, "top_p": 0.5, "top_k": 7,
           "seed": 42, "stop_token_ids": [5, 6], "ignore_eos": True}
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json=req)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    _, prompt_ids, p = backend.calls[0]
    assert prompt_ids == [1, 80, 147]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids, p.ignore_eos) == (0.0, 0.5, 7, 42, (5, 6), True)


async def test_client_request_ids_are_not_used(tok: SimpleTokenizer, story: list[int]) -> None:
    backend = ScriptedBackend(script=story)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers={"X-Request-Id": "victim-1"})
    assert backend.calls[0][0] == r.json()["id"] != "victim-1"


async def test_models_and_health(tok: SimpleTokenizer) -> None:
    backend = ScriptedBackend()
    async with make_client(tok, backend) as c:
        models = (await c.get("/v1/models")).json()
        ok = await c.get("/health")
        backend.is_ready = False
        down = await c.get("/health")
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 512
    assert ok.status_code == 200 and down.status_code == 503
    assert down.json()["error"]["type"] == "server_error"


async def test_extra_routes_are_mounted(tok: SimpleTokenizer) -> None:
    async def metrics(request):
        return PlainTextResponse("requests_total 0\n")

    app = build_app(SimpleModelInfo(MODEL, tok), ScriptedBackend(), extra_routes=[Route("/metrics", metrics)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.text == "requests_total 0\n"
