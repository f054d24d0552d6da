"""Outputs whose multi-byte characters are split across tokens (byte-fallback tokens of the GGUF model's
tokenizer): HTTP (streamed and not) and the router's gRPC API never emit a partial character or U+FFFD,
and streamed text equals non-streamed text."""

from __future__ import annotations

import json

import httpx
import pytest
from pd.v1 import common_pb2, router_pb2, router_pb2_grpc

from splitserve.frontend.grpc_api import RouterServicer
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo
from splitserve.model import load_model
from splitserve.paths import MODELS_DIR
from splitserve.rpc.server import bind, channel, create_server

TEXT = "Lily saw 日本 café 😀! Ünïcödé ✓"
EXPECTED = " " + TEXT  # after the prompt, the first token's word-start marker is a space


@pytest.fixture(scope="module")
def tok():
    return load_model(MODELS_DIR / "stories260K.gguf", weights=False).tokenizer


@pytest.fixture(scope="module")
def script(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert sum(tok.hf.id_to_token(i).startswith("<0x") for i in ids) >= 10  # characters really are split
    assert tok.decode(ids) == TEXT
    return ids


async def test_http_streamed_equals_non_streamed_without_partial_characters(tok, script):
    app = build_app(SimpleModelInfo("m", tok, 512), ScriptedBackend(script=script, eos_token_ids=tok.eos_token_ids))
    body = {"prompt": "Once", "max_tokens": len(script), "ignore_eos": True}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        full = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        sse = await http.post("/v1/completions", json={**body, "stream": True})
        chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": len(script), "stream": True, "ignore_eos": True})
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in sse.text.splitlines() if line.startswith("data: {")]
    assert full == "".join(pieces) == EXPECTED
    assert all("\ufffd" not in p for p in pieces) and len([p for p in pieces if p]) > 5
    chat_pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in chat.text.splitlines() if line.startswith("data: {")]
    assert "".join(chat_pieces) == EXPECTED and all("\ufffd" not in p for p in chat_pieces)


async def test_grpc_deltas_never_split_a_character(tok, script):
    server, _ = create_server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(
        RouterServicer(ScriptedBackend(script=script, eos_token_ids=tok.eos_token_ids), tok, 512), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    try:
        async with channel(address) as ch:
            msgs = [m async for m in router_pb2_grpc.RouterServiceStub(ch).Generate(router_pb2.GenerateRequest(
                prompt="Once", sampling=common_pb2.SamplingParams(max_tokens=len(script), ignore_eos=True)))]
    finally:
        await server.stop(0)
    assert "".join(m.text for m in msgs) == EXPECTED and all("\ufffd" not in m.text for m in msgs)
    assert [t for m in msgs for t in m.token_ids] == script  # every token is reported, even while its text is held
    held = [m for m in msgs if m.token_ids and not m.text]
    assert held  # bytes of an unfinished character were held back, not emitted
    assert msgs[-1].usage.completion_tokens == len(script)
