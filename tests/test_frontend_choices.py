"""n > 1 choices and best_of with the fake backend: the pipeline's demux (per-choice stop strings and finish
reasons), streamed chunks naming their index, usage over all choices, best_of's selection by cumulative logprob."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.sampling import SamplingParams
from splitserve.frontend.backend import TokenEvent
from splitserve.frontend.logprob_format import cumulative_logprob
from splitserve.frontend.pipeline import BackendProtocolError, TextDelta, generate_text
from splitserve.frontend.testing import ScriptedBackend, SimpleTokenizer, fake_logprob
from tests.test_frontend_http import MODEL, make_client, parse_sse


@pytest.fixture
def scripts(tok: SimpleTokenizer) -> list[list[int]]:
    """Three choices; only choice 1 contains the stop string "little"."""
    return [tok.encode(" the sun was warm and bright", add_special_tokens=False),
            tok.encode(" there was a little girl named Lily", add_special_tokens=False),
            tok.encode(" a big dog ran in the park", add_special_tokens=False)]


async def collect(agen) -> list[TextDelta]:
    return [d async for d in agen]


async def test_pipeline_demuxes_choices_and_a_stop_string_ends_only_its_choice(tok, scripts) -> None:
    backend = ScriptedBackend(choices=scripts)
    deltas = await collect(generate_text(backend, tok, "r", [1], SamplingParams(max_tokens=100, n=3), ["little"]))
    by_choice = {i: [d for d in deltas if d.index == i] for i in range(3)}
    texts = {i: "".join(d.text for d in ds) for i, ds in by_choice.items()}
    assert texts[1] == " there was a " and by_choice[1][-1].finish_reason == "stop"
    assert texts[0] == " the sun was warm and bright" and texts[2] == " a big dog ran in the park"
    for ds in by_choice.values():  # exactly one finish per choice, on its last delta
        assert [d.finish_reason is not None for d in ds].count(True) == 1 and ds[-1].finish_reason is not None
    stop_at = deltas.index(by_choice[1][-1])
    assert all(d.index != 1 for d in deltas[stop_at + 1:])  # choice 1's later tokens are ignored
    assert sum(len(d.token_ids) for d in by_choice[1]) < len(scripts[1])
    assert deltas[-1].finish_reason is not None and "r" in backend.finished


async def test_pipeline_aborts_choices_the_backend_left_unfinished(tok) -> None:
    class Truncated:
        async def ready(self) -> bool:
            return True

        async def generate(self, request_id, prompt_token_ids, params, deadline=None):
            yield TokenEvent([80], None, index=0)
            yield TokenEvent([147], "stop", index=1)

    deltas = await collect(generate_text(Truncated(), tok, "t", [1], SamplingParams(max_tokens=9, n=2)))
    assert [(d.index, d.finish_reason) for d in deltas] == [(0, None), (1, "stop"), (0, "abort")]


async def test_pipeline_refuses_a_choice_index_out_of_range(tok) -> None:
    class Wrong:
        async def generate(self, request_id, prompt_token_ids, params, deadline=None):
            yield TokenEvent([80], None, index=2)

    with pytest.raises(BackendProtocolError, match="choice 2"):
        await collect(generate_text(Wrong(), tok, "w", [1], SamplingParams(max_tokens=9, n=2)))


async def test_pipeline_carries_prompt_logprobs_on_the_first_delta_and_logprobs_per_token(tok, scripts) -> None:
    backend = ScriptedBackend(choices=scripts, tokens_per_event=3)
    params = SamplingParams(max_tokens=5, n=2, logprobs=1, prompt_logprobs=0)
    deltas = await collect(generate_text(backend, tok, "p", [1, 80, 147], params))
    assert deltas[0].prompt_logprobs == [None, fake_logprob(80, 0), fake_logprob(147, 0)]
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for d in deltas:
        assert d.logprobs == [fake_logprob(t, 1) for t in d.token_ids]


async def test_n_choices_non_streaming_with_stop_and_usage(tok, scripts) -> None:
    backend = ScriptedBackend(choices=scripts)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 50, "n": 3,
                                                  "stop": "little", "seed": 7})
        chat = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 50, "n": 3, "stop": "little",
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert backend.calls[0][2].n == 3 and backend.calls[0][2].seed == 7
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    stopped = body["choices"][1]
    assert stopped["text"].endswith("there was a ") and "lit" not in stopped["text"]
    assert stopped["finish_reason"] == "stop" and stopped["logprobs"] is None
    assert body["choices"][0]["text"].strip() == "the sun was warm and bright" and body["choices"][0]["finish_reason"] == "stop"
    choice1_tokens = next(i for i in range(1, len(scripts[1]) + 1) if "little" in tok.decode(scripts[1][:i]))
    assert body["usage"]["completion_tokens"] == len(scripts[0]) + len(scripts[2]) + choice1_tokens
    chat_body = chat.json()
    assert [ch["message"]["content"].strip() for ch in chat_body["choices"]] == [
        ch["text"].strip() for ch in body["choices"]]
    assert chat_body["usage"] == body["usage"] | {"prompt_tokens": chat_body["usage"]["prompt_tokens"],
                                                  "total_tokens": chat_body["usage"]["total_tokens"]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_choices_streaming_chunks_carry_their_index(tok, scripts, path) -> None:
    chat = path.endswith("chat/completions")
    req = {"model": MODEL, "max_tokens": 50, "n": 3, "stop": "little", "stream": True,
           "stream_options": {"include_usage": True}}
    req |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Once"}
    async with make_client(tok, ScriptedBackend(choices=scripts)) as c:
        *chunks, usage = parse_sse(await c.post(path, json=req))
        full = (await c.post(path, json={**req, "stream": False, "stream_options": None})).json()
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert all(len(ch["choices"]) == 1 for ch in chunks)
    for i in range(3):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == i]
        if chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["delta"].get("content", "") for c in mine)
            assert text == full["choices"][i]["message"]["content"]
        else:
            text = "".join(c["text"] for c in mine)
            assert text == full["choices"][i]["text"]
        finishes = [c["finish_reason"] for c in mine if c["finish_reason"] is not None]
        assert finishes == [full["choices"][i]["finish_reason"]] and mine[-1]["finish_reason"] is not None
    indices = [ch["choices"][0]["index"] for ch in chunks]
    assert indices != sorted(indices)  # really interleaved


async def test_best_of_returns_the_choices_with_the_highest_cumulative_logprob(tok, scripts) -> None:
    backend = ScriptedBackend(choices=scripts)
    async with make_client(tok, backend) as c:
        one = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 50, "best_of": 3})
        two = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 50, "best_of": 3,
                                                    "n": 2, "logprobs": 0})
    params = backend.calls[0][2]
    assert params.n == 3 and params.logprobs == 0  # logprobs asked for to rank the choices
    score = {i: cumulative_logprob([fake_logprob(t, 0) for t in s]) for i, s in enumerate(scripts)}
    ranked = sorted(score, key=score.get, reverse=True)
    assert len(set(score.values())) == 3
    texts = {i: tok.decode(s) for i, s in enumerate(scripts)}
    body = one.json()
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None  # not asked for: not shown
    assert choice["text"].strip() == texts[ranked[0]].strip()
    assert body["usage"]["completion_tokens"] == sum(len(s) for s in scripts)  # every generated choice counts
    got = two.json()["choices"]
    assert [c["index"] for c in got] == [0, 1]
    assert [c["text"].strip() for c in got] == [texts[i].strip() for i in ranked[:2]]
    assert sum(got[0]["logprobs"]["token_logprobs"]) == pytest.approx(score[ranked[0]])


async def test_best_of_equal_to_n_needs_no_logprobs(tok, scripts) -> None:
    backend = ScriptedBackend(choices=scripts)
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 5, "best_of": 2,
                                                  "n": 2})
    assert r.status_code == 200 and backend.calls[0][2].logprobs is None and len(r.json()["choices"]) == 2


async def test_client_disconnect_mid_stream_aborts_an_n_request(tok, scripts) -> None:
    backend = ScriptedBackend(choices=scripts, delay=0.01)
    events = generate_text(backend, tok, "x", [1], SamplingParams(max_tokens=50, n=3))
    first = await events.__anext__()
    assert first.index == 0
    await events.aclose()
    await asyncio.sleep(0)
    assert "x" in backend.aborted
