"""Disaggregated (real processes, gRPC control, UCX data) vs colocated: identical tokens."""

import asyncio
import json

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve.client import RouterClient
from splitserve.model import load_model
from splitserve.paths import default_model_path

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 16
MODEL = "TinyStories-656K"


@pytest.fixture(scope="module")
def story_ids():
    tok = load_model(default_model_path()).tokenizer
    text = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
            "One day, she saw a big red ball in the park. She ran to get it, but a dog took it first. "
            "Lily was sad. Her mom came and gave her a hug. They went home and baked a cake together. "
            "The cake was sweet and yummy. Lily smiled and said thank you to her mom.")
    ids = tok.encode(text)
    assert len(ids) >= 3 * BLOCK + 5
    return ids


async def grpc_tokens(address, prompt_ids, max_tokens, **kw):
    ids, text, usage = [], "", None
    async with RouterClient(address) as client:
        async for r in client.generate(prompt_ids, max_tokens=max_tokens, temperature=0.0, **kw):
            ids += list(r.token_ids)
            text += r.text
            if r.HasField("usage"):
                usage = r.usage
    return ids, text, usage


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
async def test_disaggregated_equals_colocated(cluster, colocated, story_ids, length):
    _, router_grpc, _ = cluster
    prompt = story_ids[:length]
    for max_tokens in (1, 2, 32):
        got = await grpc_tokens(router_grpc, prompt, max_tokens, ignore_eos=True)
        ref = await grpc_tokens(colocated.grpc_address, prompt, max_tokens, ignore_eos=True)
        assert got[0] == ref[0], (length, max_tokens)
        assert len(got[0]) == max_tokens
        assert got[1] == ref[1]
        assert got[2].prompt_tokens == length and got[2].completion_tokens == max_tokens


def _sse_text(body: str) -> str:
    out = []
    lines = [l for l in body.splitlines() if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: "):])
        out += [c["text"] for c in chunk["choices"]]
    return "".join(out)


async def test_streaming_and_non_streaming_return_the_same_text(cluster):
    base_url, _, _ = cluster
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        full = (await http.post("/v1/completions", json=body)).json()
        streamed = await http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert _sse_text(streamed.text) == full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 40 or full["choices"][0]["finish_reason"] == "stop"


async def test_sixteen_concurrent_streams(cluster, colocated, story_ids):
    base_url, _, _ = cluster
    prompts = [story_ids[: 5 + 3 * i] for i in range(16)]

    async def stream(url, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200
            return _sse_text(r.text)

    got = await asyncio.gather(*(stream(base_url, p) for p in prompts))
    ref = [await stream(colocated.base_url, p) for p in prompts]
    assert got == ref
    assert len(set(got)) > 1


async def _stats(address, stub_cls):
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await stub_cls(ch).GetStats(common_pb2.GetStatsRequest(), timeout=10)
    return dict(resp.counters)


async def test_kv_bytes_cross_ucx_not_grpc(cluster, story_ids):
    _, router_grpc, c = cluster
    prefill_addr = c.children[0].health.removeprefix("grpc:")
    decode_addr = c.children[1].health.removeprefix("grpc:")
    p0 = await _stats(prefill_addr, prefill_pb2_grpc.PrefillServiceStub)
    d0 = await _stats(decode_addr, decode_pb2_grpc.DecodeServiceStub)
    prompt = (story_ids * 6)[:200]
    await grpc_tokens(router_grpc, prompt, 4, ignore_eos=True)
    p1 = await _stats(prefill_addr, prefill_pb2_grpc.PrefillServiceStub)
    d1 = await _stats(decode_addr, decode_pb2_grpc.DecodeServiceStub)
    lm = load_model(default_model_path()).config
    block_nbytes = lm.num_layers * 2 * BLOCK * lm.num_kv_heads * lm.head_dim * 4
    reused = d1["kv_prefix_reused_blocks"] - d0["kv_prefix_reused_blocks"]  # held by decode's prefix cache: not pulled
    rows = d1["kv_prefix_reused_partial_tokens"] - d0["kv_prefix_reused_partial_tokens"]  # a partly held block's rows
    kv_bytes = (200 - reused * BLOCK - rows) * block_nbytes // BLOCK  # a partial last block moves only its used rows
    assert p1["ucx_bytes_sent"] - p0["ucx_bytes_sent"] == kv_bytes
    assert d1["ucx_bytes_received"] - d0["ucx_bytes_received"] == kv_bytes
    grpc_bytes = (p1["grpc_bytes_sent"] - p0["grpc_bytes_sent"]) + (d1["grpc_bytes_received"] - d0["grpc_bytes_received"])
    assert 0 < grpc_bytes < kv_bytes / 20  # control messages only: ids, block ids, layout
    assert p1["kv_transfers_held"] == 0  # blocks freed once pulled


async def test_layout_mismatch_is_failed_precondition(cluster, story_ids):
    _, _, c = cluster
    prefill_addr = c.children[0].health.removeprefix("grpc:")
    decode_addr = c.children[1].health.removeprefix("grpc:")
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0)
    async with grpc.aio.insecure_channel(prefill_addr) as pch, grpc.aio.insecure_channel(decode_addr) as dch:
        resp = await prefill_pb2_grpc.PrefillServiceStub(pch).Prefill(
            prefill_pb2.PrefillRequest(request_id="mismatch", prompt_token_ids=story_ids[:20], sampling=sampling))
        handle = resp.kv_handle
        handle.layout.block_size = 8
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in decode_pb2_grpc.DecodeServiceStub(dch).Decode(decode_pb2.DecodeRequest(
                    request_id="mismatch", prompt_token_ids=story_ids[:20], sampling=sampling,
                    kv_handle=handle, first_token_id=resp.first_token_id)):
                pass
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size=16" in err.value.details() and "block_size=8" in err.value.details()
        released = await prefill_pb2_grpc.PrefillServiceStub(pch).ReleaseKV(
            prefill_pb2.ReleaseKVRequest(transfer_id=handle.transfer_id))
        assert released.released


async def test_router_grpc_rejects_bad_input(cluster):
    _, router_grpc, _ = cluster
    async with RouterClient(router_grpc) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # ("" is BOS alone on this model: a valid prompt)
            async for _ in client.generate([], max_tokens=4):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate("hi", max_tokens=100000):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ids, _, _ = [], None, None
        async for r in client.generate("Once upon a time", max_tokens=3, temperature=0):
            ids += r.token_ids
        assert len(ids) == 3  # still serving
