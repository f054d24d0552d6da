"""Request fields -> SamplingParams (fake backend), the empty prompt on a BOS tokenizer, and vLLM's utility routes
/tokenize, /detokenize, /version, plus /v1/models' max_model_len."""

from __future__ import annotations

import pytest

import splitserve
from splitserve.frontend.chat import encode_chat
from splitserve.frontend.sampling_map import bad_words_token_ids
from splitserve.frontend.testing import ScriptedBackend
from tests.test_frontend_http import MODEL, make_client

ALL_FIELDS = {
    "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 2,
    "logit_bias": {"80": 5, "147": -100.0}, "bad_words": ["girl", "dog"], "allowed_token_ids": [80, 147, 2],
    "stop_token_ids": [13], "ignore_eos": True, "seed": 42, "top_k": 5, "temperature": 0.7, "top_p": 0.9,
}


async def test_every_sampling_field_reaches_the_backend(tok) -> None:
    backend = ScriptedBackend(script=[80, 147, 80])
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3, **ALL_FIELDS})
        chat = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, **ALL_FIELDS,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and chat.status_code == 200, (r.text, chat.text)
    for _, _, p in backend.calls:
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
        assert (p.min_p, p.min_tokens, p.seed, p.top_k, p.temperature, p.top_p) == (0.05, 2, 42, 5, 0.7, 0.9)
        assert p.logit_bias == ((80, 5.0), (147, -100.0))
        assert p.bad_words_token_ids == bad_words_token_ids(tok, ["girl", "dog"])
        assert p.allowed_token_ids == (80, 147, 2) and p.stop_token_ids == (13,) and p.ignore_eos
        assert p.n == 1 and p.logprobs is None and p.prompt_logprobs is None


async def test_defaults_switch_every_processor_off(tok) -> None:
    backend = ScriptedBackend(script=[80])
    async with make_client(tok, backend) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 1})
    p = backend.calls[0][2]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (0, 0, 1, 0, 0)
    assert p.logit_bias == () and p.bad_words_token_ids == () and p.allowed_token_ids is None
    assert not p.needs_history


def test_bad_words_ban_the_bare_word_and_the_word_after_a_space(tok) -> None:
    """vLLM's rule: each word as encoded without the tokenizer's "▁" prefix, and with a leading space."""
    assert bad_words_token_ids(tok, ["girl", " dog"]) == ((1132,), (80, 1132), (604,), (80, 604))
    assert [tok.hf.id_to_token(t) for t in tok.encode("girl", add_special_tokens=False)] == ["▁", "girl"]


async def test_token_strs_show_special_tokens_as_written(tok) -> None:
    """tokenizers reports an added token declared ``normalized`` by its normalized form (``id_to_token(1)`` is
    "▁<|start_story|>" here); token_strs show what the tokenizer file declares, the vocabulary's piece otherwise."""
    assert tok.hf.id_to_token(tok.bos_token_id) == "▁<|start_story|>"
    async with make_client(tok, ScriptedBackend()) as c:
        r = await c.post("/tokenize", json={"prompt": "Once upon a time <|end_story|>", "return_token_strs": True})
    ids, strs = r.json()["tokens"], r.json()["token_strs"]
    assert ids[0] == tok.bos_token_id and strs[0] == "<|start_story|>"
    assert ids[-1] == tok.eos_token_ids[0] and strs[-1] == "<|end_story|>"
    assert strs[1:-1] == [tok.hf.id_to_token(i) for i in ids[1:-1]] and "▁" in strs  # ordinary pieces keep "▁"


async def test_empty_prompt_generates_from_bos_alone(tok) -> None:
    backend = ScriptedBackend(script=[80, 147])
    async with make_client(tok, backend) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "", "max_tokens": 2})
        ids = await c.post("/v1/completions", json={"model": MODEL, "prompt": [], "max_tokens": 2})
    assert r.status_code == 200 and backend.calls[0][1] == [tok.bos_token_id]
    assert r.json()["usage"]["prompt_tokens"] == 1
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"  # no ids at all: still refused


async def test_tokenize_detokenize_version_and_models(tok) -> None:
    async with make_client(tok, ScriptedBackend(), max_model_len=300) as c:
        t = await c.post("/tokenize", json={"model": MODEL, "prompt": "Once upon a time"})
        raw = await c.post("/tokenize", json={"prompt": "Once upon a time", "add_special_tokens": False,
                                              "return_token_strs": True})
        messages = [{"role": "user", "content": "hi"}]
        chat = await c.post("/tokenize", json={"model": MODEL, "messages": messages})
        d = await c.post("/detokenize", json={"model": MODEL, "tokens": t.json()["tokens"]})
        v = await c.get("/version")
        models = await c.get("/v1/models")
        errors = [
            await c.post("/detokenize", json={"tokens": [99999]}),
            await c.post("/detokenize", json={"tokens": ["a"]}),
            await c.post("/tokenize", json={"prompt": 5}),
            await c.post("/tokenize", json={"prompt": "x", "extra": 1}),
        ]
        wrong_model = await c.post("/tokenize", json={"model": "gpt-4", "prompt": "x"})
    ids = tok.encode("Once upon a time")
    assert t.json() == {"count": len(ids), "max_model_len": 300, "tokens": ids, "token_strs": None}
    assert raw.json()["tokens"] == ids[1:] and raw.json()["token_strs"] == [tok.hf.id_to_token(i) for i in ids[1:]]
    assert chat.json()["tokens"] == encode_chat(tok, messages)  # what a chat request's prompt_tokens counts
    assert d.json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert d.json()["prompt"].startswith("<|start_story|>")
    assert v.json() == {"version": splitserve.__version__} and splitserve.__version__
    assert models.json()["data"][0]["max_model_len"] == 300
    assert [e.status_code for e in errors] == [400, 400, 400, 400]
    assert [e.json()["error"]["param"] for e in errors] == ["tokens", "tokens.0", "prompt", "extra"]
    assert wrong_model.status_code == 404


async def test_tokenize_needs_the_api_key_when_one_is_set(tok) -> None:
    import httpx

    from splitserve.frontend.http_app import build_app
    from splitserve.frontend.testing import SimpleModelInfo

    app = build_app(SimpleModelInfo(MODEL, tok), ScriptedBackend(), api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.post("/tokenize", json={"prompt": "x"})).status_code == 401
        ok = await c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


def test_a_sampling_request_carries_every_sampling_params_field(tok) -> None:
    """SamplingRequest holds SamplingParams' own fields (its field list is not repeated): every field but the two
    the preparer resolves (the budget and the tokenized bad words) reaches the params as given."""
    from dataclasses import fields

    from splitserve.engine.guided_spec import GuidedSpec
    from splitserve.engine.sampling import SamplingParams
    from splitserve.frontend.prepare import SAMPLING_OPTIONS, RequestPreparer, SamplingRequest

    want = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=5, stop_token_ids=(13,), ignore_eos=True,
        presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, min_p=0.05, min_tokens=2,
        logit_bias=((80, 1.0),), bad_words_token_ids=((1132,), (80, 1132)), allowed_token_ids=(80, 1132), logprobs=2,
        prompt_logprobs=1, n=2, guided=GuidedSpec("regex", "a+"))
    defaults = SamplingParams()
    assert all(getattr(want, f.name) != getattr(defaults, f.name) for f in fields(SamplingParams))  # none left out
    sampling = SamplingRequest({name: getattr(want, name) for name in SAMPLING_OPTIONS}, max_tokens=7, bad_words=("girl",))
    assert RequestPreparer(tok, 512).sampling_params(3, sampling) == want
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingRequest({"max_tokens": 7})
