"""HTTP API logprobs with the fake backend: OpenAI's completions and chat logprob objects, echo (prompt logprobs,
first prompt token null), ``max_tokens: 0`` (lm-eval's loglikelihood), vLLM's ``prompt_logprobs``, streaming."""

from __future__ import annotations

import pytest

from splitserve.frontend.logprob_format import LOGPROB_FLOOR
from splitserve.frontend.testing import ScriptedBackend, SimpleTokenizer, fake_logprob
from tests.test_frontend_http import MODEL, make_client, parse_sse

PROMPT = "Once upon a time"
ECHOED = "<|start_story|> Once upon a time"
"""What echo shows of PROMPT: its tokens' text, BOS kept (the tokenizer's "▁" dummy prefix token shows after it)."""


@pytest.fixture
def out_ids(tok: SimpleTokenizer) -> list[int]:
    return tok.encode(" there was a little girl", add_special_tokens=False)


def text_of(tok: SimpleTokenizer, token_id: int, at_start: bool = False) -> str:
    """The token's text in the middle of a text (after an anchor token "a", whose text is cut), or as a text's
    first token (decoded alone): the pieces of a text then join to it."""
    if at_start:
        return tok.hf.decode([token_id], skip_special_tokens=False)
    anchor = tok.hf.encode("a", add_special_tokens=False).ids[-1:]
    return tok.hf.decode([*anchor, token_id], skip_special_tokens=False)[len(tok.hf.decode(anchor)):]


def expected_completion_logprobs(tok, ids: list[int], k: int, first_null: bool = False) -> dict:
    """OpenAI's legacy logprobs object as the fake backend's logprobs make it (see fake_logprob)."""
    tokens = [text_of(tok, t, at_start=first_null and i == 0) for i, t in enumerate(ids)]  # first_null: echo
    token_logprobs, top_logprobs = [], []
    for i, t in enumerate(ids):
        if first_null and i == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        lp = fake_logprob(t, k)
        token_logprobs.append(lp.logprob)
        top = {}
        for alt, alt_lp in lp.top:
            top.setdefault(text_of(tok, alt), alt_lp)
        top.setdefault(tokens[i], lp.logprob)
        top_logprobs.append(top)
    offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


async def test_completion_logprobs_object(tok, out_ids) -> None:
    backend = ScriptedBackend(script=out_ids)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "logprobs": 2})
    assert r.status_code == 200, r.text
    params = backend.calls[0][2]
    assert params.logprobs == 2 and params.prompt_logprobs is None
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] == expected_completion_logprobs(tok, out_ids[:5], 2)
    assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])  # k alternatives + the chosen token
    assert "prompt_logprobs" not in choice  # vLLM's extra only when asked for


async def test_logprobs_zero_gives_the_chosen_token_only(tok, out_ids) -> None:
    async with make_client(tok, ScriptedBackend(script=out_ids)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{text_of(tok, t): fake_logprob(t, 0).logprob} for t in out_ids[:3]]


async def test_echo_with_logprobs_puts_the_prompt_first_with_a_null_first_token(tok, out_ids) -> None:
    backend = ScriptedBackend(script=out_ids)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1,
                                                  "echo": True})
        no_echo = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    prompt_ids, params = backend.calls[0][1], backend.calls[0][2]
    assert params.prompt_logprobs == 1 and params.max_tokens == 3
    (choice,) = r.json()["choices"]
    assert choice["text"] == ECHOED + no_echo.json()["choices"][0]["text"]
    assert choice["logprobs"] == expected_completion_logprobs(tok, prompt_ids + out_ids[:3], 1, first_null=True)
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_echo_without_logprobs_returns_the_prompt_text(tok, out_ids) -> None:
    backend = ScriptedBackend(script=out_ids)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": True})
        no_echo = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert backend.calls[0][2].prompt_logprobs is None
    assert r.json()["choices"][0] == {"index": 0, "text": ECHOED + no_echo.json()["choices"][0]["text"],
                                      "logprobs": None, "finish_reason": "length"}


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(tok, out_ids, stream) -> None:
    backend = ScriptedBackend(script=out_ids)
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "logprobs": 1, "echo": True, "stream": stream}
    if stream:
        req["stream_options"] = {"include_usage": True}
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json=req)
    prompt_ids, params = backend.calls[0][1], backend.calls[0][2]
    assert params.max_tokens == 1 and params.prompt_logprobs == 1  # one token asked for, then dropped
    if stream:
        *chunks, usage_chunk = parse_sse(r)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == ECHOED
        tokens = [t for ch in chunks if ch["choices"][0]["logprobs"] for t in ch["choices"][0]["logprobs"]["tokens"]]
        assert tokens == [text_of(tok, t, at_start=i == 0) for i, t in enumerate(prompt_ids)]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        usage = usage_chunk["usage"]
    else:
        (choice,) = r.json()["choices"]
        assert choice["text"] == ECHOED and choice["finish_reason"] == "length"
        assert choice["logprobs"] == expected_completion_logprobs(tok, prompt_ids, 1, first_null=True)
        usage = r.json()["usage"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(prompt_ids)


async def test_lm_eval_style_request_token_id_prompt(tok, out_ids) -> None:
    """lm-evaluation-harness local-completions: token-id prompt (batched list of one), echo, max_tokens 1,
    logprobs 1; it sums token_logprobs[ctxlen:-1] and checks greediness against max(top_logprobs)."""
    context, continuation = tok.encode("Once upon a"), tok.encode(" time", add_special_tokens=False)
    backend = ScriptedBackend(script=out_ids)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [context + continuation], "max_tokens": 1,
                                                  "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    assert backend.calls[0][1] == context + continuation  # ids as sent: no BOS added
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(context) + len(continuation) + 1
    scored = lp["token_logprobs"][len(context):-1]
    assert scored == [fake_logprob(t, 1).logprob for t in continuation]
    assert all(tok_lp == max(top.values()) for tok_lp, top in zip(scored, lp["top_logprobs"][len(context):-1]))


async def test_prompt_logprobs_vllm_shape(tok, out_ids) -> None:
    backend = ScriptedBackend(script=out_ids)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                  "prompt_logprobs": 2})
        chat = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "prompt_logprobs": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    prompt_ids = backend.calls[0][1]
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt_ids)
    for t, entry in zip(prompt_ids[1:], got[1:]):
        lp = fake_logprob(t, 2)
        assert entry == {str(t): {"logprob": lp.logprob, "rank": 1, "decoded_token": text_of(tok, t)},
                         str(t + 1): {"logprob": lp.logprob - 1, "rank": 2, "decoded_token": text_of(tok, t + 1)}}
    chat_lp = chat.json()["prompt_logprobs"]  # vLLM: top-level in chat responses
    assert chat_lp[0] is None and len(chat_lp) == len(backend.calls[1][1])
    assert all(len(e) == 1 for e in chat_lp[1:])


async def test_chat_logprobs_object_streaming_and_not(tok, out_ids) -> None:
    backend = ScriptedBackend(script=out_ids)
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
           "top_logprobs": 2}
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/chat/completions", json=req)
        chunks = parse_sse(await c.post("/v1/chat/completions", json={**req, "stream": True}))
        plain = await c.post("/v1/chat/completions", json={**req, "logprobs": False, "top_logprobs": None})
    assert backend.calls[0][2].logprobs == 2 and backend.calls[2][2].logprobs is None
    (choice,) = r.json()["choices"]
    expected = []
    for t in out_ids[:4]:
        lp = fake_logprob(t, 2)
        text = text_of(tok, t)
        expected.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": [
            {"token": text_of(tok, a), "logprob": a_lp, "bytes": list(text_of(tok, a).encode())} for a, a_lp in lp.top]})
    assert choice["logprobs"] == {"content": expected, "refusal": None}
    streamed = [e for ch in chunks for c in ch["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == expected
    assert plain.json()["choices"][0]["logprobs"] is None


async def test_completion_streaming_logprobs_match_the_full_response(tok, out_ids) -> None:
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "logprobs": 1, "echo": True}
    async with make_client(tok, ScriptedBackend(script=out_ids)) as c:
        full = (await c.post("/v1/completions", json=req)).json()["choices"][0]
        chunks = parse_sse(await c.post("/v1/completions", json={**req, "stream": True}))
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in chunks:
        for key in merged:
            merged[key] += ch["choices"][0]["logprobs"][key] if ch["choices"][0]["logprobs"] else []
    assert merged == full["logprobs"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == full["text"]


async def test_minus_infinity_is_reported_as_the_floor(tok) -> None:
    from splitserve.frontend.logprob_format import clamp

    assert clamp(float("-inf")) == LOGPROB_FLOOR and clamp(float("nan")) == LOGPROB_FLOOR and clamp(-0.5) == -0.5


async def test_missing_backend_logprobs_is_a_server_error(tok, out_ids) -> None:
    class NoLogprobs(ScriptedBackend):
        async def generate(self, request_id, prompt_token_ids, params, deadline=None):
            async for event in super().generate(request_id, prompt_token_ids, params, deadline):
                event.logprobs = None
                yield event

    async with make_client(tok, NoLogprobs(script=out_ids)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def _merged_choice(r, stream: bool) -> dict:
    """The one choice's text and completions logprobs object, a stream's chunks merged."""
    if not stream:
        return r.json()["choices"][0]
    text, lp = "", {"tokens": [], "text_offset": []}
    for ch in parse_sse(r):
        (c,) = ch["choices"]
        text += c["text"]
        for key in lp:
            lp[key] += c["logprobs"][key] if c["logprobs"] else []
    return {"text": text, "logprobs": lp}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("prompt", [PROMPT, "ids"])
async def test_text_offset_points_at_each_token_in_the_text(tok, out_ids, stream, echo, prompt) -> None:
    """OpenAI's ``text_offset`` arithmetic: ``text[text_offset[i]:][:len(tokens[i])] == tokens[i]`` for every token,
    the echoed prompt's BOS included (the echo is the prompt's tokens' text, special tokens kept)."""
    prompt = tok.encode(PROMPT) if prompt == "ids" else prompt
    req = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 1, "echo": echo, "stream": stream}
    async with make_client(tok, ScriptedBackend(script=out_ids)) as c:
        choice = _merged_choice(await c.post("/v1/completions", json=req), stream)
    text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    n_prompt = len(tok.encode(PROMPT)) if echo else 0
    assert len(tokens) == n_prompt + 3
    for token, offset in zip(tokens, offsets, strict=True):
        assert text[offset:offset + len(token)] == token, (text, tokens, offsets)
    assert offsets[-1] + len(tokens[-1]) == len(text)
    if echo:
        assert tokens[0] == "<|start_story|>" and text.startswith("<|start_story|>")
        assert text == ECHOED + "".join(tokens[n_prompt:])
