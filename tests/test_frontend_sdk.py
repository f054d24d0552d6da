"""The official openai SDK against the app served by uvicorn on 127.0.0.1 (port 0, in a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from splitserve import errors as pd
from splitserve.frontend.chat import encode_chat
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer

STORY = "Once upon a time, there was a little girl named Lily. She liked to play outside with her dog."
MODEL = "tinystories"


@pytest.fixture(scope="module")
def backend(tok: SimpleTokenizer) -> ScriptedBackend:
    return ScriptedBackend(script=[*tok.encode(STORY, add_special_tokens=False), 2])


@pytest.fixture(scope="module")
def base_url(tok: SimpleTokenizer, backend: ScriptedBackend) -> Iterator[str]:
    app = build_app(SimpleModelInfo(MODEL, tok, 512), backend)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=10)


def completion_text(tok: SimpleTokenizer, prompt_ids: list[int]) -> str:
    gen = tok.encode(STORY, add_special_tokens=False)
    return tok.decode(prompt_ids + gen)[len(tok.decode(prompt_ids)) :]


def test_completions(sdk: openai.OpenAI, tok: SimpleTokenizer) -> None:
    resp = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=100, extra_body={"top_k": 5})
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.choices[0].text == completion_text(tok, tok.encode("Hello")) and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(tok.encode(STORY, add_special_tokens=False)) + 1
    assert resp.usage.prompt_tokens_details.cached_tokens == 0

    stream = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=100, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_chat(sdk: openai.OpenAI, tok: SimpleTokenizer) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    resp = sdk.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8)
    prompt_ids = encode_chat(tok, messages)
    gen = tok.encode(STORY, add_special_tokens=False)[:8]
    expected = tok.decode(prompt_ids + gen)[len(tok.decode(prompt_ids)) :]
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids), 8)

    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings(sdk: openai.OpenAI) -> None:
    resp = sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=100, stop=["named Lily"])
    assert resp.choices[0].text == " Once upon a time, there was a little girl "
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              stop="little", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.endswith("there was a ") and "lit" not in text


def test_errors_are_raised_as_sdk_exceptions(sdk: openai.OpenAI, backend: ScriptedBackend) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        sdk.completions.create(model="gpt-4", prompt="Hi")
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        sdk.completions.create(model=MODEL, prompt="Hi", n=0)
    assert br.value.param == "n" and "greater than or equal to 1" in br.value.message
    with pytest.raises(openai.BadRequestError) as br:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert br.value.param == "top_logprobs"
    backend.error_before_first = pd.CapacityExhausted("no free KV blocks")
    try:
        with pytest.raises(openai.InternalServerError) as ise:
            sdk.completions.create(model=MODEL, prompt="Hi", stream=True)
        assert ise.value.status_code == 503 and ise.value.code == "capacity_exhausted"
    finally:
        backend.error_before_first = None
    assert sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"


def test_socket_disconnect_aborts_backend(base_url: str, backend: ScriptedBackend) -> None:
    slow = ScriptedBackend(script=[t for t in backend.script if t != 2] * 50, delay=0.02)
    original = backend.generate
    backend.generate = slow.generate  # route this request to the slow backend
    try:
        with httpx.Client(base_url=base_url, timeout=10) as c:
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 400,
                                                           "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_raw())  # first event arrived; now hang up
        deadline = time.monotonic() + 5
        while not slow.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        backend.generate = original
    assert len(slow.aborted) == 1 and not slow.finished


def test_socket_disconnect_aborts_non_streaming_request(base_url: str, backend: ScriptedBackend) -> None:
    slow = ScriptedBackend(script=[t for t in backend.script if t != 2] * 50, delay=0.02)
    original = backend.generate
    backend.generate = slow.generate
    try:
        with httpx.Client(base_url=base_url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 400})
        deadline = time.monotonic() + 5
        while not slow.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        backend.generate = original
    assert len(slow.aborted) == 1 and not slow.finished
