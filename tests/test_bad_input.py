"""Odd and bad input through the real cluster (router + prefill + decode processes), over HTTP and gRPC:
every case gets a correct answer or a clear 4xx / INVALID_ARGUMENT, never a 5xx, and the next normal
request succeeds. The workers' KV pools are back to baseline afterwards."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, router_pb2, router_pb2_grpc

from splitserve.model import load_model
from splitserve.paths import default_model_path
from tests.idle import wait_idle

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "TinyStories-656K"
BLOCK = 16
GOOD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def tok():
    return load_model(default_model_path(), weights=False).tokenizer


@pytest.fixture(scope="module")
def max_len():
    return load_model(default_model_path(), weights=False).max_model_len


async def assert_good_http(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def assert_4xx(r: httpx.Response, status: int = 400, fragment: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if fragment:
        assert fragment in err["message"], err["message"]
    return err


def http_cases(max_len: int):
    long_text = "Once upon a time " * max_len
    return [
        # (id, path, body or raw bytes, status, message fragment)
        ("empty-list", "/v1/completions", {**GOOD, "prompt": []}, 400, "must not be empty"),
        ("ids-outside-vocab", "/v1/completions", {**GOOD, "prompt": [1, 2048]}, 400, "out of range"),
        ("negative-id", "/v1/completions", {**GOOD, "prompt": [1, -5]}, 400, "out of range"),
        ("text-longer-than-context", "/v1/completions", {**GOOD, "prompt": long_text}, 400, "maximum context length"),
        ("ids-longer-than-context", "/v1/completions", {**GOOD, "prompt": [1] * (max_len + 1)}, 400, "maximum context length"),
        ("chat-longer-than-context", "/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": long_text}]}, 400, "maximum context length"),
        ("max-tokens-0", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "only allowed with echo"),
        ("max-tokens-negative", "/v1/completions", {**GOOD, "max_tokens": -3}, 400, "greater than or equal to 0"),
        ("max-tokens-past-context", "/v1/completions", {**GOOD, "max_tokens": max_len}, 400, "maximum context length"),
        ("n-0", "/v1/completions", {**GOOD, "n": 0}, 400, "greater than or equal to 1"),
        ("chat-n-129", "/v1/chat/completions", {**CHAT, "n": 129}, 400, "less than or equal to 128"),
        ("temperature-negative", "/v1/completions", {**GOOD, "temperature": -0.5}, 400, "greater than or equal to 0"),
        ("temperature-nan", "/v1/completions", b'{"prompt": "Once", "temperature": NaN}', 400, "NaN is not a valid JSON number"),
        ("top-p-0", "/v1/completions", {**GOOD, "top_p": 0}, 400, "greater than 0"),
        ("top-p-above-1", "/v1/completions", {**GOOD, "top_p": 1.5}, 400, "less than or equal to 1"),
        ("top-p-negative", "/v1/completions", {**GOOD, "top_p": -1}, 400, "greater than 0"),
        ("unknown-model", "/v1/completions", {**GOOD, "model": "gpt-17"}, 404, "does not exist"),
        ("malformed-json", "/v1/completions", b'{"prompt": "Once", ', 400, "could not parse"),
        ("not-an-object", "/v1/completions", b'["Once"]', 400, "JSON object"),
        ("not-utf8", "/v1/completions", b'\xff\xfe\x00', 400, "could not parse"),
        ("prompt-wrong-type", "/v1/completions", {**GOOD, "prompt": 7}, 400, "string or a list of token ids"),
        ("max-tokens-wrong-type", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
        ("temperature-wrong-type", "/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
        ("stream-wrong-type", "/v1/completions", {**GOOD, "stream": "sometimes"}, 400, "stream"),
        ("messages-wrong-type", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
        ("stop-wrong-type", "/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
        # odd text: unpaired surrogates in every text field, odd JSON, loose types (strings are not numbers)
        ("surrogate-prompt", "/v1/completions", b'{"prompt": "Once \\ud800 upon", "max_tokens": 4}', 400, "unpaired UTF-16 surrogate"),
        ("surrogate-prompt-list", "/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 4}', 400, "unpaired"),
        ("surrogate-chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, "unpaired"),
        ("surrogate-chat-part", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', 400, "unpaired"),
        ("surrogate-stop", "/v1/completions", b'{"prompt": "Once", "max_tokens": 4, "stop": ["\\ud800"]}', 400, "unpaired"),
        ("surrogate-model", "/v1/completions", b'{"prompt": "Once", "model": "\\ud800"}', 400, "unpaired"),
        ("infinity", "/v1/completions", b'{"prompt": "Once", "top_p": Infinity}', 400, "Infinity is not a valid JSON number"),
        ("number-1e400", "/v1/completions", b'{"prompt": "Once", "temperature": 1e400}', 400, "out of range"),
        ("duplicate-keys", "/v1/completions", b'{"prompt": "Once", "max_tokens": 4, "max_tokens": 400}', 400, "more than once"),
        ("nested-deep", "/v1/completions", b'{"prompt": "Once", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "levels deep"),
        ("invalid-utf8-in-prompt", "/v1/completions", b'{"prompt": "Once \xed\xa0\x80", "max_tokens": 4}', 400, "not valid UTF-8"),
        ("max-tokens-string", "/v1/completions", {**GOOD, "max_tokens": "8"}, 400,
         "Invalid type for 'max_tokens': expected an integer, but got a string instead."),
        ("max-tokens-bool", "/v1/completions", {**GOOD, "max_tokens": True}, 400, "expected an integer, but got a boolean"),
        ("max-tokens-fraction", "/v1/completions", {**GOOD, "max_tokens": 4.5}, 400, "expected an integer, but got a decimal"),
        ("temperature-string", "/v1/completions", {**GOOD, "temperature": "0"}, 400, "expected a number, but got a string"),
        ("stream-int", "/v1/completions", {**GOOD, "stream": 1}, 400, "expected a boolean, but got an integer"),
        ("prompt-6mb", "/v1/completions", {**GOOD, "prompt": "Once upon a time " * 370_000}, 400, "maximum context length"),
        ("chat-6mb", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 6_000_000}]}, 400,
         "maximum context length"),
    ]


N_HTTP_CASES = 44


@pytest.mark.parametrize("case", range(N_HTTP_CASES))
async def test_bad_http_request_is_a_clear_4xx_then_a_good_one_succeeds(cluster, max_len, case):
    cases = http_cases(max_len)
    name, path, body, status, fragment = cases[case]
    base_url, _, _ = cluster
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        if isinstance(body, bytes):
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await http.post(path, json=body)
        if status == 404:
            assert r.status_code == 404 and fragment in r.json()["error"]["message"], name
        else:
            assert_4xx(r, status, fragment)
        await assert_good_http(http)


def test_http_cases_are_all_run(max_len):
    assert len(http_cases(max_len)) == N_HTTP_CASES


@pytest.mark.parametrize(("name", "prompt_len"), [("shorter-than-a-block", BLOCK // 3), ("exactly-one-block", BLOCK)])
async def test_prompts_of_one_block_and_less_equal_colocated(cluster, colocated, tok, name, prompt_len):
    base_url, _, _ = cluster
    ids = tok.encode("Once upon a time, there was a little girl named Lily who loved to play outside in the sun with her big red ball")[:prompt_len]
    assert len(ids) == prompt_len
    body = {**GOOD, "prompt": ids, "max_tokens": 12, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as http:
        got = (await http.post(base_url + "/v1/completions", json=body)).json()
        ref = (await http.post(colocated.base_url + "/v1/completions", json=body)).json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"] and got["usage"]["completion_tokens"] == 12


async def test_valid_edge_values_are_served(cluster, max_len):
    base_url, _, _ = cluster
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        one = (await http.post("/v1/completions", json={**GOOD, "max_tokens": 1})).json()
        assert one["usage"]["completion_tokens"] == 1 and one["choices"][0]["finish_reason"] == "length"
        ids = (await http.post("/v1/completions", json={**GOOD, "prompt": [1, 2, 3, 2047]})).json()
        assert ids["usage"]["prompt_tokens"] == 4
        fill = (await http.post("/v1/completions", json={**GOOD, "prompt": [1] * (max_len - 3), "max_tokens": 3,
                                                          "ignore_eos": True})).json()
        assert fill["usage"]["completion_tokens"] == 3  # exactly the whole context
        empty_chat = await http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": ""}]})
        assert empty_chat.status_code == 200 and empty_chat.json()["usage"]["prompt_tokens"] > 0
        n1 = await http.post("/v1/completions", json={**GOOD, "n": 1})
        assert n1.status_code == 200 and len(n1.json()["choices"]) == 1
        from_bos = await http.post("/v1/completions", json={**GOOD, "prompt": ""})  # generates from BOS alone
        assert from_bos.status_code == 200 and from_bos.json()["usage"]["prompt_tokens"] == 1
        await assert_good_http(http)


# ------------------------------------------------------------------------------------------- gRPC


def _raw_generate(prompt: str, sampling: bytes) -> bytes:
    """A GenerateRequest serialized by hand (to send what the Python protobuf API cannot build)."""
    p = prompt.encode("utf-8", "surrogatepass")
    return b"\x0a" + bytes([len(p)]) + p + b"\x1a" + bytes([len(sampling)]) + sampling


def grpc_cases(max_len: int):
    S = common_pb2.SamplingParams
    ids = router_pb2.TokenIds
    return [
        ("no-prompt", router_pb2.GenerateRequest(sampling=S(max_tokens=4))),
        ("empty-list", router_pb2.GenerateRequest(prompt_token_ids=ids(ids=[]), sampling=S(max_tokens=4))),
        ("ids-outside-vocab", router_pb2.GenerateRequest(prompt_token_ids=ids(ids=[1, 2048]), sampling=S(max_tokens=4))),
        ("longer-than-context", router_pb2.GenerateRequest(prompt_token_ids=ids(ids=[1] * (max_len + 1)), sampling=S(max_tokens=4))),
        ("max-tokens-0", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=0))),
        # -1 as a 10-byte varint in the uint32 max_tokens field
        ("max-tokens-negative", _raw_generate("Once", b"\x08" + b"\xff" * 9 + b"\x01")),
        ("max-tokens-past-context", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=max_len))),
        ("temperature-negative", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, temperature=-0.5))),
        ("temperature-nan", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, temperature=float("nan")))),
        ("top-p-0", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, top_p=0.0))),
        ("top-p-above-1", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, top_p=1.5))),
        ("top-k-below-minus-1", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, top_k=-2))),
        ("stop-token-outside-vocab", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, stop_token_ids=[99999]))),
        ("empty-stop-string", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4), stop=[""])),
        ("five-stop-strings", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4), stop=list("abcde"))),
        ("malformed-bytes", b"\x0a\xff\xff\xff\xff\x0f"),
        ("wrong-wire-type", b"\x0d\x01\x02\x03\x04"),  # field 1 (prompt, a string) sent as fixed32
        # a surrogate as UTF-8 bytes (what "\ud800" would be): not UTF-8, in the prompt and in a stop string
        ("surrogate-bytes-prompt", _raw_generate("Once \ud800", b"\x08\x04")),
        ("surrogate-bytes-stop", router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4)).SerializeToString()
         + b"\x22\x03\xed\xa0\x80"),
        ("invalid-utf8-prompt", b"\x0a\x03a\xff\xfe\x1a\x02\x08\x04"),
        ("prompt-6mb", router_pb2.GenerateRequest(prompt="Once upon a time " * 370_000, sampling=S(max_tokens=4))),
    ]


async def _good_grpc(stub) -> None:
    ids = []
    async for r in stub.Generate(router_pb2.GenerateRequest(prompt="Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=3))):
        ids += r.token_ids
    assert len(ids) == 3


N_GRPC_CASES = 21


@pytest.mark.parametrize("case", range(N_GRPC_CASES))
async def test_bad_grpc_request_is_invalid_argument_then_a_good_one_succeeds(cluster, max_len, case):
    cases = grpc_cases(max_len)
    name, request = cases[case]
    _, router_grpc, _ = cluster
    async with grpc.aio.insecure_channel(router_grpc) as ch:
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        call = ch.unary_stream("/pd.v1.RouterService/Generate")(raw)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
        await _good_grpc(router_pb2_grpc.RouterServiceStub(ch))


def test_grpc_cases_are_all_run(max_len):
    assert len(grpc_cases(max_len)) == N_GRPC_CASES


async def test_grpc_max_tokens_unset_means_the_default_and_one_is_served(cluster):
    _, router_grpc, _ = cluster
    async with grpc.aio.insecure_channel(router_grpc) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        n = 0
        async for r in stub.Generate(router_pb2.GenerateRequest(prompt="Once upon a time", sampling=common_pb2.SamplingParams(ignore_eos=True))):
            n += len(r.token_ids)
        assert n == 16
        msgs = [r async for r in stub.Generate(router_pb2.GenerateRequest(prompt="Once upon a time",
                                                                          sampling=common_pb2.SamplingParams(max_tokens=1)))]
        assert sum(len(m.token_ids) for m in msgs) == 1 and msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_odd_but_valid_text_is_served(cluster):
    """NUL characters, escaped surrogate pairs (emoji), a UTF-8 BOM, a non-UTF-8 charset header on a UTF-8 body,
    an integral 4.0 for max_tokens and a long stop string are fine, over HTTP and gRPC."""
    base_url, router_grpc, _ = cluster
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        bodies = [
            (b'{"prompt": "Once\\u0000 upon a time", "max_tokens": 4, "temperature": 0}', "application/json"),
            (b'{"prompt": "Once upon a time \\ud83d\\ude00", "max_tokens": 4, "temperature": 0}', "application/json"),
            (b'{"prompt": "Once", "max_tokens": 4, "stop": ["\\u0000", "' + b"z" * 100_000 + b'"]}', "application/json"),
            (b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), "application/json"),
            (json.dumps(GOOD).encode(), "application/json; charset=iso-8859-1"),
            (json.dumps({**GOOD, "max_tokens": 4.0}).encode(), "application/json"),
            (json.dumps({**CHAT, "messages": [{"role": "user", "content": "\x00\U0001f600 é"}]}, ensure_ascii=False).encode(),
             "application/json"),
        ]
        for i, (body, content_type) in enumerate(bodies):
            path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
            r = await http.post(path, content=body, headers={"content-type": content_type})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, (i, r.text)
        await assert_good_http(http)
    async with grpc.aio.insecure_channel(router_grpc) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        msgs = [m async for m in stub.Generate(router_pb2.GenerateRequest(
            prompt="Once\x00 upon a time \U0001f600", sampling=common_pb2.SamplingParams(max_tokens=3), stop=["\x00"]))]
        assert sum(len(m.token_ids) for m in msgs) >= 1 and msgs[-1].usage.prompt_tokens > 0


async def test_a_huge_prompt_that_fits_is_tokenized_and_served(cluster):
    """500k characters the vocabulary does not know fuse into one <unk> token: the pre-check must not refuse
    them (it counts only known characters for this tokenizer), and /health answers meanwhile. (That the
    tokenization runs off the event loop is asserted with events in test_frontend_offload.py.)"""
    base_url, _, _ = cluster
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        big = asyncio.create_task(http.post("/v1/completions", json={**GOOD, "prompt": "é" * 500_000}))
        health = await http.get("/health")
        assert health.status_code == 200
        r = await big
        assert r.status_code == 200, r.text  # 6M unknown characters fuse into one <unk> token: it fits
        await assert_good_http(http)


# ------------------------------------------------------------------------------------------- stop strings


async def test_stop_string_straddling_token_boundaries(cluster):
    """A stop string made of the end of one token and the start of the next: no partial stop text is ever
    streamed, and streamed and non-streamed text are the same (HTTP and gRPC)."""
    base_url, router_grpc, _ = cluster
    prompt = "Once upon a time, there was a little girl named Lily."
    async with grpc.aio.insecure_channel(router_grpc) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        deltas = [r.text async for r in stub.Generate(router_pb2.GenerateRequest(
            prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))]
        full = "".join(deltas)
        pos = 0
        stop = None
        for a, b in zip(deltas, deltas[1:]):
            pos += len(a)
            if len(a) >= 2 and len(b) >= 2:
                candidate = a[-2:] + b[:2]
                if full.find(candidate) == pos - 2:  # first occurrence straddles this boundary
                    stop = candidate
                    break
        assert stop is not None, deltas
        expected = full[: full.find(stop)]
        streamed = [r.text async for r in stub.Generate(router_pb2.GenerateRequest(
            prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), stop=[stop]))]
    assert "".join(streamed) == expected
    body = {**GOOD, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "stop": [stop]}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        plain = (await http.post("/v1/completions", json=body)).json()
        sse = await http.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert plain["choices"][0]["text"] == expected == "".join(texts)
    assert plain["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    running = ""
    for t in texts:  # no prefix of the output ever ends with a partial stop string that is later retracted
        running += t
        assert expected.startswith(running)


# ------------------------------------------------------------------------------------------- no leaks


async def test_workers_back_to_baseline(cluster):
    _, _, c = cluster
    workers = list(zip(c.children[:2], (prefill_pb2_grpc.PrefillServiceStub, decode_pb2_grpc.DecodeServiceStub)))

    async def read_stats():
        stats = {}
        for child, stub_cls in workers:
            async with grpc.aio.insecure_channel(child.health.removeprefix("grpc:")) as ch:
                stats[child.name] = dict((await stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=10)).counters)
        return stats, None

    await wait_idle(read_stats, timeout_s=5.0)
