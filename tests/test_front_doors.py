"""The HTTP and gRPC front doors share one request preparation (splitserve/frontend/prepare.py): the same request
is prepared to the same prompt ids and SamplingParams, and refused with the same message (400 / INVALID_ARGUMENT).
The colocated server and the front doors load nothing of the router service."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import pytest
from pd.v1 import common_pb2, router_pb2, router_pb2_grpc

from splitserve.frontend.grpc_api import RouterServicer
from splitserve.frontend.http_app import build_app
from splitserve.frontend.testing import ScriptedBackend, SimpleModelInfo, SimpleTokenizer
from splitserve.rpc.server import bind, channel, create_server

TOKENIZER_JSON = "/work/shared/models/TinyStories-656K/tokenizer.json"
MODEL = "tinystories"
MAX_MODEL_LEN = 64
S = common_pb2.SamplingParams

# (name, /v1/completions body, GenerateRequest): the same request in both wire formats
BAD = [
    ("empty-prompt", {"prompt": [], "max_tokens": 4},
     router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=[]), sampling=S(max_tokens=4))),
    ("token-outside-vocab", {"prompt": [1, 99999], "max_tokens": 4},
     router_pb2.GenerateRequest(prompt_token_ids=router_pb2.TokenIds(ids=[1, 99999]), sampling=S(max_tokens=4))),
    ("stop-token-outside-vocab", {"prompt": "Once", "max_tokens": 4, "stop_token_ids": [99999]},
     router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, stop_token_ids=[99999]))),
    ("past-the-context", {"prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN},
     router_pb2.GenerateRequest(prompt="Once upon a time", sampling=S(max_tokens=MAX_MODEL_LEN))),
    ("text-that-cannot-fit", {"prompt": "x" * 100_000, "max_tokens": 4},
     router_pb2.GenerateRequest(prompt="x" * 100_000, sampling=S(max_tokens=4))),
    ("five-stop-strings", {"prompt": "Once", "max_tokens": 4, "stop": list("abcde")},
     router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4), stop=list("abcde"))),
]


@pytest.fixture
def tok() -> SimpleTokenizer:
    return SimpleTokenizer.from_file(TOKENIZER_JSON, bos_token="<|start_story|>", eos_token="<|end_story|>")


@pytest.fixture
async def doors(tok):
    """(HTTP client, RouterService stub, backend): both front doors over one scripted backend."""
    backend = ScriptedBackend(script=tok.encode(" upon a time there was", add_special_tokens=False))
    server, _ = create_server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(backend, tok, MAX_MODEL_LEN), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    app = build_app(SimpleModelInfo(MODEL, tok, MAX_MODEL_LEN), backend)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http, \
                channel(address) as ch:
            yield http, router_pb2_grpc.RouterServiceStub(ch), backend
    finally:
        await server.stop(0)


@pytest.mark.parametrize(("name", "body", "request_"), BAD, ids=[case[0] for case in BAD])
async def test_a_bad_request_is_refused_with_the_same_message_by_both_front_doors(doors, name, body, request_) -> None:
    http, stub, backend = doors
    resp = await http.post("/v1/completions", json={"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(request_):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == resp.json()["error"]["message"]
    assert backend.calls == []  # refused before reaching the backend


async def test_the_same_request_is_prepared_the_same_by_both_front_doors(doors) -> None:
    http, stub, backend = doors
    sampling = {"max_tokens": 3, "temperature": 0.0, "top_k": 5, "seed": 7, "stop_token_ids": [5]}
    resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "stop": ["zz"], **sampling})
    assert resp.status_code == 200, resp.text
    msgs = [m async for m in stub.Generate(router_pb2.GenerateRequest(prompt="Once upon a time", sampling=S(**sampling),
                                                                     stop=["zz"]))]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    (_, http_ids, http_params), (_, grpc_ids, grpc_params) = backend.calls
    assert http_ids == grpc_ids and http_ids[0] == 1  # BOS first, as the model expects
    assert http_params == grpc_params and http_params.max_tokens == 3 and http_params.greedy


def test_colocated_server_and_front_doors_load_nothing_of_the_services() -> None:
    code = ("import sys, splitserve.colocated.main, splitserve.frontend.grpc_api, splitserve.frontend.http_app; "
            "print(sorted(m for m in sys.modules if m.startswith('splitserve.services')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_temperature_above_openais_two_is_refused_by_both_front_doors(doors) -> None:
    http, stub, backend = doors
    resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 2.5})
    assert resp.status_code == 400 and "temperature" in resp.json()["error"]["param"], resp.text
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, temperature=2.5))):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="Once", sampling=S(max_tokens=4, temperature=2.0))):
        pass  # the top of the range is served
    assert backend.calls != []


async def test_a_negative_seed_draws_as_seed_mod_2_63_over_http_grpc_and_the_python_client(doors, tok) -> None:
    from splitserve.client import RouterClient

    http, stub, backend = doors
    resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3, "seed": -1})
    assert resp.status_code == 200, resp.text
    grpc_backend = ScriptedBackend(script=tok.encode(" upon a time", add_special_tokens=False))
    server, _ = create_server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterServicer(grpc_backend, tok, MAX_MODEL_LEN), server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    try:
        async with RouterClient(address) as client:
            _ = [d async for d in client.generate("Once", max_tokens=3, seed=-1)]
            with pytest.raises(ValueError, match="signed 64-bit"):
                _ = [d async for d in client.generate("Once", max_tokens=3, seed=2**63)]
    finally:
        await server.stop(0)
    (_, _, http_params), (_, _, grpc_params) = backend.calls[0], grpc_backend.calls[0]
    assert http_params.seed == grpc_params.seed == 2**63 - 1
