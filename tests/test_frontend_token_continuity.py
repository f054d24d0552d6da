"""Token continuity through the HTTP app (splitserve.frontend.http_app with a TokenContinuity): a finished chat or
completion is remembered (streamed or not), the next turn's prompt reuses the generated ids, and what must not be
remembered is not."""

from __future__ import annotations

import httpx
import pytest

from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo
from splitserve.frontend.token_continuity import TokenContinuity

MODEL = "tiny"


@pytest.fixture
def answer(tok) -> list[int]:
    return tok.encode(" Once upon a time there was a dog", add_special_tokens=False)[1:]  # as generated after ':'


def client(tok, backend, continuity) -> httpx.AsyncClient:
    app = build_app(SimpleModelInfo(MODEL, tok, 512), backend, token_continuity=continuity)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_a_streamed_chat_turn_is_remembered_and_the_next_turn_reuses_its_ids(tok, answer) -> None:
    backend = ScriptedBackend(script=[*answer, tok.eos_token_ids[0]])
    continuity = TokenContinuity(tok)
    messages = [{"role": "user", "content": "Tell me a story."}]
    async with client(tok, backend, continuity) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert continuity.stored == 1
        text = tok.decode([*backend.calls[0][1], *answer])[len(tok.decode(backend.calls[0][1])):]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More!"}]
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
    first, second = backend.calls[0][1], backend.calls[1][1]
    assert second[:len(first) + len(answer)] == [*first, *answer]  # the model's own tokens, EOS left out
    assert continuity.hits == 1 and continuity.stored == 2  # the second turn is remembered too


async def test_completions_remember_every_returned_choice_and_tools_chats_nothing(tok, answer) -> None:
    backend = ScriptedBackend(script=answer)
    continuity = TokenContinuity(tok)
    async with client(tok, backend, continuity) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "The dog", "max_tokens": len(answer), "n": 2})
        assert r.status_code == 200 and continuity.stored == 2 and len(continuity.index) == 1  # same text twice
        texts = [ch["text"] for ch in r.json()["choices"]]
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "The dog" + texts[0] + " and a cat"})
        assert r.status_code == 200 and continuity.hits == 1
        assert backend.calls[1][1][:len(backend.calls[0][1]) + len(answer)] == [*backend.calls[0][1], *answer]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                       "tools": tools, "max_tokens": 4})
        assert r.status_code == 200 and continuity.stored == 3  # the second completion only: tools are not remembered


async def test_without_continuity_every_prompt_is_encoded_fresh(tok, answer) -> None:
    backend = ScriptedBackend(script=answer)
    async with client(tok, backend, None) as c:
        for prompt in ("The dog", "The dog" + tok.decode(answer)):
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
            assert r.status_code == 200 and backend.calls[-1][1] == tok.encode(prompt)
